package evaluate

import (
	"fmt"
	"math"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/trace"
	"github.com/vksparse/vksparse/workload"
)

// DefaultSeed is the K-means seed of DefaultTacticOptions.
const DefaultSeed = 0x7AC71C

// TacticOptions configures Tactic. Start from DefaultTacticOptions: every
// field is used as given, except the two that are derived from the trace
// when zero (Setup). Progress counts clustering one KV head, or
// evaluating one query on one KV head.
type TacticOptions struct {
	Setup
}

// DefaultTacticOptions returns the setup of the paper's evaluation as the
// references implement it: P = 0.5, 0.7, 0.9, sparse.TacticDefaultSinks
// sinks, clusters of 16 tokens on average, 10 K-means iterations over the
// whole prefill (KMeansSpan 0, the paper's clustering), seed DefaultSeed,
// the paper's fitted curve (sparse.TacticCurveFit), and Prefill and
// Queries derived from the trace.
func DefaultTacticOptions() TacticOptions {
	return TacticOptions{Setup{
		P:              []float64{0.5, 0.7, 0.9},
		Sinks:          sparse.TacticDefaultSinks,
		AvgClusterSize: sparse.KMeansDefaultAvgClusterSize,
		KMeansIters:    sparse.KMeansDefaultIters,
		Seed:           DefaultSeed,
		Fit:            sparse.TacticCurveFit(),
	}}
}

// TailQueries returns the indices of the trace's consecutive tail
// queries: the longest run i = k … Queries()−1 with QPos[i] = QPos[i−1]+1,
// the decode steps that follow one another at the end of the trace.
func TailQueries(t *trace.Trace) []int {
	n := t.Queries()
	if n == 0 {
		return nil
	}
	k := n - 1
	for k > 0 && t.QPos[k-1]+1 == t.QPos[k] {
		k--
	}
	out := make([]int, 0, n-k)
	for i := k; i < n; i++ {
		out = append(out, i)
	}
	return out
}

// DefaultPrefill returns the prefill length used when
// TacticOptions.Prefill is 0: min(Tokens − Queries(), the least position
// of the given queries). A trace's queries are taken as its last
// decode steps, so its last Queries() tokens are decoded. For a generated
// workload (package workload), whose queries are exactly those tokens,
// this is Tokens − Queries; for the real traces (16384 tokens, 64 queries)
// it is 16320, the prefill their README names.
func DefaultPrefill(t *trace.Trace, queries []int) int {
	p := t.Tokens - t.Queries()
	for _, qi := range queries {
		if qi >= 0 && qi < t.Queries() {
			p = min(p, int(t.QPos[qi]))
		}
	}
	return p
}

// TacticEvaluation is the result of Tactic.
type TacticEvaluation struct {
	Tokens  int `json:"tokens"`
	QHeads  int `json:"q_heads"`
	KVHeads int `json:"kv_heads"`
	HeadDim int `json:"head_dim"`
	// Options are the options used, Prefill and Queries filled in.
	Options TacticOptions `json:"options"`
	// Kinds gives each query head's kind from the trace metadata
	// (workload.KindsOf), nil when the trace records none.
	Kinds []string `json:"kinds,omitempty"`
	// Results holds one entry per target mass, in the order of Options.P.
	Results []TacticResult `json:"results"`
}

// TacticResult holds the figures for one target mass P: over all
// evaluated (query, query head) cases, and per query head.
type TacticResult struct {
	P float64 `json:"p"`
	TacticStats
	// Traffic is what a step of the layer reads at the least.
	Traffic StepTraffic  `json:"traffic"`
	Heads   []TacticHead `json:"heads"`
}

// TacticHead is the figures of one query head over the evaluated
// queries.
type TacticHead struct {
	Head   int    `json:"head"`
	KVHead int    `json:"kv_head"`
	Kind   string `json:"kind,omitempty"`
	TacticStats
}

