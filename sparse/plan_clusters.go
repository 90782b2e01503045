package sparse

import (
	"fmt"
	"slices"
	"sort"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/vk"
)

// clusterMode attends, for every query head of KV head g, the tokens
// outside the index and the members of every cluster of g that some
// query head of g takes; with approx, also the pseudo-tokens of the
// clusters a head keeps and no head of g takes.
type clusterMode struct {
	index *kvcache.Clusters
	// clusterChunk is the clusters of a run (a workgroup's share);
	// fixedRuns: set by the selection (Selection.RunClusters).
	clusterChunk int
	fixedRuns    bool
	rank, cut    vk.Range // which clusters each query head takes
	// runs, when set, is the runs of clusters per head block ([KV][blocks])
	// in place of equal runs (SetRuns); mostRuns caps each.
	runs     []int
	mostRuns int
	// fixedSlots: the chunk slots the plan keeps for fixed tokens.
	fixedSlots int
	approx     *Approximation   // the pseudo-tokens' buffers; nil without
	saved      *AttentionRecord // where logits and normalisers go; nil without
	// unit: every cluster is one token (kvcache.Clusters.SingleTokens) and
	// no pseudo-tokens are added, so a kernel for single tokens attends it.
	unit bool
	pipe *vk.Pipeline // attend_partial specialized by spec
}

// PlanClusters prepares attention of one sequence over a clustered cache,
// stored in cluster order (clusters.Contiguous, kvcache.Layer.Reorder):
// every query head of KV head g attends the tokens outside the clusters
// ([0, First) and [First+Count, n)) and the members of every cluster c of
// g that some query head h of g takes, rank[h][c] < cut[h] (uint32 ranges
// [Hq][C] and [Hq], written by earlier kernels; the caller keeps them
// alive). Workgroups take fixed runs of clusters and skip those not taken,
// so no token list is built.
func (d *Dense) PlanClusters(layer *kvcache.Layer, clusters *kvcache.Clusters, rank, cut vk.Range) (*DensePlan, error) {
	return d.PlanSelection(layer, Selection{Clusters: clusters, Rank: rank, Cut: cut})
}

// PlanSelection prepares attention of one sequence over a policy's
// selection: PlanClusters over sel's clusters, ranks and cuts, and, where
// sel.Approx is set, each query head h also attends one pseudo-token per
// cluster c of its KV head g that no head of g takes and that h keeps,
// rank[h][c] < Approx.Keep[h]: logit Approx.Logits[h][c], value
// Approx.Means[g][c] (Double-P's Eq. 8–9).
func (d *Dense) PlanSelection(layer *kvcache.Layer, sel Selection) (*DensePlan, error) {
	h, clusters, rank, cut := d.heads, sel.Clusters, sel.Rank, sel.Cut
	if clusters == nil {
		return nil, fmt.Errorf("sparse: a selection without clusters")
	}
	switch {
	case d.clustered == nil:
		return nil, fmt.Errorf("%w: attention over clusters needs more shared memory than the device has", vk.ErrUnsupported)
	case layer.KVHeads() != h.KV || layer.HeadDim() != h.Dim:
		return nil, fmt.Errorf("sparse: the cache has %d KV heads of %d, kernels want %d of %d", layer.KVHeads(), layer.HeadDim(), h.KV, h.Dim)
	case clusters.KVHeads != h.KV || clusters.First+clusters.Count > layer.Capacity():
		return nil, fmt.Errorf("sparse: an index of %d KV heads over tokens [%d, %d) for a cache of %d heads and capacity %d", clusters.KVHeads, clusters.First, clusters.First+clusters.Count, h.KV, layer.Capacity())
	case rank.Size < uint64(h.Query*clusters.C)*4 || cut.Size < uint64(h.Query)*4:
		return nil, fmt.Errorf("sparse: ranks of %d bytes and cuts of %d for %d query heads of %d clusters", rank.Size, cut.Size, h.Query, clusters.C)
	case !clusters.Contiguous:
		return nil, fmt.Errorf("sparse: attention over clusters reads them as runs of slots: put the layer in cluster order first (kvcache.Layer.Reorder)")
	}
	per := d.opts.ClusterChunk
	if sel.RunClusters > 0 {
		per = sel.RunClusters
	}
	if per <= 0 {
		per = clusterRun(clusters.C, d.headBlocks(), 1)
	}
	most := min(runTableMost, max(1, runTableSpread*ceilDiv(clusters.C, per)))
	fixed := fixedSlots(layer.Capacity()-clusters.Count, d.clusterTile)
	chunks := max(ceilDiv(clusters.C, per), most) + fixed
	if a := sel.Approx; a != nil {
		c := uint64(h.Query * clusters.C)
		if a.Keep.Size < uint64(h.Query)*4 || a.Logits.Size < c*4 || a.Means.Size < uint64(h.KV*clusters.C*h.Dim)*2 {
			return nil, fmt.Errorf("sparse: pseudo-tokens with keeps of %d bytes, logits of %d and means of %d for %d query heads of %d clusters", a.Keep.Size, a.Logits.Size, a.Means.Size, h.Query, clusters.C)
		}
	}
	m := &clusterMode{index: clusters, clusterChunk: per, fixedRuns: sel.RunClusters > 0, rank: rank, cut: cut, approx: sel.Approx, mostRuns: most, fixedSlots: fixed,
		unit: sel.Approx == nil && clusters.SingleTokens()}
	if r := sel.Record; r != nil {
		switch {
		case sel.Approx != nil:
			return nil, fmt.Errorf("sparse: attention with pseudo-tokens does not record its logits")
		case r.RowStride < layer.Capacity() || r.Rows.Size < uint64(h.Query)*uint64(r.RowStride)*4 || r.Norms.Size < uint64(h.Query)*8:
			return nil, fmt.Errorf("sparse: a record of %d bytes of logits in rows of %d and %d bytes of normalisers for %d query heads of capacity %d", r.Rows.Size, r.RowStride, r.Norms.Size, h.Query, layer.Capacity())
		}
		m.saved = r
	}
	m.pipe = d.clustered
	if spec := m.spec(d); spec != d.clusterSpec {
		var err error
		if m.pipe, err = d.variant(spec); err != nil {
			return nil, err
		}
	}
	return d.newPlan([]*kvcache.Layer{layer}, chunks, m)
}

