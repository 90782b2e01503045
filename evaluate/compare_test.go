package evaluate

import (
	"encoding/json"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/trace"
	"github.com/vksparse/vksparse/workload"
)

// compareLayer is a generated layer small enough to compare every policy
// on in a moment: 2 KV heads of 4 query heads, 1500 tokens, 6 decode
// queries.
func compareLayer(t *testing.T) *trace.Trace {
	cfg := workload.DefaultConfig(1500)
	cfg.KVHeads, cfg.QHeads, cfg.HeadDim, cfg.Queries = 2, 8, 32, 6
	tr, err := workload.Generate(cfg)
	require.NoError(t, err)
	return tr
}

// TestCompareTacticMatchesTacticEvaluation checks the wiring of the
// adaptive part against the evaluation of Tactic alone: at every P,
// Tactic's union size, own selection, mass, success and error equal those
// of Tactic() on the same trace, clustering and fit.
func TestCompareTacticMatchesTacticEvaluation(t *testing.T) {
	tr := compareLayer(t)
	opts := DefaultCompareOptions()
	opts.P = []float64{0.5, 0.9}
	cmp, err := Compare(tr, opts)
	require.NoError(t, err)
	topts := DefaultTacticOptions()
	topts.P, topts.Fit = opts.P, opts.Fit
	ev, err := Tactic(tr, topts)
	require.NoError(t, err)
	require.Equal(t, ev.Options.Prefill, cmp.Options.Prefill)
	require.Equal(t, ev.Options.Queries, cmp.Options.Queries)
	for pi, r := range cmp.Results {
		got, want := r.Policy(PolicyTactic, ""), ev.Results[pi]
		require.NotNil(t, got)
		assert.InDelta(t, want.Union, got.Union, 1e-9)
		assert.InDelta(t, want.Selected, got.Own, 1e-9)
		assert.InDelta(t, want.Mass, got.Mass, 1e-12)
		assert.InDelta(t, want.OwnMass, got.OwnMass, 1e-12)
		assert.InDelta(t, want.SuccessRate, got.SuccessRate, 1e-12)
		assert.InDelta(t, want.RelErr, got.RelErr, 1e-12)
		assert.InDelta(t, want.BoundWorst, got.BoundWorst, 1e-12)
		for h, head := range got.Heads {
			assert.InDelta(t, want.Heads[h].Mass, head.Mass, 1e-12)
			assert.Equal(t, want.Heads[h].Kind, head.Kind)
		}
	}
}

// TestCompareInvariants checks what must hold of every comparison on a
// generated layer: the oracles always reach P, the token oracle with no
// more tokens than the cluster oracle; the fixed-budget policies get the
// mean own selection of their source (Quest up to a page less); pure
// selections meet the error bound; Double-P's covered mass includes its
// approximated clusters; and the result does not depend on the number of
// workers and survives JSON.
func TestCompareInvariants(t *testing.T) {
	tr := compareLayer(t)
	opts := DefaultCompareOptions()
	opts.Workers = 1
	one, err := Compare(tr, opts)
	require.NoError(t, err)
	opts.Workers = 3
	calls := 0
	opts.Progress = func(done, total int) {
		calls++
		require.Equal(t, calls, done)
		require.LessOrEqual(t, done, total)
	}
	cmp, err := Compare(tr, opts)
	require.NoError(t, err)
	require.Equal(t, one.Results, cmp.Results)
	require.Positive(t, calls)

	require.Len(t, cmp.Results, len(opts.P))
	cases := len(cmp.Options.Queries) * tr.QHeads
	for _, r := range cmp.Results {
		require.Len(t, r.Policies, len(AdaptivePolicies())+len(FixedBudgetPolicies())*len(opts.BudgetFrom))
		for _, pr := range r.Policies {
			require.Equal(t, cases, pr.Cases, pr.Policy)
			require.Len(t, pr.Heads, tr.QHeads)
			require.LessOrEqual(t, pr.Own, pr.Union+1e-9, pr.Policy)
			require.LessOrEqual(t, pr.OwnMass, pr.Mass+1e-12, pr.Policy)
			require.True(t, pr.UnionFrac > 0 && pr.UnionFrac <= 1)
			if pr.Policy == PolicyDoubleP {
				require.False(t, pr.BoundApplies)
				require.GreaterOrEqual(t, pr.Covered, pr.Mass)
				continue
			}
			require.True(t, pr.BoundApplies)
			require.LessOrEqualf(t, pr.BoundWorst, 1.0, "%s/%s P=%v", pr.Policy, pr.BudgetFrom, r.P)
			require.Equal(t, pr.Mass, pr.Covered)
			require.Zero(t, pr.Approximated)
		}
		for _, oracle := range []string{PolicyTokenOracle, PolicyClusterOracle} {
			require.Equal(t, 1.0, r.Policy(oracle, "").SuccessRate, oracle)
		}
		tok, cl := r.Policy(PolicyTokenOracle, ""), r.Policy(PolicyClusterOracle, "")
		require.LessOrEqual(t, tok.Own, cl.Own)
		for _, from := range opts.BudgetFrom {
			src := r.Policy(from, "")
			for _, p := range FixedBudgetPolicies() {
				pr := r.Policy(p, from)
				require.NotNil(t, pr)
				require.Equal(t, src.Own, pr.Budget)
				// The layer's middle is long enough for every budget here;
				// the sinks and window are always attended.
				want := math.Max(math.Round(src.Own), float64(sparse.BaselineSinks+sparse.BaselineWindow))
				if p == PolicyQuest {
					require.LessOrEqual(t, pr.Own, want+1e-9)
					require.GreaterOrEqual(t, pr.Own, want-15)
				} else {
					require.Equal(t, want, pr.Own, "%s/%s", p, from)
				}
			}
		}
	}
	b, err := json.Marshal(cmp)
	require.NoError(t, err)
	var back Comparison
	require.NoError(t, json.Unmarshal(b, &back))
	require.Equal(t, cmp.Results, back.Results)
	require.Contains(t, string(b), `"budget_from":"doublep"`)
}

