package sparse

import (
	"encoding/binary"
	"math"

	"github.com/vksparse/vksparse/vk"
)

// attend_partial's interface (shaders/attend_partial.comp), by name: its
// specialization constants (partialSpec), push constants (partialPush)
// and buffers (partialBuffers). Each struct lists its fields in the
// shader's order, the glsl tag naming the declaration a field encodes;
// TestAttendPartialInterface checks them against the shader's source.

// partialGather is attend_partial's GATHER: which tokens a workgroup
// attends.
type partialGather uint32

const (
	// gatherNone attends every token of the sequence, a chunk of them per
	// workgroup.
	gatherNone partialGather = iota
	// gatherLists attends the tokens of one list per KV head.
	gatherLists
	// gatherClusters attends the members of the clusters some query head
	// of the KV head takes, and the fixed tokens outside the clusters.
	gatherClusters
)

// partialSpec is attend_partial's specialization constants, in
// constant_id order (the workgroup's size is constant 0).
type partialSpec struct {
	Workgroup     uint32 `glsl:"WG"`    // threads, a power of two
	Dim           uint32 `glsl:"D"`     // head dimension
	Group         uint32 `glsl:"GROUP"` // query heads per workgroup
	Tile          uint32 `glsl:"TILE"`  // tokens scored at once
	ThreadsPerRow uint32 `glsl:"TPR"`   // threads sharing a K row
	// SubgroupReduce is 1 where reductions use subgroup arithmetic, 0
	// where they go through shared memory only.
	SubgroupReduce uint32        `glsl:"SUBGROUP_REDUCE"`
	Unroll         uint32        `glsl:"UNROLL"`       // value rows a thread loads at once
	ScoreSlots     uint32        `glsl:"SCORE_SLOTS"`  // shared floats for scores
	ReduceSlots    uint32        `glsl:"REDUCE_SLOTS"` // shared floats for reductions
	Gather         partialGather `glsl:"GATHER"`
	RowsPerThread  uint32        `glsl:"RPT"`    // K rows a thread scores at once
	Window         uint32        `glsl:"WINDOW"` // clusters scanned at once (gatherClusters)
	// Approx is 1 where attention over clusters adds pseudo-tokens.
	Approx uint32 `glsl:"APPROX"`
	// Logits is 1 where attention also writes its logits (and, over
	// clusters, each head's softmax normaliser).
	Logits uint32 `glsl:"LOGITS"`
	// Unit is, for attention over an index of single tokens (cluster c is
	// token First + c), the clusters each thread decides per window; 0
	// for any index.
	Unit uint32 `glsl:"UNIT"`
}

// words returns the constants as the pipeline takes them, constant_id i
// at index i.
func (s partialSpec) words() []uint32 {
	return []uint32{s.Workgroup, s.Dim, s.Group, s.Tile, s.ThreadsPerRow, s.SubgroupReduce, s.Unroll,
		s.ScoreSlots, s.ReduceSlots, uint32(s.Gather), s.RowsPerThread, s.Window, s.Approx, s.Logits, s.Unit}
}

// partialPush is attend_partial's push constants, in the order of its
// push_constant block. N and Chunk mean what the kernel's GATHER makes
// them mean; the fields from Clusters on are read by gatherClusters only.
type partialPush struct {
	// N is the tokens of the sequence; with gatherLists, the stride of the
	// token lists.
	N          uint32 `glsl:"n"`
	HeadStride uint32 `glsl:"headStride"` // 16-byte words between KV heads in the cache
	KVBase     uint32 `glsl:"kvBase"`     // the bound range's first KV head
	Seq        uint32 `glsl:"seq"`        // the sequence's index in the batch
	// Chunk is the tokens per chunk; with gatherLists the least tokens per
	// chunk, with gatherClusters the clusters per run.
	Chunk      uint32  `glsl:"chunk"`
	MaxChunks  uint32  `glsl:"maxChunks"` // chunk slots per sequence and head in the partials
	Scale      float32 `glsl:"scale"`     // multiplies q·k
	QueryHeads uint32  `glsl:"qHeads"`    // query heads per sequence
	GroupSize  uint32  `glsl:"groupSize"` // query heads per KV head
	Clusters   uint32  `glsl:"C"`         // clusters per KV head
	// ClusterChunks is the runs of clusters of a head block (unused with a
	// run table); workgroups past them take fixed tokens.
	ClusterChunks uint32 `glsl:"clusterChunks"`
	Clustered     uint32 `glsl:"clustered"`    // members per KV head
	First         uint32 `glsl:"first"`        // the first clustered token
	ClusteredEnd  uint32 `glsl:"clusteredEnd"` // the token after the last clustered one
	// RunTable is the head blocks of a one-dimensional grid whose
	// workgroups are each block's Runs runs, then its FixedChunks chunks of
	// fixed tokens; 0 for a grid whose y is the head block.
	RunTable    uint32                `glsl:"runTable"`
	Runs        [runTableBlocks]uint8 `glsl:"runLo,runHi"` // runs per head block of the table
	FixedChunks uint32                `glsl:"fixedChunks"` // chunks of fixed tokens per head block
	RowStride   uint32                `glsl:"rowStride"`   // floats between query heads' rows of logits (Logits)
	FixedTile   uint32                `glsl:"fixedTile"`   // fixed tokens per chunk of them, at most the tile
}

