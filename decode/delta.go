package decode

import (
	"errors"
	"fmt"
	"time"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/vk"
)

// deltaBatch is a DELTA Δ-layer over the active slots: per sequence a
// dense plan (its partials in the model's workspace), the page scores it
// leaves, and the pick of pages the layers after it reuse in the same
// step.
type deltaBatch struct {
	plans  []*sparse.DensePlan
	scores []*sparse.DeltaPages
	picks  []*sparse.DeltaSelect
	pages  []int // per sequence: the pages picked among (those the later layers index)
	opts   sparse.Delta
}

// newDeltaBatch builds a Δ-layer's batch over caches, sequence i's
// partials in region i of ws.
func newDeltaBatch(dense *sparse.Dense, ws *sparse.Workspace, caches []*kvcache.Layer, opts sparse.Delta) (*deltaBatch, error) {
	b := &deltaBatch{opts: opts}
	for i, c := range caches {
		// Pages the later layers can index: they hold at least one token
		// fewer than this layer until their own append of the step.
		pages := (c.Len() - 1) / opts.PageSize
		if pages < 1 {
			return nil, errors.Join(fmt.Errorf("a Δ-layer of %d tokens has no whole page of %d before its last", c.Len(), opts.PageSize), b.release())
		}
		plan, err := dense.PlanLogits(c)
		if err == nil {
			b.plans = append(b.plans, plan)
			err = plan.Share(ws, i)
		}
		var scores *sparse.DeltaPages
		if err == nil {
			if scores, err = sparse.NewDeltaPages(plan, opts.PageSize); err == nil {
				b.scores = append(b.scores, scores)
			}
		}
		if err == nil {
			var pick *sparse.DeltaSelect
			if pick, err = sparse.NewDeltaSelect(dense, scores.Pages().All(), pages, opts.Pages, opts.Recent, opts.PageSize); err == nil {
				b.picks = append(b.picks, pick)
			}
		}
		if err != nil {
			return nil, errors.Join(err, b.release())
		}
		b.pages = append(b.pages, pages)
	}
	return b, nil
}

// setQuery uploads each sequence's queries, [B][Hq][D].
func (b *deltaBatch) setQuery(q []float32, per int) error {
	for i, p := range b.plans {
		if err := p.SetQuery(q[i*per : (i+1)*per]); err != nil {
			return err
		}
	}
	return nil
}

// record appends the dense attention, the page scores and the pick.
func (b *deltaBatch) record(c *vk.Commands) error {
	for _, p := range b.plans {
		if err := p.Record(c); err != nil {
			return err
		}
	}
	c.ComputeBarrier()
	for _, s := range b.scores {
		if err := s.Record(c); err != nil {
			return err
		}
	}
	c.ComputeBarrier()
	for _, p := range b.picks {
		if err := p.Record(c); err != nil {
			return err
		}
	}
	return nil
}

// bytes returns the device memory of the batch.
func (b *deltaBatch) bytes() uint64 {
	var n uint64
	for _, p := range b.plans {
		n += p.Bytes()
	}
	for _, s := range b.scores {
		n += vk.Held(s.Pages())
	}
	for _, p := range b.picks {
		n += p.Bytes()
	}
	return n
}

// release frees the picks, scores and plans.
func (b *deltaBatch) release() error {
	var errs []error
	for _, p := range b.picks {
		errs = append(errs, p.Release())
	}
	for _, s := range b.scores {
		errs = append(errs, s.Release())
	}
	for _, p := range b.plans {
		errs = append(errs, p.Release())
	}
	b.picks, b.scores, b.plans = nil, nil, nil
	return errors.Join(errs...)
}

// timeRecord runs the layer's Record warmup+reps times in one submission,
// a timestamp after each, and returns the timed runs' GPU times, sorted.
func (m *Model) timeRecord(layer, warmup, reps int) ([]time.Duration, error) {
	return m.dev.TimeRuns(m.cmd, warmup, reps, func(c *vk.Commands) error { return m.record(layer, c) })
}
