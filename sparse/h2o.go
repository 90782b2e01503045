package sparse

import (
	"errors"
	"fmt"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/vk"
)

// H2OStages names H2OSelector's dispatch: the previous step's attention
// accumulated, then the selection.
var H2OStages = []string{"select"}

// H2OSelector is H2O on the GPU over a single-token index of a positional
// layer (kvcache.NewPages with pages of one token), its state, every query
// head's accumulated attention to each indexed token, kept on the device
// (float32 [Hq][C]) from one step to the next. A step's selection is
// exactly H2O.Select's from that state: the recent part (the last recent
// indexed tokens) always, and the heavy part, the heavy tokens of the
// greatest accumulated attention among the others, ties to the lower id
// (an exact radix select over the float32 scores, no bins), with (heavy,
// recent) = H2OSplit(budget); every indexed token when the budget covers
// the index. A head takes the tokens it ranks below its cut: the recent
// part ranks 0, and a candidate 2^31 − its score's float32 bits with the
// cut just past the heavy-th greatest score's rank, or, where that score
// has ties beyond the heavy part, 0 for a token taken and 1 for the
// others with cut 1.
//
// A step's weights are accumulated at the next step, before its
// selection: the step's attention records its logits over every token
// the KV head attended (outside the index, or taken by some query head of
// its group) and each head's softmax normaliser (Selection.Record), and
// the next selection adds the weights they give, so a selection uses the
// state of the steps before it, as H2O's does, without reading a key.
// Observe adds a dense prompt-phase softmax (H2O.Observe). The index is
// fixed when the selector is made; tokens appended later are outside it
// and attended.
type H2OSelector struct {
	dense         *Dense
	layer         *kvcache.Layer
	tokens        *kvcache.Clusters
	owned         *kvcache.Clusters // released with the selector
	heavy, recent int
	cands         int    // candidates for the heavy part: indexed tokens [0, cands)
	heads         int    // query heads per block of h2o_score
	wg            uint32 // threads of an h2o_score workgroup
	shape         h2oSelectShape
	score, choose *vk.Pipeline
	observeBind   *vk.Binding // Observe's query
	chooseBind    *vk.Binding
	bufs          []*vk.Buffer
	acc           *vk.Buffer // float32 [Hq][C]
	rank, cut     *vk.Buffer // uint32 [Hq][C] and [Hq]
	// rows and norms hold the logits and normalisers of the attention not
	// yet accumulated, float32 [Hq][capacity] (−∞ where none is left) and
	// [Hq][2]: the last step's (its AttentionRecord) or the prompt
	// phase's.
	rows, norms *vk.Buffer
	// The scratch, state within one step (h2oScratch), lies in a
	// workspace region once the selector shares one (ws), in its own
	// buffer until then.
	scratch    vk.Range
	ownScratch *vk.Buffer
	ws         *Workspace
}

// h2oScratch is the layout of H2OSelector's scratch, byte offsets of:
// h2o_score's partial maxima and sums (float32 [Hq][partials][2]), the
// arrival counters of h2o_score's blocks and h2o_select's heads (uint32
// [blocks] and [Hq]) and the first radix level's counts (uint32
// [Hq][h2oBins]), and Observe's queries (float32 [Hq][D]). Counters and
// counts are 0 between steps.
type h2oScratch struct{ part, arrivedScore, arrivedChoose, hist0, obs, size uint64 }

// negInfBits is the float32 bits of −∞.
const negInfBits = 0xff800000

// h2oBins is the bins of h2o_select's first radix level (its NBINS).
const h2oBins = 2048

// h2oAccumulated is the tokens each thread of h2o_select accumulates (its
// PER).
const h2oAccumulated = 8

// h2oSelectShape is the shape of h2o_select: threads a workgroup (a
// power of two, at most 1 024) and the most candidates of the first radix
// level's bin it gathers in shared memory; 0 for the defaults.
type h2oSelectShape struct{ threads, list int }

// defaults fills the shape's zero fields for a device: workgroups
// of up to 1 024 threads (the last one of a head passes over all the
// candidates, so more loads in flight), and as many gathered candidates as
// the shared memory left holds, at most 4 096.
func (sh h2oSelectShape) defaults(info vk.Info) h2oSelectShape {
	if sh.threads == 0 {
		sh.threads = 1024
		for sh.threads > 64 && sh.threads > int(info.MaxWorkgroupInvocations) {
			sh.threads /= 2
		}
	}
	if sh.list == 0 {
		sh.list = min(4096, (int(info.SharedMemoryBytes)-4*h2oBins-4*sh.threads-64)/4)
	}
	sh.list = max(sh.list, 1)
	return sh
}