// clusterModeOf returns p's mode where p attends a selection of clusters.
func clusterModeOf(p *DensePlan) (*clusterMode, bool) {
	m, ok := p.mode.(*clusterMode)
	return m, ok
}

func (m *clusterMode) bindings(d *Dense, b *partialBuffers) *vk.Pipeline {
	x := m.index
	members := x.Members
	if members == nil {
		members = x.Starts // a page index; attend_partial reads no members
	}
	b.Rank, b.Cut, b.Starts, b.Sizes, b.Members = m.rank, m.cut, x.Starts.All(), x.Counts.All(), members.All()
	if a := m.approx; a != nil {
		b.Logits, b.Keep, b.Means = a.Logits, a.Keep, a.Means
	}
	if r := m.saved; r != nil {
		b.Rows, b.Norms = r.Rows, r.Norms
	}
	return m.pipe
}

// spec returns the specialization of attend_partial that attends m: with
// pseudo-tokens (each run lists its clusters' among its members' rows), or over
// single tokens and writing the logits where m asks for them.
func (m *clusterMode) spec(d *Dense) partialSpec {
	s := d.clusterSpec
	if m.approx != nil {
		s.Approx = 1
		return s
	}
	if m.unit {
		s.Unit = unitClusters
	}
	if m.saved != nil {
		s.Logits = 1
	}
	return s
}

// record records the whole attention over the taken clusters and the
// fixed tokens in one dispatch per range of KV heads, for a stage that
// sequences plans share: a workgroup per run of clusters (runClusters, or
// the plan's runs per head block), then one per chunk of fixed tokens
// (fixedTile), each writing its partial (m = −∞ where it attends nothing),
// and the last workgroup of each head block merging them into the output.
func (m *clusterMode) record(c *vk.Commands, p *DensePlan, sequences int) error {
	d, x := p.d, m.index
	n := p.seqs[0].Len()
	end := x.First + x.Count
	if n < end {
		return fmt.Errorf("sparse: the cache holds %d tokens, its clusters end at %d", n, end)
	}
	per := m.runClusters(d, sequences)
	runs := ceilDiv(x.C, per)
	tile := fixedTile(n-x.Count, m.fixedSlots, d.headBlocks(), sequences, d.clusterTile)
	fixed := ceilDiv(n-x.Count, tile)
	pipe := m.pipe
	blocks := d.blocksPerKV()
	for _, seg := range p.segments[0] {
		push := p.push(0, seg)
		push.N, push.Chunk, push.FixedChunks, push.FixedTile = uint32(n), uint32(per), uint32(fixed), uint32(tile)
		if m.saved != nil {
			push.RowStride = uint32(m.saved.RowStride)
		}
		push.Clusters, push.ClusterChunks, push.Clustered, push.First, push.ClusteredEnd = uint32(x.C), uint32(runs), uint32(x.Count), uint32(x.First), uint32(end)
		nb := seg.kvCount * blocks
		if m.runs == nil || nb > runTableBlocks {
			c.Dispatch(pipe, seg.bind, push.words(), uint32(runs+fixed), uint32(nb), 1)
			continue
		}
		grid := 0
		for j, r := range m.runs[seg.kvBase*blocks : seg.kvBase*blocks+nb] {
			push.Runs[j] = uint8(r)
			grid += r + fixed
		}
		push.RunTable = uint32(nb)
		c.Dispatch(pipe, seg.bind, push.words(), uint32(grid), 1, 1)
	}
	return nil
}

