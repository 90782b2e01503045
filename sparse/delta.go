package sparse

import (
	"errors"
	"fmt"

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
// logits the plan's attention wrote (Dense.PlanLogits) and the log-sum-exp
// its chunks left, so that nothing goes back to the host between the
// attention and the scores and the keys are read once.
type DeltaPages struct {
	plan     *DensePlan
	pipe     *vk.Pipeline
	bind     *vk.Binding
	boundML  vk.Range   // the plan's partials bound (they move when its workspace grows)
	pages    *vk.Buffer // float32 [⌈capacity/pageSize⌉]
	pageSize int
}

// NewDeltaPages prepares the page scores of plan's sequence, a plan that
// writes its logits (Dense.PlanLogits), pages of pageSize tokens (dividing
// 256).
func NewDeltaPages(plan *DensePlan, pageSize int) (*DeltaPages, error) {
	d, h := plan.d, plan.d.heads
	dev := d.dev
	layer := plan.seqs[0]
	switch {
	case plan.Logits() == nil:
		return nil, fmt.Errorf("sparse: DELTA's page scores need a plan that writes its logits (Dense.PlanLogits)")
	case pageSize <= 0 || deltaWorkgroup%pageSize != 0:
		return nil, fmt.Errorf("sparse: DELTA pages of %d tokens: a divisor of %d", pageSize, deltaWorkgroup)
	case h.Query > deltaWorkgroup:
		return nil, fmt.Errorf("%w: DELTA's page scores for %d query heads (at most %d)", vk.ErrUnsupported, h.Query, deltaWorkgroup)
	}
	b := &builder{dev: dev, cache: &d.kernels}
	x := &DeltaPages{plan: plan, pageSize: pageSize}
	x.pipe = b.kernel("delta_pages", 3, 3, deltaWorkgroup, uint32(h.Query), uint32(pageSize))
	err := b.err
	if err == nil {
		x.pages, err = dev.NewBuffer(uint64(ceilDiv(layer.Capacity(), pageSize))*4, vk.DeviceLocal)
	}
	if err == nil {
		err = x.rebind()
	}
	if err != nil {
		return nil, errors.Join(err, x.Release())
	}
	return x, nil
}

// rebind binds the kernel to the plan's logits and current partials.
func (x *DeltaPages) rebind() error {
	b, err := x.pipe.Bind(x.plan.Logits().All(), x.plan.parts[1], x.pages.All())
	if err != nil {
		return err
	}
	err = releaseAll(x.bind)
	x.bind, x.boundML = b, x.plan.parts[1]
	return err
}

// Record appends the scoring of the pages of the sequence's current
// length to c. The plan's attention must come before it in c, with a
// c.ComputeBarrier() between, or in an earlier submission.
func (x *DeltaPages) Record(c *vk.Commands) error {
	if x.bind == nil {
		return vk.ErrReleased
	}
	layer := x.plan.seqs[0]
	n := layer.Len()
	if n == 0 {
		return fmt.Errorf("sparse: DELTA's page scores of an empty layer")
	}
	if x.boundML != x.plan.parts[1] {
		if err := x.rebind(); err != nil {
			return err
		}
	}
	chunks := ceilDiv(n, x.plan.chunkFor(n))
	push := []uint32{uint32(n), uint32(chunks), uint32(x.plan.maxChunks)}
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
// lower page (DeltaSelectRef), written as an index of the picked pages for
// the layers after it (Index): min(pages, budget) clusters of pageSize
// tokens whose first slots the pick writes in ascending order, every one
// taken by every query head.
type DeltaSelect struct {
	dense                 *Dense
	pipe                  *vk.Pipeline
	bind                  *vk.Binding
	index                 *kvcache.Clusters // Starts written by the pick, Counts all pageSize
	rank, cut             *vk.Buffer        // uint32 [Hq][K] all 0 and [Hq] all 1: every pick taken
	pages, budget, recent int
	pageSize              int
}

// deltaSelectWorkgroup is the threads of the delta_select workgroup.
const deltaSelectWorkgroup = 256

// NewDeltaSelect prepares the pick of budget pages, the last recent always,
// among pages pages of pageSize tokens whose scores lie in scores
// (float32 [pages]).
func NewDeltaSelect(dense *Dense, scores vk.Range, pages, budget, recent, pageSize int) (*DeltaSelect, error) {
	return newDeltaSelect(dense, scores, pages, budget, recent, pageSize, 0)
}

// newDeltaSelect is NewDeltaSelect with at most held scores in shared
// memory (0: as many as fit, up to 8 192).
func newDeltaSelect(dense *Dense, scores vk.Range, pages, budget, recent, pageSize, held int) (*DeltaSelect, error) {
	h, dev := dense.heads, dense.dev
	switch {
	case pages <= 0 || scores.Buffer == nil || uint64(pages)*4 > scores.Size && scores.Size != 0:
		return nil, fmt.Errorf("sparse: DELTA's pick over %d pages needs their scores", pages)
	case recent < 0 || recent >= budget:
		return nil, fmt.Errorf("sparse: DELTA's pick of %d pages keeping %d recent: L must lie in [0, K)", budget, recent)
	case pageSize <= 0:
		return nil, fmt.Errorf("sparse: DELTA pages of %d tokens", pageSize)
	}
	k := min(pages, budget)
	x := &DeltaSelect{dense: dense, pages: pages, budget: budget, recent: recent, pageSize: pageSize}
	b := &builder{dev: dev, cache: &dense.kernels}
	// The scores it holds in shared memory (a word of padding every 32)
	// beside its histogram of 2 048 bins, its group sums and a word a
	// thread.
	most := min(8192, max(int(dev.Info().SharedMemoryBytes)-4*(2048+16+deltaSelectWorkgroup)-64, 4)*32/33/4)
	if held <= 0 || held > most {
		held = most
	}
	x.pipe = b.kernel("delta_select", 2, 5, deltaSelectWorkgroup, uint32(held))
	err := b.err
	if err == nil {
		x.index, err = kvcache.NewPages(dev, h.KV, h.Dim, 0, k*pageSize, pageSize)
	}
	if err == nil {
		// Picked pages lie anywhere among the first pages: the index spans
		// them (its Starts are the pick's, not positional).
		x.index.Count, x.index.PageSize = pages*pageSize, 0
		x.rank, err = dev.NewBuffer(uint64(h.Query*k)*4, vk.DeviceLocal)
	}
	if err == nil {
		x.cut, err = dev.NewBuffer(uint64(h.Query)*4, vk.DeviceLocal)
	}
	if err == nil {
		err = dev.Run(func(c *vk.Commands) {
			c.Fill(x.rank.All(), 0)
			c.Fill(x.cut.All(), 1)
		})
	}
	if err == nil {
		x.bind, err = x.pipe.Bind(scores, x.index.Starts.All())
	}
	if err != nil {
		return nil, errors.Join(err, x.Release())
	}
	return x, nil
}

// Record appends the pick to c; the scores must be written before it (a
// c.ComputeBarrier() between, or an earlier submission).
func (x *DeltaSelect) Record(c *vk.Commands) error {
	if x.bind == nil {
		return vk.ErrReleased
	}
	push := []uint32{uint32(x.pages), uint32(x.budget), uint32(x.recent), uint32(x.dense.heads.KV), uint32(x.pageSize)}
	c.Dispatch(x.pipe, x.bind, push, 1, 1, 1)
	return nil
}

// Index returns the index of the picked pages: min(pages, budget)
// clusters of pageSize tokens over the first pages·pageSize slots, their
// first slots written by Record.
func (x *DeltaSelect) Index() *kvcache.Clusters { return x.index }

// Pages returns the pages the pick chooses among.
func (x *DeltaSelect) Pages() int { return x.pages }

// Picked reads back the pages the last pick took, ascending (KV head
// 0's; every head's are the same).
func (x *DeltaSelect) Picked() ([]int, error) {
	if x.index == nil {
		return nil, vk.ErrReleased
	}
	starts, err := readInts(x.index.Starts, x.index.C)
	if err != nil {
		return nil, err
	}
	for i := range starts {
		starts[i] /= x.pageSize
	}
	return starts, nil
}

// Release frees the pick's buffers, index and binding (the kernel is the
// Dense's).
func (x *DeltaSelect) Release() error {
	err := errors.Join(releaseAll(x.bind), releaseAll(x.rank, x.cut))
	if x.index != nil {
		err = errors.Join(err, x.index.Release())
	}
	x.bind, x.rank, x.cut, x.index = nil, nil, nil, nil
	return err
}

// deltaReuse is a layer after a Δ-layer (a Selector with no stages): the
// pages the Δ-layer's pick took (its index, shared), for every query head;
// tokens past them are attended in full.
type deltaReuse struct {
	pick     *DeltaSelect
	runPages int // picked pages a workgroup of the attention takes
}

func (s *deltaReuse) Selection() Selection {
	return Selection{Clusters: s.pick.index, Rank: s.pick.rank.All(), Cut: s.pick.cut.All(), RunClusters: s.runPages}
}

// deltaRunPages is the picked pages a workgroup of a reusing layer's
// attention takes (bench/README.md, "The selection's and the scores'
// shapes").
const deltaRunPages = 8

func (s *deltaReuse) Bind(vk.Range) error { return nil }
func (s *deltaReuse) Stages() []string    { return nil }
func (s *deltaReuse) RecordStage(_ *vk.Commands, stage int) error {
	return fmt.Errorf("sparse: a DELTA layer reusing a pick has no stages (asked for %d)", stage)
}
func (s *deltaReuse) Release() error { return nil }

// NewDeltaReuseStep prepares steps of a layer after a Δ-layer: it attends
// the pages pick took at the Δ-layer of the same step (pick must run
// before this step in the same command order) and every token past the
// pick's pages. The pick must outlive the step.
func NewDeltaReuseStep(dense *Dense, layer *kvcache.Layer, pick *DeltaSelect) (*Step, error) {
	return NewDeltaReuseStepRuns(dense, layer, pick, deltaRunPages)
}

// NewDeltaReuseStepRuns is NewDeltaReuseStep with runPages picked pages a
// workgroup of the attention (NewDeltaReuseStep takes 8).
func NewDeltaReuseStepRuns(dense *Dense, layer *kvcache.Layer, pick *DeltaSelect, runPages int) (*Step, error) {
	switch {
	case runPages <= 0:
		return nil, fmt.Errorf("sparse: %d picked pages a workgroup", runPages)
	case pick == nil || pick.index == nil:
		return nil, fmt.Errorf("sparse: a DELTA layer needs its Δ-layer's pick")
	case pick.pages*pick.pageSize > layer.Len():
		return nil, fmt.Errorf("sparse: a DELTA layer over %d pages of %d tokens of a layer of %d", pick.pages, pick.pageSize, layer.Len())
	}
	return NewStep(dense, layer, &deltaReuse{pick: pick, runPages: runPages})
}