// TacticStats aggregates (query, query head) cases. A head attends the
// union of the selections of its GQA group plus the fixed tokens (the
// union); its own selection is its own clusters plus the fixed tokens.
// Means are arithmetic means over the cases.
type TacticStats struct {
	Cases int `json:"cases"`
	// Attended is the mean number of tokens a query could attend (pos+1).
	Attended float64 `json:"attended"`
	// SuccessRate is the share of cases whose union mass reaches P;
	// OwnSuccessRate the same for the own selection.
	SuccessRate    float64 `json:"success_rate"`
	OwnSuccessRate float64 `json:"own_success_rate"`
	// Mass is the mean union mass p(I), MinMass the least; OwnMass is the
	// mean mass of the own selection.
	Mass    float64 `json:"mass"`
	MinMass float64 `json:"min_mass"`
	OwnMass float64 `json:"own_mass"`
	// Selected is the mean size of the own selection, fixed tokens
	// included; Union the mean size of the union.
	Selected float64 `json:"selected"`
	Union    float64 `json:"union"`
	// Sampled is the mean number of key rows the head's fit scores: the
	// fixed tokens and sparse.TacticBudget.SampledTokens.
	Sampled float64 `json:"sampled"`
	// ClusterOptimal is the mean sparse.ClusterTopPCount (fixed tokens
	// forced), GlobalOptimal the mean sparse.TopPCount.
	ClusterOptimal float64 `json:"cluster_optimal"`
	GlobalOptimal  float64 `json:"global_optimal"`
	// SelectedOverClusterOptimal is Selected / ClusterOptimal.
	SelectedOverClusterOptimal float64 `json:"selected_over_cluster_optimal"`
	// RelErr is the mean and MaxRelErr the largest relative error of
	// union attention against dense attention, ‖o − ô‖/‖o‖.
	RelErr    float64 `json:"rel_err"`
	MaxRelErr float64 `json:"max_rel_err"`
	// BoundWorst is the largest ‖o − ô‖ / (2(1 − p(I))·max‖v_i‖ + ε) over
	// the cases, with ô union attention, v_i the values of the attended
	// tokens and ε = 1e-12·max‖v_i‖ for rounding. ‖o − ô‖ ≤ 2(1 − p(I))·
	// max‖v_i‖ always holds, so BoundWorst ≤ 1.
	BoundWorst float64 `json:"bound_worst"`
}

// tacticCase is the measurement of one (P, query, query head).
type tacticCase struct {
	union, own sparse.Fidelity
	attended   int
	sampled    int     // key rows the fit scores, fixed tokens included
	bound      float64 // ‖o − ô‖ / (2(1 − p(I))·max‖v‖ + ε)
}

// Tactic measures Tactic's selection on a trace with the float64
// references. Each KV head's prefill (tokens [Sinks, Prefill)) is
// clustered once. Then for each evaluated query, each KV head and each P,
// sparse.TacticDecodeRef selects the tokens of the query heads sharing the
// KV head (fixed tokens: sparse.TacticFixedTokens(Sinks, Prefill, pos)),
// and every query head's union and own selection are measured against its
// exact attention over [0, pos] (sparse.FidelityOracle, with the clusters
// and the fixed tokens as the cluster-optimal oracle). Work is spread over
// goroutines; results are summed in a fixed order, so they are
// deterministic.
func Tactic(t *trace.Trace, opts TacticOptions) (*TacticEvaluation, error) {
	if t == nil {
		return nil, fmt.Errorf("evaluate: Tactic: no trace")
	}
	if err := t.Validate(); err != nil {
		return nil, err
	}
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	queries, prefill, err := opts.resolve(t, "Tactic")
	if err != nil {
		return nil, err
	}
	ev := &TacticEvaluation{Tokens: t.Tokens, QHeads: t.QHeads, KVHeads: t.KVHeads, HeadDim: t.HeadDim, Options: opts}
	ev.Options.Prefill, ev.Options.Queries, ev.Options.Progress = prefill, slices.Clone(queries), nil
	if kinds, err := workload.KindsOf(t); err == nil {
		for _, k := range kinds {
			ev.Kinds = append(ev.Kinds, k.String())
		}
	}
	step := opts.counter(t.KVHeads * (1 + len(queries)))

	// Cluster every KV head's prefill once.
	rows := 0
	for _, qi := range queries {
		rows = max(rows, int(t.QPos[qi])+1)
	}
	heads, err := opts.clusterHeads(t, rows, prefill, step)
	if err != nil {
		return nil, err
	}

	// cases[pi][a][h]: P index, evaluated query, query head.
	cases := make([][][]tacticCase, len(opts.P))
	for pi := range cases {
		cases[pi] = make([][]tacticCase, len(queries))
		for a := range cases[pi] {
			cases[pi][a] = make([]tacticCase, t.QHeads)
		}
	}
	err = parallelFor(len(queries)*t.KVHeads, opts.workers(), func(i int) error {
		a, g := i/t.KVHeads, i%t.KVHeads
		err := tacticEvalStep(t, &heads[g], g, queries[a], prefill, &opts, cases, a)
		step()
		return err
	})
	if err != nil {
		return nil, err
	}

	for pi, p := range opts.P {
		r := TacticResult{P: p}
		var all []tacticCase
		for h := 0; h < t.QHeads; h++ {
			var hc []tacticCase
			for a := range queries {
				hc = append(hc, cases[pi][a][h])
			}
			all = append(all, hc...)
			head := TacticHead{Head: h, KVHead: h / (t.QHeads / t.KVHeads), TacticStats: tacticStats(hc, p)}
			if ev.Kinds != nil {
				head.Kind = ev.Kinds[h]
			}
			r.Heads = append(r.Heads, head)
		}
		r.TacticStats = tacticStats(all, p)
		r.Traffic = stepTraffic(cases[pi], heads, t.HeadDim, opts.Fit.Moments)
		ev.Results = append(ev.Results, r)
	}
	return ev, nil
}