// words returns the push constants as a dispatch takes them; Runs packs
// four blocks to a word, block 4i+j in byte j of word i.
func (p partialPush) words() []uint32 {
	return []uint32{p.N, p.HeadStride, p.KVBase, p.Seq, p.Chunk, p.MaxChunks, math.Float32bits(p.Scale), p.QueryHeads, p.GroupSize,
		p.Clusters, p.ClusterChunks, p.Clustered, p.First, p.ClusteredEnd, p.RunTable,
		binary.LittleEndian.Uint32(p.Runs[0:4]), binary.LittleEndian.Uint32(p.Runs[4:8]), p.FixedChunks, p.RowStride, p.FixedTile}
}

// partialBuffers is attend_partial's buffers in binding order. A mode
// binds only those its kernel reads; ranges gives the others a stand-in.
type partialBuffers struct {
	Queries   vk.Range `glsl:"Queries"`   // float32 [B][Hq][D]
	Keys      vk.Range `glsl:"Keys"`      // the bound KV heads' keys
	Values    vk.Range `glsl:"Values"`    // the bound KV heads' values
	PartialO  vk.Range `glsl:"PartialO"`  // float32 [B][Hq][maxChunks][D]
	PartialML vk.Range `glsl:"PartialML"` // float32 [B][Hq][maxChunks][2]
	// gatherLists: the token lists and their lengths.
	Tokens      vk.Range `glsl:"Tokens"`      // uint32 [KV][stride]
	TokenCounts vk.Range `glsl:"TokenCounts"` // uint32 [KV]
	// gatherClusters: the ranks and cuts that take clusters, and the
	// index's runs of slots.
	Rank    vk.Range `glsl:"Rank"`    // uint32 [Hq][C]
	Cut     vk.Range `glsl:"Cut"`     // uint32 [Hq]
	Starts  vk.Range `glsl:"Starts"`  // uint32 [KV][C]
	Sizes   vk.Range `glsl:"Sizes"`   // uint32 [KV][C]
	Members vk.Range `glsl:"Members"` // not read: clusters are runs of slots
	// Arrivals counts each head block's workgroups, [B][Hq/group][2]
	// uint32, 0 between dispatches.
	Arrivals vk.Range `glsl:"Arrivals"`
	Out      vk.Range `glsl:"Out"` // float32 [B][Hq][D]
	// Approx: the pseudo-tokens' logits, keeps and values.
	Logits vk.Range `glsl:"Logits"` // float32 [Hq][C]
	Keep   vk.Range `glsl:"Keep"`   // uint32 [Hq]
	Means  vk.Range `glsl:"Means"`  // fp16 [KV][C][D]
	// Taken receives the rows each head block attended (gatherClusters).
	Taken vk.Range `glsl:"Taken"`
	// Logits: every logit computed, float32 [B][Hq][RowStride] by slot,
	// and (gatherClusters) each head's normaliser, float32 [B][Hq][2].
	Rows  vk.Range `glsl:"Rows"`
	Norms vk.Range `glsl:"Norms"`
}

// ranges returns the buffers in binding order, unused in place of each
// that is not set (a binding needs a valid range even where the kernel
// does not read it).
func (b partialBuffers) ranges(unused vk.Range) []vk.Range {
	all := []vk.Range{b.Queries, b.Keys, b.Values, b.PartialO, b.PartialML, b.Tokens, b.TokenCounts,
		b.Rank, b.Cut, b.Starts, b.Sizes, b.Members, b.Arrivals, b.Out, b.Logits, b.Keep, b.Means, b.Taken, b.Rows, b.Norms}
	for i, r := range all {
		if r.Buffer == nil {
			all[i] = unused
		}
	}
	return all
}

// The kernel's layout: its bindings and push-constant words.
const (
	partialBindings  = 20
	partialPushWords = 20
)
