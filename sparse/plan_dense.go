package sparse

import (
	"fmt"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/vk"
)

// denseMode attends every token of each sequence, in chunks of tokens;
// with logits it also writes every logit it computes.
type denseMode struct {
	// logits, with PlanLogits, receives every logit, float32 [Hq][Len] of
	// the one sequence (rows of Len floats from the start).
	logits *vk.Buffer
	pipe   *vk.Pipeline // attend_partial, writing the logits with them
}

// Plan prepares attention over the sequences (one query per sequence).
func (d *Dense) Plan(seqs []*kvcache.Layer) (*DensePlan, error) {
	return d.PlanChunks(seqs, defaultMaxChunk)
}

// PlanChunks is Plan with at most maxChunks chunks per sequence and head
// (Plan takes 512): fewer chunks, longer each, for batches of many
// sequences that fill the device without splitting them finely, whose
// partials then take less memory.
func (d *Dense) PlanChunks(seqs []*kvcache.Layer, maxChunks int) (*DensePlan, error) {
	if len(seqs) == 0 {
		return nil, fmt.Errorf("sparse: Plan of an empty batch")
	}
	if maxChunks <= 0 || maxChunks > defaultMaxChunk {
		return nil, fmt.Errorf("sparse: %d chunks per sequence outside [1, %d]", maxChunks, defaultMaxChunk)
	}
	h := d.heads
	for i, s := range seqs {
		if s.KVHeads() != h.KV || s.HeadDim() != h.Dim {
			return nil, fmt.Errorf("sparse: sequence %d has %d KV heads of %d, kernels want %d of %d", i, s.KVHeads(), s.HeadDim(), h.KV, h.Dim)
		}
	}
	return d.newPlan(seqs, maxChunks, &denseMode{pipe: d.partial})
}

// PlanLogits prepares dense attention over one sequence that also writes
// every logit scale·q_h·k_t it computes into Logits, float32 [Hq][Len]
// (DELTA's token scores read them).
func (d *Dense) PlanLogits(layer *kvcache.Layer) (*DensePlan, error) {
	spec := d.spec
	spec.Logits = 1
	pipe, err := d.variant(spec)
	if err != nil {
		return nil, err
	}
	if layer.KVHeads() != d.heads.KV || layer.HeadDim() != d.heads.Dim {
		return nil, fmt.Errorf("sparse: a sequence of %d KV heads of %d, kernels want %d of %d", layer.KVHeads(), layer.HeadDim(), d.heads.KV, d.heads.Dim)
	}
	logits, err := d.dev.NewBuffer(uint64(d.heads.Query)*uint64(layer.Capacity())*4, vk.DeviceLocal)
	if err != nil {
		return nil, err
	}
	return d.newPlan([]*kvcache.Layer{layer}, defaultMaxChunk, &denseMode{logits: logits, pipe: pipe})
}

// Logits returns where a PlanLogits plan writes its logits, float32
// [Hq][Len] (nil for other plans).
func (p *DensePlan) Logits() *vk.Buffer {
	if m, ok := p.mode.(*denseMode); ok {
		return m.logits
	}
	return nil
}

func (m *denseMode) bindings(d *Dense, b *partialBuffers) *vk.Pipeline {
	if m.logits != nil {
		b.Rows = m.logits.All()
	}
	return m.pipe
}

// record dispatches, per sequence and range of KV heads, a workgroup per
// chunk of tokens (chunkFor) and head block.
func (m *denseMode) record(c *vk.Commands, p *DensePlan, _ int) error {
	for b, s := range p.seqs {
		n := s.Len()
		if n == 0 {
			return fmt.Errorf("sparse: sequence %d is empty", b)
		}
		chunk := p.chunkFor(n)
		nc := ceilDiv(n, chunk)
		if nc > p.maxChunks {
			return fmt.Errorf("sparse: sequence %d of %d tokens needs %d chunks, plan has %d", b, n, nc, p.maxChunks)
		}
		for _, seg := range p.segments[b] {
			push := p.push(b, seg)
			push.N, push.Chunk, push.RowStride = uint32(n), uint32(chunk), uint32(n)
			c.Dispatch(m.pipe, seg.bind, push.words(), uint32(nc), uint32(seg.kvCount*p.d.blocksPerKV()), 1)
		}
	}
	return nil
}

func (m *denseMode) bytes() uint64 { return vk.Held(m.logits) }

func (m *denseMode) release() error {
	err := releaseAll(m.logits)
	m.logits = nil
	return err
}

// chunkFor picks tokens per chunk for a sequence of n tokens: about 512
// workgroups in all, but chunks of at least a tile (or of a quarter of that
// many workgroups' share) so that long contexts are not split finer than
// pays; at most maxChunks chunks per sequence.
func (p *DensePlan) chunkFor(n int) int {
	d := p.d
	c := d.ChunkTokens
	if c <= 0 {
		total := 0
		for _, s := range p.seqs {
			total += s.Len()
		}
		blocks := d.headBlocks()
		fine := ceilDiv(ceilDiv(total*blocks, targetWorkgroups), 64) * 64
		coarse := ceilDiv(ceilDiv(total*blocks, targetWorkgroups/4), 64) * 64
		c = max(fine, min(d.tile, coarse))
	}
	return max(c, 1, ceilDiv(n, p.maxChunks))
}
