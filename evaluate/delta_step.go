package evaluate

import (
	"errors"
	"fmt"

	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/vk"
)

// PolicyDelta names the DELTA layer Steps times (deltaPolicy).
const PolicyDelta = "delta"

// deltaPolicy is a DELTA layer after its Δ-layer (sparse.
// NewDeltaReuseStep) over the tokens in positional order: it attends the
// pages that the Δ-layer picked for the same query, pages of
// sparse.DefaultDelta's size, as many as the fixed budget with the sinks
// and the recent window covers (at least its recent pages and one more),
// and every token past them. The Δ-layer (dense attention writing its
// logits, the page scores, the pick) runs when the query is set; it is
// dense attention and is not timed with the step.
func deltaPolicy() Policy {
	return Policy{Name: PolicyDelta, Make: func(l *Layers) (Stepper, error) {
		o := sparse.DefaultDelta()
		layer := l.Positional
		pages := (layer.Len() - 1) / o.PageSize
		k := min(pages, max(o.Recent+1, (l.Budget+l.Sinks+l.Recent)/o.PageSize))
		if pages <= o.Recent {
			return nil, fmt.Errorf("evaluate: DELTA over %d tokens: %d pages, %d of them recent", layer.Len(), pages, o.Recent)
		}
		s := &deltaStep{dev: l.dev}
		var err error
		if s.plan, err = l.Dense.PlanLogits(layer); err == nil {
			if s.scores, err = sparse.NewDeltaPages(s.plan, o.PageSize); err == nil {
				if s.pick, err = sparse.NewDeltaSelect(l.Dense, s.scores.Pages().All(), pages, k, o.Recent, o.PageSize); err == nil {
					s.Step, err = sparse.NewDeltaReuseStep(l.Dense, layer, s.pick)
				}
			}
		}
		if err != nil {
			return nil, errors.Join(err, s.Release())
		}
		return s, nil
	}, Reads: attendOnly}
}

// deltaStep is a DELTA layer's step with its Δ-layer's pick: SetQuery
// runs the Δ-layer for the query, then sets it on the step.
type deltaStep struct {
	*sparse.Step
	dev    *vk.Device
	plan   *sparse.DensePlan
	scores *sparse.DeltaPages
	pick   *sparse.DeltaSelect
}

// SetQuery picks the pages for q (the Δ-layer's attention, page scores
// and pick) and sets q on the step.
func (s *deltaStep) SetQuery(q []float32) error {
	if err := s.plan.SetQuery(q); err != nil {
		return err
	}
	err := s.dev.Do(func(c *vk.Commands) error {
		if err := s.plan.Record(c); err != nil {
			return err
		}
		c.ComputeBarrier()
		if err := s.scores.Record(c); err != nil {
			return err
		}
		c.ComputeBarrier()
		return s.pick.Record(c)
	})
	if err != nil {
		return err
	}
	return s.Step.SetQuery(q)
}

// Release frees the step, the pick, the page scores and the plan.
func (s *deltaStep) Release() error {
	var errs []error
	if s.Step != nil {
		errs = append(errs, s.Step.Release())
	}
	if s.pick != nil {
		errs = append(errs, s.pick.Release())
	}
	if s.scores != nil {
		errs = append(errs, s.scores.Release())
	}
	if s.plan != nil {
		errs = append(errs, s.plan.Release())
	}
	return errors.Join(errs...)
}