func (m *clusterMode) bytes() uint64 { return 0 } // the index, ranks and cuts are the caller's

func (m *clusterMode) release() error { return nil }

// clusterRun returns the clusters of a KV head that a run of attention
// over clusters takes, for KV heads of c clusters, blocks head blocks in
// all and sequences sequences sharing the dispatch: at least
// clusterChunkMin, enough for about clusterWorkgroups workgroups a
// sequence, and, beyond clusterBatchSequences sequences, about
// clusterBatchSequences·clusterWorkgroups in all. Each run's workgroup
// costs its queries, its windows' scans, its partial and its arrival
// whatever it attends; a batch's several waves of them even out the runs'
// members without as many of those fixed costs. On the H100 (llama, P 0.9,
// batch 8, runs balanced by the step before) attention took 80, 77 and 89
// µs at 32 768 tokens with 1, 2 and 4 waves of runs, 213, 177 and 175 at
// 131 072; with equal runs 117, 92 and 89 µs with 8, 4 and 2 waves.
func clusterRun(c, blocks, sequences int) int {
	return max(clusterChunkMin, ceilDiv(c*blocks, sequenceWorkgroups(sequences)))
}

// sequenceWorkgroups returns the workgroups of attention over clusters a
// sequence aims at when sequences sequences share the dispatch:
// clusterWorkgroups, and beyond clusterBatchSequences sequences
// clusterBatchSequences·clusterWorkgroups in all.
func sequenceWorkgroups(sequences int) int {
	if sequences > clusterBatchSequences {
		return max(1, clusterBatchSequences*clusterWorkgroups/sequences)
	}
	return clusterWorkgroups
}

// runClusters returns the clusters of a run when the plans of sequences
// sequences share a stage's dispatches: Selection.RunClusters or
// DenseOptions.ClusterChunk where set, clusterRun otherwise.
func (m *clusterMode) runClusters(d *Dense, sequences int) int {
	if d.opts.ClusterChunk > 0 || m.fixedRuns {
		return m.clusterChunk
	}
	return clusterRun(m.index.C, d.headBlocks(), sequences)
}

// fixedSlots returns the chunk slots a plan keeps for up to tokens fixed
// tokens (outside the clusters) in chunks of at most tile: enough for
// chunks of fixedTileLeast (or tile, where smaller) up to fixedSlotsMost
// slots, and for chunks of tile beyond.
func fixedSlots(tokens, tile int) int {
	return min(ceilDiv(tokens, min(fixedTileLeast, tile)), max(ceilDiv(tokens, tile), fixedSlotsMost))
}

// fixedTile returns the fixed tokens a workgroup of attention over
// clusters takes, for count fixed tokens in at most slots chunks, blocks
// head blocks and sequences sequences sharing the dispatch: enough chunks
// for about clusterWorkgroups workgroups a sequence (fewer beyond
// clusterBatchSequences sequences, as clusterRun), each of at least
// fixedTileLeast tokens and at most tile. A chunk is a chain of about
// 2·chunk/128 round trips to memory for its keys and values, so a few
// thousand fixed tokens (StreamingLLM's) in whole tiles kept a few SMs
// busy for 14 round trips while the others idled.
func fixedTile(count, slots, blocks, sequences, tile int) int {
	t := min(tile, max(fixedTileLeast, ceilDiv(count*blocks, sequenceWorkgroups(sequences))))
	return max(t, ceilDiv(count, max(1, slots)))
}

// Chunks of fixed tokens: at least fixedTileLeast tokens each, and a plan
// keeps slots for at most fixedSlotsMost such chunks (or as many as its
// fixed tokens need in whole tiles).
const (
	fixedTileLeast = 256
	fixedSlotsMost = 64
)

// Runs of attention over clusters set per head block (DensePlan.SetRuns):
// a dispatch's table holds up to runTableBlocks blocks, a byte each; a
// block takes at most runTableSpread times the equal runs of one sequence.
const (
	runTableBlocks = 8
	runTableMost   = 255
	runTableSpread = 4
)

