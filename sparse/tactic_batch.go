package sparse

import (
	"errors"
	"fmt"
	"time"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/vk"
)

// TacticBatch is a Tactic decode step of B sequences at once: each
// sequence has its own cache, length and cluster index (its own
// TacticStep), and every stage runs as the dispatches of all B sequences
// followed by one barrier, so that the batch pays each stage's fixed cost
// (a dependent dispatch) once instead of B times. The sequences share the
// selection kernels.
type TacticBatch struct {
	kernels *tacticKernels
	steps   []*TacticStep
	batch   *Batch // the same steps, recorded stage by stage
}

// NewTacticBatch prepares batched steps at target mass p with the fit's
// parameters: sequence i attends layers[i], clustered as clusters[i] says
// (each layer in cluster order: kvcache.Layer.Reorder).
func NewTacticBatch(dense *Dense, layers []*kvcache.Layer, clusters []*kvcache.Clusters, p float64, fit TacticFit) (*TacticBatch, error) {
	if len(layers) == 0 || len(layers) != len(clusters) {
		return nil, fmt.Errorf("sparse: a batch of %d layers and %d cluster indexes", len(layers), len(clusters))
	}
	for i, l := range layers {
		for j := range i {
			if layers[j] == l {
				return nil, fmt.Errorf("sparse: sequences %d and %d of the batch share a cache", j, i)
			}
		}
	}
	k, err := newTacticKernels(dense)
	if err != nil {
		return nil, err
	}
	b := &TacticBatch{kernels: k, batch: &Batch{dense: dense}}
	for i := range layers {
		sel, err := newTacticSelector(dense, k, layers[i], clusters[i], p, fit)
		var t *TacticStep
		if err == nil {
			sel.shareStages(len(layers))
			t, err = newTacticStep(dense, layers[i], sel)
		}
		if err != nil {
			return nil, errors.Join(fmt.Errorf("sparse: sequence %d: %w", i, err), b.Release())
		}
		b.steps = append(b.steps, t)
		b.batch.steps = append(b.batch.steps, t.Step)
	}
	return b, nil
}

// Len returns the number of sequences B.
func (b *TacticBatch) Len() int { return len(b.steps) }

// Step returns sequence i's step (its scores, cuts, tokens and fidelity
// after a batched run, and SetClusters).
func (b *TacticBatch) Step(i int) *TacticStep { return b.steps[i] }

// SetQuery uploads the queries, [B][Hq][D]; on error none is changed.
func (b *TacticBatch) SetQuery(q []float32) error { return b.batch.SetQuery(q) }

// Record appends the batch's kernels to c, stage by stage (it orders
// compute work only, as DensePlan.Record).
func (b *TacticBatch) Record(c *vk.Commands) error { return b.batch.Record(c) }

// Rebalance divides each sequence's attention among workgroups, for the
// steps recorded next, by the rows its head blocks attended in the last
// batched step that ran (DensePlan.Rebalance); Attend does it before every
// step.
func (b *TacticBatch) Rebalance() error { return b.batch.Rebalance() }

// Attend runs a batched step for the queries q ([B][Hq][D]) and returns
// the outputs, [B][Hq][D]; as Step.Attend, each sequence's attention
// divides its clusters by the members of the step before.
func (b *TacticBatch) Attend(q []float32) ([]float32, error) { return b.batch.Attend(q) }

// Time records warmup+reps back-to-back batched steps in one submission
// and returns the timed ones' GPU times, sorted (as DensePlan.Time).
func (b *TacticBatch) Time(warmup, reps int) ([]time.Duration, error) {
	return b.batch.Time(warmup, reps)
}

// Stages names the batch's dependent stages: TacticStages, then "attend".
func (b *TacticBatch) Stages() []string { return b.batch.Stages() }

// TimeStages runs reps batched steps back to back in one submission, after
// warmup untimed ones, with a timestamp after every stage (each stage's
// dispatches for all the sequences, then the timestamp), and returns each
// stage's median GPU time (Stages order) and the median whole step.
func (b *TacticBatch) TimeStages(warmup, reps int) (stages []time.Duration, total time.Duration, err error) {
	return b.batch.TimeStages(warmup, reps)
}

// Release frees the steps and the kernels (not the layers or indexes).
func (b *TacticBatch) Release() error {
	var errs []error
	if b.batch != nil {
		errs = append(errs, b.batch.Release()) // the steps
	}
	b.steps, b.batch = nil, nil
	if b.kernels != nil {
		errs = append(errs, b.kernels.release())
		b.kernels = nil
	}
	return errors.Join(errs...)
}