// Validate reports the first problem with the options that does not
// depend on the trace (Tactic checks the rest).
func (o *TacticOptions) Validate() error { return o.validate("Tactic") }

// tacticEvalStep measures query qi on KV head g for every P, writing
// cases[pi][a][h] for the query heads h of g.
func tacticEvalStep(t *trace.Trace, h *kvHead, g, qi, prefill int, opts *TacticOptions, cases [][][]tacticCase, a int) error {
	d, group := t.HeadDim, t.QHeads/t.KVHeads
	pos := int(t.QPos[qi])
	keys, values := h.keys[:(pos+1)*d], h.values[:(pos+1)*d]
	fixed, err := sparse.TacticFixedTokens(opts.Sinks, prefill, pos)
	if err != nil {
		return err
	}
	vmax := 0.0
	for i := 0; i <= pos; i++ {
		v := values[i*d : (i+1)*d]
		vmax = math.Max(vmax, norm(v))
	}
	qrow := t.Query(qi)
	qs := make([][]float64, group)
	oracles := make([]*sparse.FidelityOracle, group)
	for j := range qs {
		qs[j] = make([]float64, d)
		for k := range qs[j] {
			qs[j][k] = float64(qrow[(g*group+j)*d+k])
		}
		if oracles[j], err = sparse.NewFidelityOracle(qs[j], keys, values, t.Scale); err != nil {
			return err
		}
	}
	for pi, p := range opts.P {
		outs, union, budgets, err := sparse.TacticDecodeRef(qs, keys, values, t.Scale, h.idx, fixed, p, opts.Fit)
		if err != nil {
			return err
		}
		for j := range qs {
			c := &cases[pi][a][g*group+j]
			c.attended = pos + 1
			c.sampled = len(fixed) + budgets[j].SampledTokens()
			if c.union, err = oracles[j].Measure(union, outs[j], h.idx.Members, fixed, p); err != nil {
				return err
			}
			own := sparse.TacticSelectRef(h.idx, fixed, budgets[j])
			if c.own, err = oracles[j].Measure(own, nil, h.idx.Members, fixed, p); err != nil {
				return err
			}
			if vmax > 0 { // with vmax = 0 both sides of the bound are 0
				c.bound = c.union.Err / (2*(1-c.union.Mass)*vmax + 1e-12*vmax)
			}
		}
	}
	return nil
}

// tacticStats aggregates cases for target mass p.
func tacticStats(cases []tacticCase, p float64) TacticStats {
	s := TacticStats{Cases: len(cases), MinMass: math.Inf(1)}
	if len(cases) == 0 {
		s.MinMass = 0
		return s
	}
	for _, c := range cases {
		s.Attended += float64(c.attended)
		if c.union.Success(p) {
			s.SuccessRate++
		}
		if c.own.Success(p) {
			s.OwnSuccessRate++
		}
		s.Mass += c.union.Mass
		s.MinMass = math.Min(s.MinMass, c.union.Mass)
		s.OwnMass += c.own.Mass
		s.Selected += float64(c.own.Selected)
		s.Union += float64(c.union.Selected)
		s.Sampled += float64(c.sampled)
		s.ClusterOptimal += float64(c.union.ClusterOptimal)
		s.GlobalOptimal += float64(c.union.GlobalOptimal)
		s.RelErr += c.union.RelErr
		s.MaxRelErr = math.Max(s.MaxRelErr, c.union.RelErr)
		s.BoundWorst = math.Max(s.BoundWorst, c.bound)
	}
	n := float64(len(cases))
	for _, x := range []*float64{&s.Attended, &s.SuccessRate, &s.OwnSuccessRate, &s.Mass, &s.OwnMass, &s.Selected, &s.Union, &s.Sampled, &s.ClusterOptimal, &s.GlobalOptimal, &s.RelErr} {
		*x /= n
	}
	s.SelectedOverClusterOptimal = s.Selected / s.ClusterOptimal
	return s
}

// parallelFor runs f(0) … f(n−1) on at most workers goroutines and returns
// the error of the lowest index that failed, if any.
func parallelFor(n, workers int, f func(i int) error) error {
	errs := make([]error, n)
	var next atomic.Int64
	var wg sync.WaitGroup
	for w := 0; w < min(workers, n); w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := int(next.Add(1)) - 1; i < n; i = int(next.Add(1)) - 1 {
				errs[i] = f(i)
			}
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// norm returns ‖v‖₂, summed in order.
func norm(v []float64) float64 {
	s := 0.0
	for _, x := range v {
		s += x * x
	}
	return math.Sqrt(s)
}
