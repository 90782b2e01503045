package sparse

import (
	"errors"
	"fmt"
	"time"

	"github.com/vksparse/vksparse/vk"
)

// Batch is B sequences' steps of one policy recorded together: every
// stage is the dispatches of all B steps followed by one barrier
// (recordSteps), so that the batch pays each dependent dispatch's fixed
// cost once instead of B times. It serves every policy whose steps are
// Steps; TacticBatch is the same with Tactic's kernels shared.
type Batch struct {
	dense *Dense
	steps []*Step
	clock stopwatch
}

// NewBatch batches steps, which must run the same selection (as many
// stages) over distinct caches of dense's heads; the batch owns them from
// then on, and releases them when it fails.
func NewBatch(dense *Dense, steps []*Step) (*Batch, error) {
	b := &Batch{dense: dense, steps: steps}
	var err error
	switch {
	case len(steps) == 0:
		err = fmt.Errorf("sparse: a batch of no steps")
	case dense == nil:
		err = fmt.Errorf("sparse: a batch without dense kernels")
	}
	for i, s := range steps {
		if err != nil {
			break
		}
		switch {
		case s == nil || s.plan == nil:
			err = fmt.Errorf("sparse: step %d of the batch is released", i)
		case s.dense != dense:
			err = fmt.Errorf("sparse: step %d of the batch was made with other dense kernels", i)
		case len(s.sel.Stages()) != len(steps[0].sel.Stages()):
			err = fmt.Errorf("sparse: step %d has %d selection stages, step 0 has %d", i, len(s.sel.Stages()), len(steps[0].sel.Stages()))
		}
		for j := range i {
			if err == nil && steps[j].layer == s.layer {
				err = fmt.Errorf("sparse: steps %d and %d of the batch share a cache", j, i)
			}
		}
	}
	if err != nil {
		return nil, errors.Join(err, b.Release())
	}
	for _, s := range steps {
		if x, ok := s.sel.(stageSharer); ok {
			x.shareStages(len(steps))
		}
	}
	return b, nil
}

// stageSharer is a Selector whose dispatches take their shape from how
// many sequences' selections share each stage (a batch's): about a wave of
// workgroups for all of them, rather than for each.
type stageSharer interface {
	// shareStages tells the selector that sequences selections, its own
	// among them, share each of its stages from now on.
	shareStages(sequences int)
}

// Len returns the number of sequences B.
func (b *Batch) Len() int { return len(b.steps) }

// Step returns sequence i's step.
func (b *Batch) Step(i int) *Step { return b.steps[i] }

// Stages names the batch's dependent dispatches (its steps' Stages).
func (b *Batch) Stages() []string { return b.steps[0].Stages() }

// SetQuery uploads the queries, [B][Hq][D]; they are checked before any
// is written.
func (b *Batch) SetQuery(q []float32) error {
	h := b.dense.heads
	if err := checkQuery(q, len(b.steps), h); err != nil {
		return err
	}
	per := h.Query * h.Dim
	for i, s := range b.steps {
		if err := s.SetQuery(q[i*per : (i+1)*per]); err != nil {
			return err
		}
	}
	return nil
}

// Rebalance divides each sequence's attention among workgroups by the
// rows its head blocks attended in the last batched step that ran
// (DensePlan.Rebalance).
func (b *Batch) Rebalance() error {
	for _, s := range b.steps {
		if err := s.plan.Rebalance(len(b.steps)); err != nil {
			return err
		}
	}
	return nil
}

// Record appends the batch's kernels to c, stage by stage; as
// DensePlan.Record, it orders compute work only.
func (b *Batch) Record(c *vk.Commands) error { return b.record(c, func(int) {}) }

func (b *Batch) record(c *vk.Commands, mark func(stage int)) error {
	return recordSteps(c, b.steps, mark)
}

// Attend runs a batched step for the queries q ([B][Hq][D]) and returns
// the outputs, [B][Hq][D].
func (b *Batch) Attend(q []float32) ([]float32, error) {
	if err := b.SetQuery(q); err != nil {
		return nil, err
	}
	if err := b.Rebalance(); err != nil {
		return nil, err
	}
	if err := b.dense.dev.Do(b.Record); err != nil {
		return nil, err
	}
	out := make([]float32, len(q))
	per := len(q) / len(b.steps)
	for i, s := range b.steps {
		o := s.OutputRange()
		if err := o.Buffer.ReadFloat32(o.Offset, out[i*per:(i+1)*per]); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// Time records warmup+reps back-to-back batched steps in one submission
// and returns the timed ones' GPU times, sorted (as DensePlan.Time).
func (b *Batch) Time(warmup, reps int) ([]time.Duration, error) {
	return b.clock.time(b.dense.dev, warmup, reps, b.Record)
}

// TimeStages runs reps batched steps back to back in one submission, after
// warmup untimed ones, a timestamp after every stage (each stage's
// dispatches for all the sequences, then the timestamp), and returns each
// stage's median GPU time (Stages order) and the median whole step.
func (b *Batch) TimeStages(warmup, reps int) (stages []time.Duration, total time.Duration, err error) {
	return timeStages(b.dense.dev, len(b.Stages()), warmup, reps, b.record)
}

// Release frees the steps (with their selectors and plans).
func (b *Batch) Release() error {
	b.clock.release()
	var errs []error
	for _, s := range b.steps {
		if s != nil {
			errs = append(errs, s.Release())
		}
	}
	b.steps = nil
	return errors.Join(errs...)
}
