package evaluate

import (
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/trace"
	"github.com/vksparse/vksparse/vk"
)

// Batched is the steps of B sequences recorded as one (sparse.Batch,
// sparse.TacticBatch).
type Batched interface {
	SetQuery(q []float32) error
	Rebalance() error
	Time(warmup, reps int) ([]time.Duration, error)
	TimeStages(warmup, reps int) ([]time.Duration, time.Duration, error)
	Stages() []string
	Release() error
}

// baseStep returns the sparse.Step a policy's step runs, or nil where it
// runs none (LuKA's step is its own).
func baseStep(s Stepper) *sparse.Step {
	switch x := s.(type) {
	case *sparse.Step:
		return x
	case *sparse.TacticStep:
		return x.Step
	case *h2oStep:
		return x.Step
	case *deltaStep:
		return x.Step
	}
	return nil
}

// batchOf makes policy p's step over each of ls and batches them: its
// own batch where the policy has one (Policy.Batch), else a sparse.Batch
// of the steps, each first given prev then q through its own SetQuery
// (which warms H2O's accumulation and runs DELTA's pick). It returns the
// batch, each sequence's step (for Ranks and Reads) and what frees them.
func batchOf(p Policy, ls []*Layers, prev, q []float32) (Batched, []Stepper, func() error, error) {
	if p.Batch != nil {
		b, seqs, err := p.Batch(ls)
		if err != nil {
			return nil, nil, nil, err
		}
		return b, seqs, b.Release, nil
	}
	var seqs []Stepper
	var steps []*sparse.Step
	free := func() error {
		var errs []error
		for _, s := range seqs {
			errs = append(errs, s.Release())
		}
		return errors.Join(errs...)
	}
	for _, l := range ls {
		s, err := p.Make(l)
		if err != nil {
			return nil, nil, nil, errors.Join(err, free())
		}
		seqs = append(seqs, s)
		base := baseStep(s)
		if base == nil {
			return nil, nil, nil, errors.Join(fmt.Errorf("%w: %s's step does not batch", ErrNoBatch, p.Name), free())
		}
		steps = append(steps, base)
		for _, x := range [][]float32{prev, q} {
			if x == nil {
				continue
			}
			if err := s.SetQuery(x); err != nil {
				return nil, nil, nil, errors.Join(err, free())
			}
		}
	}
	b, err := sparse.NewBatch(ls[0].Dense, steps)
	if err != nil {
		// NewBatch released the steps; what the wrappers hold beside them
		// is freed by their Release, which then reports the steps released.
		_ = free()
		return nil, nil, nil, err
	}
	return b, seqs, func() error {
		err := b.Release()
		for _, s := range seqs {
			if d, ok := s.(*deltaStep); ok {
				d.Step = nil
				err = errors.Join(err, d.Release())
			}
		}
		return err
	}, nil
}

// ErrNoBatch reports a policy whose steps do not batch.
var ErrNoBatch = errors.New("evaluate: no batched step")

// BatchSteps times each policy's step over batch sequences at once
// (Batched), each holding all of t's tokens clustered with a seed of its
// own (clustering.Seed, +1, …), beside dense attention over the batch,
// every sequence given t's last query after a step of the query before.
// Policies whose steps do not batch (ErrNoBatch) are left out. The
// fixed-budget policies' budget is set as Steps sets it, from the first
// sequence. Each StepRun has Batch set; its Skeleton sums the sequences'.
func BatchSteps(dev *vk.Device, t *trace.Trace, opts sparse.DenseOptions, clustering sparse.KMeansOptions, policies []Policy, sinks, recent, reps, batch int, progress func(name string)) ([]StepRun, error) {
	heads := sparse.Heads{Query: t.QHeads, KV: t.KVHeads, Dim: t.HeadDim}
	n := t.Tokens
	if reps <= 0 || batch < 1 || n <= sinks+recent+1 {
		return nil, fmt.Errorf("evaluate: BatchSteps: %d tokens with %d sinks and %d recent, %d timed runs, batch %d", n, sinks, recent, reps, batch)
	}
	dense, err := sparse.NewDenseWith(dev, heads, opts)
	if err != nil {
		return nil, err
	}
	defer dense.Release()
	km, err := sparse.NewKMeans(dev, heads.KV, heads.Dim)
	if err != nil {
		return nil, err
	}
	defer km.Release()
	ls := make([]*Layers, batch)
	for i := range ls {
		o := clustering
		o.Seed += uint64(i)
		if ls[i], err = newLayers(dev, km, dense, t, o, sinks, recent); err != nil {
			return nil, err
		}
		defer ls[i].release()
	}
	q := t.Query(t.Queries() - 1)
	var prev []float32
	if t.Queries() > 1 {
		prev = t.Query(t.Queries() - 2)
	}
	qs := make([]float32, 0, batch*len(q))
	var positional []*kvcache.Layer
	for _, l := range ls {
		qs = append(qs, q...)
		positional = append(positional, l.Positional)
	}
	ref, denseUs, err := timeDense(dense, positional, qs, reps)
	if err != nil {
		return nil, err
	}
	kvBytes := float64(batch * 2 * n * heads.KV * heads.Dim * 2)
	var out []StepRun
	for _, p := range policies {
		if progress != nil {
			progress(p.Name)
		}
		r, err := timeBatchStep(p, ls, prev, q, ref, reps)
		if errors.Is(err, ErrNoBatch) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("evaluate: %s, batch %d: %w", p.Name, batch, err)
		}
		r.Policy, r.Tokens, r.Batch, r.DenseUs, r.Speedup = p.Name, n, batch, denseUs, denseUs/r.StepUs
		r.DenseGBps = kvBytes / denseUs / 1e3
		out = append(out, r)
	}
	return out, nil
}

