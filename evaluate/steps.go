package evaluate

import (
	"fmt"
	"math"
	"time"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/trace"
	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/workload"
)

// Stepper is a decode step of any policy on the GPU (sparse.Step,
// sparse.TacticStep).
type Stepper interface {
	SetQuery(q []float32) error
	Time(warmup, reps int) ([]time.Duration, error)
	TimeStages(warmup, reps int) ([]time.Duration, time.Duration, error)
	Stages() []string
	Output() *vk.Buffer
	Release() error
}

// Layers is what a policy's step is made over: one sequence's cache in
// cluster order with its K-means index, the same tokens in positional
// order (for page and token policies), and the dense kernels.
type Layers struct {
	Dense      *sparse.Dense
	Ordered    *kvcache.Layer
	Clusters   *kvcache.Clusters
	Positional *kvcache.Layer
	Sinks      int // tokens before the index
	Recent     int // tokens after it
	// Budget is the tokens a fixed-budget policy attends beside the sinks
	// and the recent window: the exactly attended tokens of the first
	// adaptive policy run, mean over KV heads.
	Budget int
	trace  *trace.Trace // the tokens and queries, for policies that report mass
	dev    *vk.Device
}

// Policy names a decode policy and makes its step.
type Policy struct {
	Name string
	// Adaptive policies set the budget of the fixed-budget ones.
	Adaptive bool
	Make     func(l *Layers) (Stepper, error)
	// Ranks, if set, reads the last step's cluster ranks [Hq][C] and cuts
	// [Hq] (a KV head attends the clusters some head ranks below its cut).
	Ranks func(s Stepper) (ranks, cuts []int, err error)
	// Read, if set, reports the rows the last step read per KV head and
	// the true attention mass of the tokens it attended exactly, mean over
	// query heads, for the query q.
	Read func(s Stepper, l *Layers, q []float32) (rows, mass float64, err error)
	// Reads counts the bytes each stage of the last step read (Stages
	// order), the step's skeleton (Skeleton).
	Reads func(s Stepper, l *Layers) ([]float64, error)
	// FallsBack says whether a decode.Model layer under the policy falls
	// back to dense attention where its step would cost more (Tactic,
	// Double-P, Quest, StreamingLLM, H2O): the step's run reports its
	// cost (StepRun.Costs).
	FallsBack bool
	// Batch, if set, makes the policy's own batch over the sequences ls
	// and returns each sequence's step; otherwise BatchSteps batches the
	// steps Make makes (sparse.NewBatch).
	Batch func(ls []*Layers) (Batched, []Stepper, error)
}

// StepRun is one policy's decode step on the GPU over a trace's tokens:
// medians of GPU times (timestamps) against dense attention from the same
// run, and its output against dense attention's.
type StepRun struct {
	Source     string             `json:"source"`
	Policy     string             `json:"policy"`
	Tokens     int                `json:"tokens"`
	Batch      int                `json:"batch"` // sequences timed at once (BatchSteps); 1 for Steps
	Dispatches int                `json:"dependent_dispatches"`
	StepUs     float64            `json:"step_us"`
	StageUs    map[string]float64 `json:"stage_us"`
	DenseUs    float64            `json:"dense_us"`
	DenseGBps  float64            `json:"dense_gb_per_s"`
	Speedup    float64            `json:"speedup"`
	// Budget is a fixed-budget policy's middle tokens (Layers.Budget).
	Budget int `json:"budget_tokens,omitempty"`
	// ExactPct is the tokens attended exactly, % of all, mean over KV
	// heads (where the policy reports them).
	ExactPct float64 `json:"exact_pct,omitempty"`
	// RelErr is ‖o − o_dense‖/‖o_dense‖ per query head, mean over heads,
	// both outputs from the GPU for the trace's last query.
	RelErr float64 `json:"mean_rel_err"`
	// ReadPct is the rows the step read (tokens, summaries) per KV head, %
	// of the tokens, and Mass the true attention mass (the dense softmax)
	// of the tokens it attended exactly, mean over query heads (where the
	// policy reports them: Policy.Read).
	ReadPct float64 `json:"read_pct,omitempty"`
	Mass    float64 `json:"exact_mass,omitempty"`
	// Skeleton holds the bytes each stage read (where the policy counts
	// them: Policy.Reads), and once timed the skeleton's times.
	Skeleton *Skeleton `json:"skeleton,omitempty"`
	// Costs holds, where the policy falls back to dense attention
	// (Policy.FallsBack), each sequence's step as the library counts it
	// for that choice (sparse.Step.Cost), and DenseCost dense attention's
	// over one sequence (sparse.Heads.DenseCost).
	Costs     []sparse.Cost `json:"costs,omitempty"`
	DenseCost sparse.Cost   `json:"dense_cost"`
}

