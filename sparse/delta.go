package sparse

import (
	"errors"
	"fmt"
	"math"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/vk"
)

// deltaWorkgroup is the threads (tokens) of a delta_pages workgroup.
const deltaWorkgroup = 256

// DeltaPages scores the pages of a Δ-layer on the GPU (shaders/
// delta_pages.comp): after a dense plan over one sequence has attended its
// queries, every token's importance, the greatest attention weight a query
// head gives it, summed over pages of pageSize tokens
// (DeltaPageScoresRef of DeltaTokenScoresRef). The weights come from the
// plan's queries, the layer's keys and the log-sum-exp its chunks left, so
// that nothing goes back to the host between the attention and the scores.
type DeltaPages struct {
	plan     *DensePlan
	pipe     *vk.Pipeline
	bind     *vk.Binding
	pages    *vk.Buffer // float32 [⌈capacity/pageSize⌉]
	pageSize int
}

// NewDeltaPages prepares the page scores of plan's sequence, a plan over
// one sequence (Dense.Plan), pages of pageSize tokens (dividing 256).
func NewDeltaPages(plan *DensePlan, pageSize int) (*DeltaPages, error) {
	d, h := plan.d, plan.d.heads
	dev, info := d.dev, d.dev.Info()
	layer := plan.seqs[0]
	switch {
	case len(plan.seqs) != 1 || plan.gatherStride > 0 || plan.clusters != nil:
		return nil, fmt.Errorf("sparse: DELTA's page scores need a dense plan over one sequence")
	case pageSize <= 0 || deltaWorkgroup%pageSize != 0:
		return nil, fmt.Errorf("sparse: DELTA pages of %d tokens: a divisor of %d", pageSize, deltaWorkgroup)
	case h.Group() > 8 || h.Query > deltaWorkgroup:
		return nil, fmt.Errorf("%w: DELTA's page scores for %d query heads in groups of %d", vk.ErrUnsupported, h.Query, h.Group())
	case 4*(h.Query*h.Dim+h.Query+deltaWorkgroup) > int(info.SharedMemoryBytes):
		return nil, fmt.Errorf("%w: DELTA's page scores keep %d queries of %d in shared memory, the device has %d bytes", vk.ErrUnsupported, h.Query, h.Dim, info.SharedMemoryBytes)
	case uint64(h.KV)*layer.HeadBytes() > uint64(info.MaxStorageBufferRange):
		return nil, fmt.Errorf("%w: DELTA's page scores bind all %d KV heads of the layer at once", vk.ErrUnsupported, h.KV)
	}
	b := &builder{dev: dev, cache: &d.kernels}
	x := &DeltaPages{plan: plan, pageSize: pageSize}
	x.pipe = b.kernel("delta_pages", 4, 5, deltaWorkgroup, uint32(h.Dim), uint32(h.Query), uint32(h.Group()), uint32(pageSize))
	err := b.err
	if err == nil {
		x.pages, err = dev.NewBuffer(uint64(ceilDiv(layer.Capacity(), pageSize))*4, vk.DeviceLocal)
	}
	if err == nil {
		x.bind, err = x.pipe.Bind(plan.query.All(), layer.Keys().Slice(0, uint64(h.KV)*layer.HeadBytes()), plan.parts[1], x.pages.All())
	}
	if err != nil {
		return nil, errors.Join(err, x.Release())
	}
	return x, nil
}

// Record appends the scoring of the pages of the sequence's current
// length to c. The plan's attention must come before it in c, with a
// c.ComputeBarrier() between, or in an earlier submission.
func (x *DeltaPages) Record(c *vk.Commands) error {
	if x.bind == nil {
		return vk.ErrReleased
	}
	h, layer := x.plan.d.heads, x.plan.seqs[0]
	n := layer.Len()
	if n == 0 {
		return fmt.Errorf("sparse: DELTA's page scores of an empty layer")
	}
	chunks := ceilDiv(n, x.plan.chunkFor(n))
	push := []uint32{uint32(n), uint32(layer.HeadBytes() / 4), uint32(chunks), uint32(x.plan.maxChunks),
		math.Float32bits(float32(1 / math.Sqrt(float64(h.Dim))))}
	c.Dispatch(x.pipe, x.bind, push, uint32(ceilDiv(n, deltaWorkgroup)), 1, 1)
	return nil
}

// Pages returns the buffer the page scores land in, float32
// [⌈Len/pageSize⌉].
func (x *DeltaPages) Pages() *vk.Buffer { return x.pages }

// Scores reads the page scores of the last run back, [⌈Len/pageSize⌉].
func (x *DeltaPages) Scores() ([]float32, error) {
	if x.pages == nil {
		return nil, vk.ErrReleased
	}
	out := make([]float32, ceilDiv(x.plan.seqs[0].Len(), x.pageSize))
	return out, x.pages.ReadFloat32(0, out)
}

// Release frees the scores' buffer and binding (the kernel is the
// Dense's; the plan is the caller's).
func (x *DeltaPages) Release() error {
	err := releaseAll(x.bind)
	if x.pages != nil {
		err = errors.Join(err, x.pages.Release())
	}
	x.bind, x.pages = nil, nil
	return err
}

// DeltaSelect picks a Δ-layer's pages on the GPU (shaders/
// delta_select.comp) from their scores (DeltaPages): the last recent pages
// and the budget − recent older ones of the greatest scores, ties to the
// lower page (DeltaSelectRef), written as a selection over a page index
// for the layers after it: rank 0 for a picked page, 1 for the others,
// and a cut of 1, the same for every query head.
type DeltaSelect struct {
	dense     *Dense
	pipe      *vk.Pipeline
	bind      *vk.Binding
	rank, cut *vk.Buffer
	pages     int // the most pages it ranks
}

