package sparse

import (
	"errors"
	"fmt"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/vk"
)

// gatherMode attends, for every query head of KV head g, exactly the
// tokens of list g.
type gatherMode struct {
	stride int // entries per list
	chunk  int // least tokens per chunk
	// tokens and counts are the lists and their lengths, uint32
	// [KV][stride] and [KV].
	tokens, counts *vk.Buffer
}

// PlanGather prepares attention of one sequence over a list of tokens per
// KV head (at most stride each): every query head of KV head g attends
// exactly the tokens of list g. The lists live on the device (Tokens,
// TokenCounts) so that GPU kernels can fill them; the kernel sizes the
// chunks from the counts on the device.
func (d *Dense) PlanGather(layer *kvcache.Layer, stride int) (*DensePlan, error) {
	if stride <= 0 || stride > layer.Capacity() {
		return nil, fmt.Errorf("sparse: token lists of %d entries for a cache of capacity %d", stride, layer.Capacity())
	}
	if layer.KVHeads() != d.heads.KV || layer.HeadDim() != d.heads.Dim {
		return nil, fmt.Errorf("sparse: the cache has %d KV heads of %d, kernels want %d of %d", layer.KVHeads(), layer.HeadDim(), d.heads.KV, d.heads.Dim)
	}
	// Chunks of at least gatherMin tokens, sized on the device from
	// the lists' total length so that all lists take about
	// gatherWorkgroups chunks together, spread as the lengths are; a list
	// never takes more, so that is the grid per head.
	chunks := max(1, min(gatherWorkgroups/max(1, d.blocksPerKV()), ceilDiv(stride*d.heads.KV, d.gatherMin)))
	m := &gatherMode{stride: stride, chunk: d.gatherMin}
	var err error
	if m.tokens, err = d.dev.NewBuffer(uint64(d.heads.KV*stride)*4, vk.DeviceLocal); err == nil {
		m.counts, err = d.dev.NewBuffer(uint64(d.heads.KV)*4, vk.DeviceLocal)
	}
	if err != nil {
		return nil, errors.Join(err, m.release())
	}
	return d.newPlan([]*kvcache.Layer{layer}, chunks, m)
}

// gatherModeOf returns p's mode where p attends token lists.
func gatherModeOf(p *DensePlan) (*gatherMode, bool) {
	m, ok := p.mode.(*gatherMode)
	return m, ok
}

// Tokens returns the token lists, uint32 [KVHeads][stride] (PlanGather;
// nil for other plans).
func (p *DensePlan) Tokens() *vk.Buffer {
	if m, ok := gatherModeOf(p); ok {
		return m.tokens
	}
	return nil
}

// TokenCounts returns the list lengths, uint32 [KVHeads] (PlanGather; nil
// for other plans).
func (p *DensePlan) TokenCounts() *vk.Buffer {
	if m, ok := gatherModeOf(p); ok {
		return m.counts
	}
	return nil
}

// GatherChunk returns the least tokens per chunk of a PlanGather plan (0
// for other plans).
func (p *DensePlan) GatherChunk() int {
	if m, ok := gatherModeOf(p); ok {
		return m.chunk
	}
	return 0
}

// SetTokens uploads one token list per KV head (each non-empty, at most
// the plan's stride, tokens below the cache's length).
func (p *DensePlan) SetTokens(lists [][]int32) error {
	m, ok := gatherModeOf(p)
	if !ok {
		return fmt.Errorf("sparse: SetTokens on a plan without token lists")
	}
	h := p.d.heads
	if len(lists) != h.KV {
		return fmt.Errorf("sparse: %d token lists for %d KV heads", len(lists), h.KV)
	}
	flat := make([]uint32, h.KV*m.stride)
	counts := make([]uint32, h.KV)
	n := p.seqs[0].Len()
	for g, l := range lists {
		if len(l) == 0 || len(l) > m.stride {
			return fmt.Errorf("sparse: token list %d has %d entries (1 to %d allowed)", g, len(l), m.stride)
		}
		for i, t := range l {
			if t < 0 || int(t) >= n {
				return fmt.Errorf("sparse: token list %d entry %d is %d, outside the %d stored tokens", g, i, t, n)
			}
			flat[g*m.stride+i] = uint32(t)
		}
		counts[g] = uint32(len(l))
	}
	return errors.Join(m.tokens.WriteUint32(0, flat), m.counts.WriteUint32(0, counts))
}

func (m *gatherMode) bindings(d *Dense, b *partialBuffers) *vk.Pipeline {
	b.Tokens, b.TokenCounts = m.tokens.All(), m.counts.All()
	return d.gather
}

// record dispatches attention over the token lists in one dispatch per
// range of KV heads: a fixed grid of maxChunks chunks per head block,
// sized on the device from the list lengths; workgroups past a head's
// last chunk exit at once, and the last of the others in each head block
// to finish merges them.
func (m *gatherMode) record(c *vk.Commands, p *DensePlan, _ int) error {
	for _, seg := range p.segments[0] {
		push := p.push(0, seg)
		push.N, push.Chunk = uint32(m.stride), uint32(m.chunk)
		c.Dispatch(p.d.gather, seg.bind, push.words(), uint32(p.maxChunks), uint32(seg.kvCount*p.d.blocksPerKV()), 1)
	}
	return nil
}

func (m *gatherMode) bytes() uint64 { return vk.Held(m.tokens, m.counts) }

func (m *gatherMode) release() error {
	err := releaseAll(m.tokens, m.counts)
	m.tokens, m.counts = nil, nil
	return err
}