// timeBatchStep makes, checks and times one policy's batch over ls.
func timeBatchStep(p Policy, ls []*Layers, prev, q, ref []float32, reps int) (StepRun, error) {
	var r StepRun
	b, seqs, free, err := batchOf(p, ls, prev, q)
	if err != nil {
		return r, err
	}
	defer free()
	h := ls[0].Dense.Heads()
	per := len(q)
	all := func(x []float32) []float32 {
		out := make([]float32, 0, len(ls)*per)
		for range ls {
			out = append(out, x...)
		}
		return out
	}
	// A step of the query before divides the timed step's attention, as
	// in decoding (where the policy balances).
	if prev != nil {
		if err := b.SetQuery(all(prev)); err != nil {
			return r, err
		}
		if _, err := b.Time(0, 1); err != nil {
			return r, err
		}
		if err := b.Rebalance(); err != nil {
			return r, err
		}
	}
	for _, s := range seqs {
		if err := s.SetQuery(q); err != nil { // DELTA picks its pages for q
			return r, err
		}
	}
	if _, err := b.Time(0, 1); err != nil {
		return r, err
	}
	got := make([]float32, per)
	for i, s := range seqs {
		if err := s.Output().ReadFloat32(0, got); err != nil {
			return r, err
		}
		want := ref[i*per : (i+1)*per]
		for hh := 0; hh < h.Query; hh++ {
			var num, den float64
			for k := hh * h.Dim; k < (hh+1)*h.Dim; k++ {
				d := float64(got[k]) - float64(want[k])
				num += d * d
				den += float64(want[k]) * float64(want[k])
			}
			r.RelErr += math.Sqrt(num/math.Max(den, 1e-300)) / float64(h.Query*len(seqs))
		}
	}
	if err := timeStages(ls[0].dev, &r, b, reps); err != nil {
		return r, err
	}
	if !p.Adaptive {
		r.Budget = ls[0].Budget
	}
	if p.Reads != nil {
		for i, s := range seqs {
			sk, err := skeletonOf(s, ls[i], p.Reads)
			if err != nil {
				return r, err
			}
			if r.Skeleton == nil {
				r.Skeleton = sk
			} else if err := r.Skeleton.Add(sk); err != nil {
				return r, err
			}
		}
	}
	r.DenseCost = h.DenseCost(ls[0].Positional.Len())
	for _, s := range seqs {
		c, err := stepCost(p, s)
		if err != nil {
			return r, err
		}
		if c != nil {
			r.Costs = append(r.Costs, *c)
		}
	}
	if p.Ranks != nil && p.Adaptive && ls[0].Budget == 0 {
		ranks, cuts, err := p.Ranks(seqs[0])
		if err != nil {
			return r, err
		}
		tokens, err := exactTokens(ls[0], ranks, cuts)
		if err != nil {
			return r, err
		}
		for _, l := range ls {
			l.Budget = int(tokens) - l.Sinks - l.Recent
		}
	}
	return r, nil
}