// TestCompareH2OObserve checks that H2O's dense observations are what
// separates it from a cold start: with no observation its first step
// selects the lowest middle ids as heavy hitters.
func TestCompareH2OObserve(t *testing.T) {
	tr := compareLayer(t)
	opts := DefaultCompareOptions()
	opts.P = []float64{0.9}
	opts.Queries = []int{4, 5}
	opts.Prefill = int(tr.QPos[3]) + 1
	withObs, err := Compare(tr, opts)
	require.NoError(t, err)
	assert.Equal(t, []int{0, 1, 2, 3}, withObs.Options.H2OObserve)
	opts.H2OObserve = []int{}
	cold, err := Compare(tr, opts)
	require.NoError(t, err)
	assert.Empty(t, cold.Options.H2OObserve)
	a := withObs.Results[0].Policy(PolicyH2O, PolicyTactic)
	b := cold.Results[0].Policy(PolicyH2O, PolicyTactic)
	assert.Equal(t, a.Own, b.Own)
	assert.NotEqual(t, a.Mass, b.Mass)
	// The other policies do not depend on H2O's observations.
	assert.Equal(t, withObs.Results[0].Policy(PolicyQuest, PolicyTactic), cold.Results[0].Policy(PolicyQuest, PolicyTactic))
}

// TestComparePolicies checks that running a subset of the policies gives
// those policies' figures of the full run, and only them.
func TestComparePolicies(t *testing.T) {
	tr := compareLayer(t)
	opts := DefaultCompareOptions()
	opts.P = []float64{0.7}
	full, err := Compare(tr, opts)
	require.NoError(t, err)
	opts.Policies = []string{PolicyQuest, PolicyTactic, PolicyH2O}
	opts.BudgetFrom = []string{PolicyTactic}
	part, err := Compare(tr, opts)
	require.NoError(t, err)
	r := part.Results[0]
	require.Len(t, r.Policies, 3)
	for i, want := range [][2]string{{PolicyTactic, ""}, {PolicyQuest, PolicyTactic}, {PolicyH2O, PolicyTactic}} {
		require.Equal(t, want, [2]string{r.Policies[i].Policy, r.Policies[i].BudgetFrom})
		require.Equal(t, *full.Results[0].Policy(want[0], want[1]), r.Policies[i])
	}
	assert.Nil(t, r.Policy(PolicyDoubleP, ""))
	// Only adaptive policies: no budget source needs to run.
	opts.Policies = []string{PolicyTokenOracle}
	_, err = Compare(tr, opts)
	require.NoError(t, err)
	// Curve orders a policy's figures by tokens.
	opts = DefaultCompareOptions()
	opts.Policies, opts.P = []string{PolicyTactic}, []float64{0.9, 0.5, 0.7}
	cmp, err := Compare(tr, opts)
	require.NoError(t, err)
	curve := cmp.Curve(PolicyTactic, "")
	require.Len(t, curve, 3)
	for i := 1; i < len(curve); i++ {
		require.LessOrEqual(t, curve[i-1].Union, curve[i].Union)
	}
	assert.Empty(t, cmp.Curve(PolicyQuest, PolicyTactic))
}

func TestCompareErrors(t *testing.T) {
	tr := compareLayer(t)
	for name, edit := range map[string]func(o *CompareOptions){
		"noP":      func(o *CompareOptions) { o.P = nil },
		"badP":     func(o *CompareOptions) { o.P = []float64{1.5} },
		"sinks":    func(o *CompareOptions) { o.Sinks = -1 },
		"window":   func(o *CompareOptions) { o.Window = -1 },
		"clusters": func(o *CompareOptions) { o.AvgClusterSize = 0 },
		"p2":       func(o *CompareOptions) { o.DoubleP2 = 0 },
		"source":   func(o *CompareOptions) { o.BudgetFrom = []string{PolicyQuest} },
		"repeat":   func(o *CompareOptions) { o.BudgetFrom = []string{PolicyTactic, PolicyTactic} },
		"policy":   func(o *CompareOptions) { o.Policies = []string{"dense"} },
		"twice":    func(o *CompareOptions) { o.Policies = []string{PolicyQuest, PolicyQuest} },
		"notRun":   func(o *CompareOptions) { o.Policies = []string{PolicyQuest, PolicyTactic} },
		"fit":      func(o *CompareOptions) { o.Fit.InitialFrac = 2 },
		"query":    func(o *CompareOptions) { o.Queries = []int{99} },
		"noQuery":  func(o *CompareOptions) { o.Queries = []int{} },
		"inside":   func(o *CompareOptions) { o.Queries = []int{0}; o.Prefill = tr.Tokens },
		"prefill":  func(o *CompareOptions) { o.Prefill = 2 },
		"observe":  func(o *CompareOptions) { o.Queries = []int{2}; o.H2OObserve = []int{5} },
	} {
		opts := DefaultCompareOptions()
		edit(&opts)
		_, err := Compare(tr, opts)
		assert.Error(t, err, name)
	}
	_, err := Compare(nil, DefaultCompareOptions())
	assert.Error(t, err)
}