// SetRuns sets how many runs of clusters each head block of attention
// over clusters takes (runs[g·blocks + j] for block j of KV head g, each
// from 1 to MostRuns), in place of equal runs; nil restores equal runs.
// The output is the same either way: runs only divide the work. Dispatches
// over more than runTableBlocks head blocks keep equal runs.
func (p *DensePlan) SetRuns(runs []int) error {
	m, ok := clusterModeOf(p)
	if !ok {
		return fmt.Errorf("sparse: runs of clusters for a plan without clusters")
	}
	blocks := p.d.headBlocks()
	if runs != nil && len(runs) != blocks {
		return fmt.Errorf("sparse: %d runs for %d head blocks", len(runs), blocks)
	}
	for j, r := range runs {
		if r < 1 || r > m.mostRuns {
			return fmt.Errorf("sparse: %d runs for head block %d, want 1 to %d", r, j, m.mostRuns)
		}
	}
	m.runs = slices.Clone(runs)
	return nil
}

// MostRuns is the most runs SetRuns gives a head block (0 for a plan
// without clusters).
func (p *DensePlan) MostRuns() int {
	if m, ok := clusterModeOf(p); ok {
		return m.mostRuns
	}
	return 0
}

// Rebalance sets the runs per head block (SetRuns) for the next attention
// over clusters from the rows each block attended in the last one
// (Taken): balancedRuns over the equal runs' total when sequences plans
// share the stage, within runBounds. Until some block has attended a row,
// and where more equal runs than a table holds are chosen, the blocks keep
// equal runs.
func (p *DensePlan) Rebalance(sequences int) error {
	m, ok := clusterModeOf(p)
	if !ok {
		return fmt.Errorf("sparse: Rebalance of a plan without clusters")
	}
	taken, err := p.Taken()
	if err != nil {
		return err
	}
	c := m.index.C
	equal := ceilDiv(c, m.runClusters(p.d, sequences))
	least, most := runBounds(c, equal, p.d.window)
	most = min(most, m.mostRuns)
	if least > most {
		return p.SetRuns(nil) // more equal runs than a table holds
	}
	return p.SetRuns(balancedRuns(taken, equal*len(taken), least, most))
}

// runBounds returns the fewest and most runs a head block of c clusters
// gets when balanced around equal runs of a block: at least 1/runLeast of
// them, and no fewer than make runs of runScanWindows windows of window
// clusters (each window's scan costs a workgroup about 2 µs on the H100),
// but never more than equal; at most runTableSpread times equal.
func runBounds(c, equal, window int) (least, most int) {
	least = min(equal, max(1, equal/runLeast, ceilDiv(c, runScanWindows*window)))
	return least, runTableSpread * equal
}

// A head block keeps at least 1/runLeast of its equal runs, and runs of at
// most runScanWindows windows. On the H100 (P 0.9, 131 072 tokens in
// clusters of 16: runs of 2 048 clusters at the least) balanced runs took
// Tactic's attention 39 → 37 µs on llama and 51 → 45 on megabeam keeping an
// eighth, against 40 and 47 keeping a quarter and 41 and 45 a sixteenth,
// and Double-P's 62 → 56 on llama. Without the bound on windows, the
// token oracle's clusters of one token left runs of 32 768 clusters, and
// its attention took 245 µs against 74.
const (
	runLeast       = 8
	runScanWindows = 8
)

// balancedRuns shares total runs among blocks in proportion to the members
// each attends (largest remainders), each between least and most; nil
// where no block attends a member.
func balancedRuns(members []uint32, total, least, most int) []int {
	sum := 0.0
	for _, m := range members {
		sum += float64(m)
	}
	if sum == 0 {
		return nil
	}
	runs := make([]int, len(members))
	left := total
	for i := range runs {
		runs[i] = least
		left -= least
	}
	// Shares of what is left, in proportion and within most.
	type part struct {
		i    int
		frac float64
	}
	var parts []part
	given := total - left
	for i, m := range members {
		share := float64(left) * float64(m) / sum
		add := min(int(share), most-runs[i])
		runs[i] += add
		given += add
		parts = append(parts, part{i, share - float64(int(share))})
	}
	sort.Slice(parts, func(a, b int) bool { return parts[a].frac > parts[b].frac })
	for _, pt := range parts {
		if given >= total {
			break
		}
		if runs[pt.i] < most {
			runs[pt.i]++
			given++
		}
	}
	return runs
}