// NewH2OStep prepares H2O steps over layer (in positional order) with a
// budget of budget middle tokens, in the layout of DefaultBaselineLayout
// at the layer's current length: the middle in single-token clusters (the
// step owns that index), budget split by H2OSplit; the sinks and every
// token after the middle (the window, then the tokens appended later) are
// attended. Nothing is accumulated at first: the first step's heavy part
// is the lowest ids, as H2O's; H2OSelector.Observe adds a prompt phase.
func NewH2OStep(dense *Dense, layer *kvcache.Layer, budget int) (*Step, error) {
	return newH2OStep(dense, layer, budget, h2oSelectShape{})
}

// newH2OStep is NewH2OStep with h2o_select of the given shape.
func newH2OStep(dense *Dense, layer *kvcache.Layer, budget int, shape h2oSelectShape) (*Step, error) {
	if err := checkLayerBudget("H2O", budget, layer); err != nil {
		return nil, err
	}
	tokens, err := baselinePages(dense, layer, 1)
	if err != nil {
		return nil, err
	}
	sel, err := newH2OSelector(dense, layer, tokens, budget, shape)
	if err != nil {
		return nil, errors.Join(err, tokens.Release())
	}
	sel.owned = tokens
	return NewStep(dense, layer, sel)
}

// NewH2OSelector builds H2O's selection with a budget of budget indexed
// tokens over tokens, a single-token index of layer (kvcache.NewPages of
// pages of one token), nothing accumulated. The caller keeps tokens.
func NewH2OSelector(dense *Dense, layer *kvcache.Layer, tokens *kvcache.Clusters, budget int) (*H2OSelector, error) {
	return newH2OSelector(dense, layer, tokens, budget, h2oSelectShape{})
}

// newH2OSelector is NewH2OSelector with h2o_select of the given shape.
func newH2OSelector(dense *Dense, layer *kvcache.Layer, tokens *kvcache.Clusters, budget int, shape h2oSelectShape) (*H2OSelector, error) {
	h, dev := dense.heads, dense.dev
	switch {
	case budget < 0:
		return nil, fmt.Errorf("sparse: H2O budget %d is negative", budget)
	case h.checkIndex(layer, tokens) != nil:
		return nil, h.checkIndex(layer, tokens)
	case tokens.C != tokens.Count || !tokens.Contiguous:
		return nil, fmt.Errorf("sparse: H2O needs a single-token index in positional order (kvcache.NewPages of pages of 1), not %d clusters of %d tokens", tokens.C, tokens.Count)
	case h.Dim%8 != 0 || layer.HeadBytes()*uint64(h.KV) > uint64(dev.Info().MaxStorageBufferRange):
		return nil, fmt.Errorf("%w: H2O over keys of dimension %d in %d bytes", vk.ErrUnsupported, h.Dim, layer.HeadBytes()*uint64(h.KV))
	}
	s := &H2OSelector{dense: dense, layer: layer, tokens: tokens}
	s.heavy, s.recent = H2OSplit(budget)
	s.cands = tokens.C - s.recent
	if budget >= tokens.C {
		s.heavy, s.cands = 0, 0
	}
	s.heads = min(h.Group(), 8)
	s.wg = 256
	for s.wg > 8 && s.wg > dev.Info().MaxWorkgroupInvocations {
		s.wg /= 2
	}
	s.shape = shape.defaults(dev.Info())
	if s.shape.threads&(s.shape.threads-1) != 0 || s.shape.threads > 1024 || s.shape.threads > int(dev.Info().MaxWorkgroupInvocations) {
		return nil, fmt.Errorf("sparse: H2O's selection in workgroups of %d threads", s.shape.threads)
	}
	b := &builder{dev: dev, bufs: &s.bufs, cache: &dense.kernels}
	alloc := b.words
	hq, c := h.Query, tokens.C
	s.acc, s.rank, s.cut = alloc(hq*c), alloc(hq*c), alloc(hq)
	s.rows, s.norms = alloc(hq*layer.Capacity()), alloc(2*hq)
	if b.err == nil {
		s.ownScratch, b.err = dev.NewBuffer(s.layout().size, vk.DeviceLocal)
	}
	s.score = b.kernel("h2o_score", 6, 6, s.wg, uint32(h.Dim), uint32(s.heads), uint32(s.rowsPerScore()))
	info := dev.Info()
	threads := uint32(s.shape.threads)
	subgroups := boolWord(!dense.tree && info.SubgroupSize >= 4 && info.SubgroupSize <= threads)
	s.choose = b.kernel("h2o_select", 7, 6, threads, subgroups, uint32(s.shape.list), h2oAccumulated)
	err := b.err
	if err == nil {
		err = dev.Run(func(cmd *vk.Commands) {
			for _, b := range []*vk.Buffer{s.acc, s.rank, s.cut, s.norms, s.ownScratch} {
				cmd.Fill(b.All(), 0)
			}
			cmd.Fill(s.rows.All(), negInfBits)
		})
	}
	if err == nil {
		err = s.bindScratch(s.ownScratch.All(), nil)
	}
	if err != nil {
		return nil, errors.Join(err, s.Release())
	}
	return s, nil
}