// deltaSelectWorkgroup is the threads of the delta_select workgroup.
const deltaSelectWorkgroup = 256

// NewDeltaSelect prepares the pick over up to pages pages whose scores
// lie in scores (float32 [pages]).
func NewDeltaSelect(dense *Dense, scores vk.Range, pages int) (*DeltaSelect, error) {
	h := dense.heads
	if pages <= 0 || scores.Buffer == nil || uint64(pages)*4 > scores.Size && scores.Size != 0 {
		return nil, fmt.Errorf("sparse: DELTA's pick over %d pages needs their scores", pages)
	}
	x := &DeltaSelect{dense: dense, pages: pages}
	b := &builder{dev: dense.dev, cache: &dense.kernels}
	x.pipe = b.kernel("delta_select", 3, 4, deltaSelectWorkgroup)
	err := b.err
	if err == nil {
		x.rank, err = dense.dev.NewBuffer(uint64(h.Query*pages)*4, vk.DeviceLocal)
	}
	if err == nil {
		x.cut, err = dense.dev.NewBuffer(uint64(h.Query)*4, vk.DeviceLocal)
	}
	if err == nil {
		x.bind, err = x.pipe.Bind(scores, x.rank.All(), x.cut.All())
	}
	if err != nil {
		return nil, errors.Join(err, x.Release())
	}
	return x, nil
}

// Record appends the pick over the first pages pages, budget K of them
// with the last recent L always, to c; the scores must be written before
// it (a c.ComputeBarrier() between, or an earlier submission).
func (x *DeltaSelect) Record(c *vk.Commands, pages, budget, recent int) error {
	switch {
	case x.bind == nil:
		return vk.ErrReleased
	case pages <= 0 || pages > x.pages:
		return fmt.Errorf("sparse: DELTA's pick over %d pages of at most %d", pages, x.pages)
	case recent < 0 || recent >= budget:
		return fmt.Errorf("sparse: DELTA's pick of %d pages keeping %d recent: L must lie in [0, K)", budget, recent)
	}
	c.Dispatch(x.pipe, x.bind, []uint32{uint32(pages), uint32(budget), uint32(recent), uint32(x.dense.heads.Query)}, 1, 1, 1)
	return nil
}

// Rank and Cut return where the pick lands: uint32 [Hq][pages] (the pages
// of the last Record) and [Hq].
func (x *DeltaSelect) Rank() vk.Range { return x.rank.All() }

// Cut returns the cuts' buffer, uint32 [Hq] (all 1).
func (x *DeltaSelect) Cut() vk.Range { return x.cut.All() }

// Picked reads back the pages the last pick took among its first pages,
// ascending (query head 0's; every head's are the same).
func (x *DeltaSelect) Picked(pages int) ([]int, error) {
	if x.rank == nil {
		return nil, vk.ErrReleased
	}
	ranks, err := readInts(x.rank, pages)
	if err != nil {
		return nil, err
	}
	var out []int
	for u, r := range ranks {
		if r == 0 {
			out = append(out, u)
		}
	}
	return out, nil
}

// Release frees the pick's buffers and binding (the kernel is the Dense's).
func (x *DeltaSelect) Release() error {
	err := errors.Join(releaseAll(x.bind), releaseAll(x.rank, x.cut))
	x.bind, x.rank, x.cut = nil, nil, nil
	return err
}

// deltaReuse is a layer after a Δ-layer (a Selector with no stages): over
// a page index of its own layer, the pages the Δ-layer's pick took, for
// every query head; tokens past the index are attended in full.
type deltaReuse struct {
	pages     *kvcache.Clusters // owned
	rank, cut vk.Range
}

func (s *deltaReuse) Selection() Selection {
	return Selection{Clusters: s.pages, Rank: s.rank, Cut: s.cut}
}
func (s *deltaReuse) Bind(vk.Range) error { return nil }
func (s *deltaReuse) Stages() []string    { return nil }
func (s *deltaReuse) RecordStage(_ *vk.Commands, stage int) error {
	return fmt.Errorf("sparse: a DELTA layer reusing a pick has no stages (asked for %d)", stage)
}
func (s *deltaReuse) Bytes() uint64 { return s.pages.Bytes() }
func (s *deltaReuse) Release() error {
	var err error
	if s.pages != nil {
		err = s.pages.Release()
	}
	s.pages = nil
	return err
}

// NewDeltaReuseStep prepares steps of a layer after a Δ-layer: it attends
// the pages of pageSize tokens, among the first pages of the layer, that
// pick took at the Δ-layer of the same step (pick must have ranked pages
// pages, and run before this step in the same command order), and every
// token past them.
func NewDeltaReuseStep(dense *Dense, layer *kvcache.Layer, pick *DeltaSelect, pages, pageSize int) (*Step, error) {
	switch {
	case pick == nil || pick.rank == nil:
		return nil, fmt.Errorf("sparse: a DELTA layer needs its Δ-layer's pick")
	case pages <= 0 || pages > pick.pages || pageSize <= 0 || pages*pageSize > layer.Len():
		return nil, fmt.Errorf("sparse: a DELTA layer over %d pages of %d tokens of a layer of %d (a pick of at most %d)", pages, pageSize, layer.Len(), pick.pages)
	}
	idx, err := kvcache.NewPages(dense.dev, layer.KVHeads(), layer.HeadDim(), 0, pages*pageSize, pageSize)
	if err != nil {
		return nil, err
	}
	h := dense.heads
	sel := &deltaReuse{pages: idx, rank: pick.rank.Slice(0, uint64(h.Query*pages)*4), cut: pick.Cut()}
	return NewStep(dense, layer, sel)
}