// stepCost returns the library's cost of s's last step where p falls back
// to dense attention.
func stepCost(p Policy, s Stepper) (*sparse.Cost, error) {
	if !p.FallsBack {
		return nil, nil
	}
	base := baseStep(s)
	if base == nil {
		return nil, fmt.Errorf("evaluate: %s: a %T reports no cost", p.Name, s)
	}
	c, err := base.Cost()
	return &c, err
}

// Steps times each policy's step over all of a trace's tokens for its last
// query (the first Sinks tokens and the last Recent outside the K-means
// index, clustered with clustering) beside dense attention (kernels built
// with opts). progress, if not nil, is told each policy before it runs.
func Steps(dev *vk.Device, t *trace.Trace, opts sparse.DenseOptions, clustering sparse.KMeansOptions, policies []Policy, sinks, recent, reps int, progress func(name string)) ([]StepRun, error) {
	heads := sparse.Heads{Query: t.QHeads, KV: t.KVHeads, Dim: t.HeadDim}
	n := t.Tokens
	if reps <= 0 || n <= sinks+recent+1 {
		return nil, fmt.Errorf("evaluate: Steps: %d tokens with %d sinks and %d recent, %d timed runs", n, sinks, recent, reps)
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
	l, err := newLayers(dev, km, dense, t, clustering, sinks, recent)
	if err != nil {
		return nil, err
	}
	defer l.release()
	q := t.Query(t.Queries() - 1)
	var prev []float32 // the query before, whose step divides the timed one's attention
	if t.Queries() > 1 {
		prev = t.Query(t.Queries() - 2)
	}

	ref, denseUs, err := timeDense(dense, []*kvcache.Layer{l.Positional}, q, reps)
	if err != nil {
		return nil, err
	}
	kvBytes := float64(2 * n * heads.KV * heads.Dim * 2)

	var out []StepRun
	for _, p := range policies {
		if progress != nil {
			progress(p.Name)
		}
		r, err := timeStep(dev, l, p, prev, q, ref, reps)
		if err != nil {
			return nil, fmt.Errorf("evaluate: %s: %w", p.Name, err)
		}
		r.Policy, r.Tokens, r.Batch, r.DenseUs, r.Speedup = p.Name, n, 1, denseUs, denseUs/r.StepUs
		r.DenseGBps = kvBytes / denseUs / 1e3
		out = append(out, r)
	}
	return out, nil
}

// newLayers makes Layers over all of t's tokens, clustered with
// clustering (sinks and recent outside the index).
func newLayers(dev *vk.Device, km *sparse.KMeans, dense *sparse.Dense, t *trace.Trace, clustering sparse.KMeansOptions, sinks, recent int) (*Layers, error) {
	h, n := dense.Heads(), t.Tokens
	l := &Layers{Dense: dense, Sinks: sinks, Recent: recent, trace: t, dev: dev}
	var err error
	for _, x := range []**kvcache.Layer{&l.Ordered, &l.Positional} {
		if *x, err = kvcache.NewLayer(dev, h.KV, h.Dim, n); err == nil {
			err = (*x).Prefill(t.K, t.V, n)
		}
		if err != nil {
			l.release()
			return nil, err
		}
	}
	if l.Clusters, err = km.Cluster(l.Ordered, sinks, n-sinks-recent, clustering); err == nil {
		err = l.Ordered.Reorder(l.Clusters)
	}
	if err != nil {
		l.release()
		return nil, err
	}
	return l, nil
}

// release frees the layers and the index.
func (l *Layers) release() {
	if l.Clusters != nil {
		l.Clusters.Release()
	}
	for _, x := range []*kvcache.Layer{l.Ordered, l.Positional} {
		if x != nil {
			x.Release()
		}
	}
}

// balancer is a step whose attention divides its work by the step before
// (sparse.Step.Rebalance).
type balancer interface{ Rebalance() error }

// timeStep makes, checks and times one policy's step; where the step
// balances its attention and prev is set, as in decoding, after a step of
// prev.
func timeStep(dev *vk.Device, l *Layers, p Policy, prev, q []float32, ref []float32, reps int) (StepRun, error) {
	var r StepRun
	step, err := p.Make(l)
	if err != nil {
		return r, err
	}
	defer step.Release()
	if b, ok := step.(balancer); ok && prev != nil {
		if err := step.SetQuery(prev); err != nil {
			return r, err
		}
		if _, err := step.Time(0, 1); err != nil {
			return r, err
		}
		if err := b.Rebalance(); err != nil {
			return r, err
		}
	}
	if err := step.SetQuery(q); err != nil {
		return r, err
	}
	if _, err := step.Time(0, 1); err != nil {
		return r, err
	}
	got := make([]float32, len(q))
	if err := step.Output().ReadFloat32(0, got); err != nil {
		return r, err
	}
	d := l.Dense.Heads().Dim
	for h := 0; h*d < len(q); h++ {
		var num, den float64
		for i := h * d; i < (h+1)*d; i++ {
			diff := float64(got[i]) - float64(ref[i])
			num += diff * diff
			den += float64(ref[i]) * float64(ref[i])
		}
		r.RelErr += math.Sqrt(num/math.Max(den, 1e-300)) / float64(len(q)/d)
	}
	if err := timeStages(dev, &r, step, reps); err != nil {
		return r, err
	}
	if !p.Adaptive {
		r.Budget = l.Budget
	}
	if p.Reads != nil {
		if r.Skeleton, err = skeletonOf(step, l, p.Reads); err != nil {
			return r, err
		}
	}
	r.DenseCost = l.Dense.Heads().DenseCost(l.Positional.Len())
	if c, err := stepCost(p, step); err != nil {
		return r, err
	} else if c != nil {
		r.Costs = []sparse.Cost{*c}
	}
	if p.Read != nil {
		rows, mass, err := p.Read(step, l, q)
		if err != nil {
			return r, err
		}
		r.ReadPct, r.Mass = 100*rows/float64(l.Positional.Len()), mass
		r.ExactPct = 0
	}
	if p.Ranks != nil {
		ranks, cuts, err := p.Ranks(step)
		if err != nil {
			return r, err
		}
		tokens, err := exactTokens(l, ranks, cuts)
		if err != nil {
			return r, err
		}
		r.ExactPct = 100 * tokens / float64(l.Ordered.Len())
		if p.Adaptive && l.Budget == 0 {
			l.Budget = int(tokens) - l.Sinks - l.Recent
		}
	}
	return r, nil
}

// exactTokens returns the tokens a KV head attends, mean over KV heads:
// those outside the index and the members of every cluster some query
// head of its group ranks below its cut.
func exactTokens(l *Layers, ranks, cuts []int) (float64, error) {
	h, x := l.Dense.Heads(), l.Clusters
	total := 0
	for g := 0; g < h.KV; g++ {
		hc, err := x.Read(g)
		if err != nil {
			return 0, err
		}
		total += l.Ordered.Len() - x.Count
		for c, m := range hc.Members {
			for hh := g * h.Group(); hh < (g+1)*h.Group(); hh++ {
				if ranks[hh*x.C+c] < cuts[hh] {
					total += len(m)
					break
				}
			}
		}
	}
	return float64(total) / float64(h.KV), nil
}

// DefaultPolicies returns the policies `vkbench compare` runs on the GPU:
// Double-P with its default targets (whose exactly attended tokens set the
// fixed budgets), Tactic at each P (with the default fit, the moment
// estimate, and with the paper's fitted curve), the oracles of the
// Tactic paper's Table 3 at each P (clusters by true mass, exact top-p over
// tokens), Quest, StreamingLLM and H2O at Double-P's budget, a DELTA layer
// reusing its Δ-layer's pick of about that budget (deltaPolicy), and
// LuKA's clustered attention at the paper's defaults and matched to that
// budget. Each counts what its stages read (Policy.Reads).
func DefaultPolicies(ps []float64) []Policy {
	var out []Policy
	out = append(out, doubleP("double-p", sparse.DefaultDoubleP()))
	for _, p := range ps {
		out = append(out, tacticPolicy(fmt.Sprintf("tactic P=%v", p), p, sparse.DefaultTacticFit()),
			tacticPolicy(fmt.Sprintf("tactic curve P=%v", p), p, sparse.TacticCurveFit()))
	}
	for _, p := range ps {
		out = append(out, Policy{Name: fmt.Sprintf("cluster oracle P=%v", p), Adaptive: true, Make: func(l *Layers) (Stepper, error) {
			return sparse.NewClusterOracleStep(l.Dense, l.Ordered, l.Clusters, p)
		}, Reads: keysThenAttend(func(l *Layers) *kvcache.Layer { return l.Ordered })}, Policy{Name: fmt.Sprintf("token oracle P=%v", p), Adaptive: true, Make: func(l *Layers) (Stepper, error) {
			return sparse.NewTokenOracleStep(l.Dense, l.Positional, p)
		}, Reads: keysThenAttend(func(l *Layers) *kvcache.Layer { return l.Positional })})
	}
	out = append(out, Policy{Name: "quest", FallsBack: true, Make: func(l *Layers) (Stepper, error) {
		return sparse.NewQuestStep(l.Dense, l.Positional, l.Budget)
	}, Reads: questReads}, Policy{Name: "streaming", FallsBack: true, Make: func(l *Layers) (Stepper, error) {
		return sparse.NewStreamingStep(l.Dense, l.Positional, l.Budget)
	}, Reads: attendOnly}, Policy{Name: "h2o", FallsBack: true, Make: func(l *Layers) (Stepper, error) {
		s, err := sparse.NewH2OStep(l.Dense, l.Positional, l.Budget)
		if err != nil {
			return nil, err
		}
		return &h2oStep{Step: s, warm: true}, nil
	}, Reads: h2oReads}, deltaPolicy(), lukaDefault(), lukaMatched())
	return out
}

// lukaDefault is LuKA at the paper's defaults (its own budget).
func lukaDefault() Policy {
	p := LuKAPolicy("luka", sparse.DefaultLuKA())
	p.Adaptive = true
	return p
}

// lukaMatched is LuKA with top-K refinement matched to the fixed budget:
// the cover (summaries and raw tail) and K summaries' tokens for each
// query head of a group make about Budget + Sinks + Recent rows.
func lukaMatched() Policy {
	p := LuKAPolicy("luka matched", sparse.LuKA{})
	p.Make = func(l *Layers) (Stepper, error) {
		o := sparse.DefaultLuKA()
		n, h := l.Positional.Len(), l.Dense.Heads()
		s := o.Summaries(n)
		cover := s + n - s*o.Segment
		o.K = max(1, min(s, (l.Budget+l.Sinks+l.Recent-cover)/(h.Group()*o.Segment)))
		return sparse.NewLuKAStep(l.Dense, l.Positional, o)
	}
	return p
}

// h2oStep is H2O's step, its accumulated attention filled before it is
// checked and timed: when its query is first set, a dense prompt-phase
// observation of that query (sparse.H2OSelector.Observe) and h2oWarmup
// steps of it. The prompt phase saw the query the output is checked for,
// which flatters H2O's error a little.
type h2oStep struct {
	*sparse.Step
	warm bool
}

// h2oWarmup is the steps H2O takes before it is checked.
const h2oWarmup = 3

// Rebalance leaves H2O's runs of attention equal: its warm-up must see the
// checked query first, not a step of the one before.
func (s *h2oStep) Rebalance() error { return nil }

// SetQuery sets the query and, the first time, warms the state with it.
func (s *h2oStep) SetQuery(q []float32) error {
	if err := s.Step.SetQuery(q); err != nil || !s.warm {
		return err
	}
	s.warm = false
	if err := s.Selector().(*sparse.H2OSelector).Observe(q); err != nil {
		return err
	}
	_, err := s.Time(0, h2oWarmup)
	return err
}

// LuKAPolicy is LuKA's clustered attention (sparse.LuKAStep) with opts,
// over the tokens in positional order. Its summaries are made when the
// step is: no query has been seen, so attention-weighted summaries are
// means there.
func LuKAPolicy(name string, opts sparse.LuKA) Policy {
	return Policy{Name: name, Make: func(l *Layers) (Stepper, error) {
		return sparse.NewLuKAStep(l.Dense, l.Positional, opts)
	}, Read: lukaRead, Reads: lukaReads}
}

// lukaRead reports the rows a LuKA step read and the true mass of its raw
// tail and refined summaries' tokens.
func lukaRead(s Stepper, l *Layers, _ []float32) (float64, float64, error) {
	st := s.(*sparse.LuKAStep)
	rows, err := st.Attended()
	if err != nil {
		return 0, 0, err
	}
	refined, err := st.Refined()
	if err != nil {
		return 0, 0, err
	}
	h, t := l.Dense.Heads(), l.trace
	p := st.Options().Segment
	tail := st.Summaries() * p
	mass := 0.0
	for hh := 0; hh < h.Query; hh++ {
		// The query Steps checks and times is the trace's last.
		a, err := workload.HeadAttention(t, t.Queries()-1, hh)
		if err != nil {
			return 0, 0, err
		}
		probs := a.Probs
		m := 0.0
		for tok := tail; tok < len(probs); tok++ {
			m += probs[tok]
		}
		for _, c := range refined[hh] {
			for tok := c * p; tok < (c+1)*p; tok++ {
				m += probs[tok]
			}
		}
		mass += m / float64(h.Query)
	}
	return rows, mass, nil
}

// doubleP is Double-P with targets opts.
func doubleP(name string, opts sparse.DoubleP) Policy {
	return Policy{Name: name, Adaptive: true, FallsBack: true, Make: func(l *Layers) (Stepper, error) {
		return sparse.NewDoublePStep(l.Dense, l.Ordered, l.Clusters, opts)
	}, Reads: doublePReads, Ranks: func(s Stepper) ([]int, []int, error) {
		sel := s.(*sparse.Step).Selector().(*sparse.DoublePSelector)
		ranks, err := sel.Bins()
		if err != nil {
			return nil, nil, err
		}
		exact, _, err := sel.Cuts()
		return ranks, exact, err
	}}
}

// DoublePVariants returns Double-P at other targets, named by them.
func DoublePVariants(targets []sparse.DoubleP) []Policy {
	var out []Policy
	for _, o := range targets {
		out = append(out, doubleP(fmt.Sprintf("double-p %v/%v", o.P1, o.P2), o))
	}
	return out
}

// tacticPolicy is Tactic at P with fit, named name.
func tacticPolicy(name string, p float64, fit sparse.TacticFit) Policy {
	return Policy{Name: name, Adaptive: true, FallsBack: true, Make: func(l *Layers) (Stepper, error) {
		return sparse.NewTacticStep(l.Dense, l.Ordered, l.Clusters, p, fit)
	}, Reads: tacticReads, Batch: func(ls []*Layers) (Batched, []Stepper, error) {
		return tacticBatch(ls, p, fit)
	}, Ranks: func(s Stepper) ([]int, []int, error) {
		t := s.(*sparse.TacticStep)
		ranks, err := t.BinsOf()
		if err != nil {
			return nil, nil, err
		}
		cuts, err := t.Cuts()
		return ranks, cuts, err
	}}
}

// tacticBatch is Tactic's batch at P with fit over ls (sparse.TacticBatch)
// with each sequence's step.
func tacticBatch(ls []*Layers, p float64, fit sparse.TacticFit) (Batched, []Stepper, error) {
	var layers []*kvcache.Layer
	var indexes []*kvcache.Clusters
	for _, l := range ls {
		layers, indexes = append(layers, l.Ordered), append(indexes, l.Clusters)
	}
	b, err := sparse.NewTacticBatch(ls[0].Dense, layers, indexes, p, fit)
	if err != nil {
		return nil, nil, err
	}
	seqs := make([]Stepper, len(ls))
	for i := range seqs {
		seqs[i] = b.Step(i)
	}
	return b, seqs, nil
}

// timeDense attends the queries qs ([len(layers)][Hq][D]) densely over
// layers, each sequence its own: the outputs, which the steps are
// compared with, and the median of reps timed runs in µs after a
// second's warm-up.
func timeDense(dense *sparse.Dense, layers []*kvcache.Layer, qs []float32, reps int) ([]float32, float64, error) {
	plan, err := dense.Plan(layers)
	if err != nil {
		return nil, 0, err
	}
	defer plan.Release()
	ref, err := plan.Attend(qs)
	if err != nil {
		return nil, 0, err
	}
	if err := warmUp(plan, time.Second); err != nil {
		return nil, 0, err
	}
	us, err := medianMicros(plan, reps)
	return ref, us, err
}