// layout returns where each part of the scratch lies, each aligned for a
// storage-buffer offset.
func (s *H2OSelector) layout() h2oScratch {
	h := s.dense.heads
	var l h2oScratch
	next := func(words int) uint64 {
		at := l.size
		l.size += roundUp(uint64(max(words, 1))*4, regionAlign)
		return at
	}
	l.part = next(h.Query * s.partials() * 2)
	l.arrivedScore = next(h.KV * ceilDiv(h.Group(), s.heads))
	l.arrivedChoose = next(h.Query)
	l.hist0 = next(h.Query * h2oBins)
	l.obs = next(h.Query * h.Dim)
	return l
}

// scratchBytes returns the bytes of the selector's scratch.
func (s *H2OSelector) scratchBytes() uint64 { return s.layout().size }

// bindScratch binds the kernels to the scratch in r (counters zero), a
// region of w or, for a nil w, the selector's own buffer, and releases
// the bindings they had (and the own buffer once in a workspace); on
// error they keep them.
func (s *H2OSelector) bindScratch(r vk.Range, w *Workspace) error {
	l := s.layout()
	part := func(at, next uint64) vk.Range {
		return vk.Range{Buffer: r.Buffer, Offset: r.Offset + at, Size: next - at}
	}
	prt := part(l.part, l.arrivedScore)
	arrS, arrC, hist0, obs := part(l.arrivedScore, l.arrivedChoose), part(l.arrivedChoose, l.hist0), part(l.hist0, l.obs), part(l.obs, l.size)
	keys := s.layer.Keys().All()
	var made []*vk.Binding
	bind := func(p *vk.Pipeline, ranges ...vk.Range) (*vk.Binding, error) {
		b, err := p.Bind(ranges...)
		if err == nil {
			made = append(made, b)
		}
		return b, err
	}
	rows, norms := s.rows.All(), s.norms.All()
	observe, err := bind(s.score, obs, keys, rows, prt, norms, arrS)
	var choose *vk.Binding
	if err == nil {
		choose, err = bind(s.choose, rows, norms, s.acc.All(), s.rank.All(), s.cut.All(), arrC, hist0)
	}
	if err != nil {
		return errors.Join(err, releaseAll(made...))
	}
	old := []*vk.Binding{s.observeBind, s.chooseBind}
	s.observeBind, s.chooseBind, s.scratch = observe, choose, r
	err = releaseAll(old...)
	if w != nil {
		s.ws = w
		err = errors.Join(err, releaseAll(s.ownScratch))
		s.ownScratch = nil
	}
	return err
}

// rowsPerScore is the slots a workgroup of h2o_score takes: two a thread,
// so that the stage takes enough workgroups to fill the GPU.
func (s *H2OSelector) rowsPerScore() int { return 2 * int(s.wg) }

// partials is h2o_score's most workgroups per row of the grid.
func (s *H2OSelector) partials() int { return ceilDiv(s.layer.Capacity(), s.rowsPerScore()) }

// Selection returns the ranks and the cuts (a head takes the tokens it
// ranks below its cut), and where the attention records the logits and
// normalisers the next selection accumulates.
func (s *H2OSelector) Selection() Selection {
	rec := &AttentionRecord{Rows: s.rows.All(), RowStride: s.layer.Capacity(), Norms: s.norms.All()}
	return Selection{Clusters: s.tokens, Rank: s.rank.All(), Cut: s.cut.All(), Record: rec}
}

// Bind does nothing: H2O's selection reads no query, only the logits its
// attention recorded.
func (s *H2OSelector) Bind(vk.Range) error { return nil }

// Stages returns H2OStages.
func (s *H2OSelector) Stages() []string { return H2OStages }

// RecordStage appends stage 0: the recorded attention accumulated, then
// the selection.
func (s *H2OSelector) RecordStage(c *vk.Commands, stage int) error {
	if s.chooseBind == nil {
		return vk.ErrReleased
	}
	if stage != 0 {
		return fmt.Errorf("sparse: H2O has one stage (asked for %d)", stage)
	}
	s.recordChoose(c, false)
	return nil
}

// recordScore appends h2o_score: the prompt phase's logits of Observe's
// queries over every stored token, and their normalisers.
func (s *H2OSelector) recordScore(c *vk.Commands) {
	h, n := s.dense.heads, s.layer.Len()
	push := []uint32{uint32(h.Group()), h.scaleBits(), uint32(s.layer.HeadBytes() / 16), uint32(n), uint32(s.layer.Capacity()), uint32(s.partials())}
	c.Dispatch(s.score, s.observeBind, push, uint32(ceilDiv(n, s.rowsPerScore())), uint32(h.KV), uint32(ceilDiv(h.Group(), s.heads)))
}

// recordChoose appends h2o_select: the logits left in rows accumulated,
// then (unless observe) the selection.
func (s *H2OSelector) recordChoose(c *vk.Commands, observe bool) {
	h, x := s.dense.heads, s.tokens
	push := []uint32{uint32(x.C), uint32(x.First), uint32(s.layer.Capacity()),
		uint32(s.heavy), uint32(s.cands), boolWord(observe)}
	c.Dispatch(s.choose, s.chooseBind, push, uint32(ceilDiv(x.C, s.shape.threads*h2oAccumulated)), uint32(h.Query), 1)
}

// Observe adds, for every query head h, its softmax over every token the
// layer holds for the query q[h] ([Hq][D] float32) to the accumulated
// attention of the indexed tokens, selecting nothing (H2O.Observe: the
// dense prompt phase). The attention a step recorded before it is
// accumulated first, so that the prompt phase's logits do not replace it.
func (s *H2OSelector) Observe(q []float32) error {
	if err := checkQuery(q, 1, s.dense.heads); err != nil {
		return err
	}
	if s.chooseBind == nil {
		return vk.ErrReleased
	}
	if err := s.scratch.Buffer.WriteFloat32(s.scratch.Offset+s.layout().obs, q); err != nil {
		return err
	}
	return s.dense.dev.Do(func(c *vk.Commands) error {
		s.recordChoose(c, true)
		c.ComputeBarrier()
		s.recordScore(c)
		c.ComputeBarrier()
		s.recordChoose(c, true)
		return nil
	})
}

// Split returns the heavy hitters and the recent tokens a head takes (0
// and the index's size when the budget covers the index).
func (s *H2OSelector) Split() (heavy, recent int) {
	if s.cands == 0 {
		return 0, s.tokens.C
	}
	return s.heavy, s.recent
}

// Tokens returns the single-token index.
func (s *H2OSelector) Tokens() *kvcache.Clusters { return s.tokens }

// Accumulated returns every query head's accumulated attention to each
// indexed token, [Hq][C]: the steps before the last one's selection (the
// last step's own weights are added at the next step) and the
// observations.
func (s *H2OSelector) Accumulated() ([]float32, error) {
	out := make([]float32, s.dense.heads.Query*s.tokens.C)
	return out, s.acc.ReadFloat32(0, out)
}

// Ranks returns the last step's rank of every indexed token, [Hq][C]: a
// head took those below its cut (H2OSelector).
func (s *H2OSelector) Ranks() ([]int, error) { return readInts(s.rank, s.dense.heads.Query*s.tokens.C) }

// Cuts returns the last step's cut per query head.
func (s *H2OSelector) Cuts() ([]int, error) { return readInts(s.cut, s.dense.heads.Query) }

// Release frees the kernels, the state and an index the step made.
func (s *H2OSelector) Release() error {
	s.ws.leaveScratch(s)
	err := errors.Join(releaseAll(s.observeBind, s.chooseBind), releaseAll(s.bufs...), releaseAll(s.ownScratch), releaseAll(s.owned))
	s.observeBind, s.chooseBind, s.score, s.choose, s.bufs, s.owned, s.ownScratch, s.ws = nil, nil, nil, nil, nil, nil, nil, nil
	return err
}
