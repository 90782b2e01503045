package evaluate

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/trace"
	"github.com/vksparse/vksparse/workload"
)

// smallLayer is a generated layer small enough to evaluate in a moment.
func smallLayer(t *testing.T) *trace.Trace {
	cfg := workload.DefaultConfig(1500)
	cfg.KVHeads, cfg.QHeads, cfg.HeadDim, cfg.Queries = 2, 8, 32, 5
	tr, err := workload.Generate(cfg)
	require.NoError(t, err)
	return tr
}

func TestTacticTailQueriesAndDefaultPrefill(t *testing.T) {
	tr := &trace.Trace{Tokens: 100, QPos: []int32{5, 40, 97, 98, 99}}
	assert.Equal(t, []int{2, 3, 4}, TailQueries(tr))
	assert.Equal(t, 95, DefaultPrefill(tr, []int{2, 3, 4}))
	assert.Equal(t, 40, DefaultPrefill(tr, []int{1, 4}))
	tr.QPos = []int32{50, 60}
	assert.Equal(t, []int{1}, TailQueries(tr))
	assert.Equal(t, 60, DefaultPrefill(tr, []int{1}))
}

// TestTacticEvaluateMatchesReferences checks the wiring against the
// references called directly: for one query, every head's figures equal
// sparse.TacticDecodeRef (over the centroids in 8 bits) followed by
// sparse.FidelityRef on the union and on the head's own selection, and the
// layer's traffic is the bytes of the 8-bit centroids, the fit's rows and
// the unions those references give.
func TestTacticEvaluateMatchesReferences(t *testing.T) {
	tr := smallLayer(t)
	opts := DefaultTacticOptions()
	qi := 3
	opts.Queries = []int{qi}
	ev, err := Tactic(tr, opts)
	require.NoError(t, err)
	prefill := tr.Tokens - tr.Queries()
	assert.Equal(t, prefill, ev.Options.Prefill)
	require.Len(t, ev.Kinds, tr.QHeads)
	assert.Equal(t, "streaming", ev.Kinds[0])

	d, group, pos := tr.HeadDim, tr.QHeads/tr.KVHeads, int(tr.QPos[qi])
	fixed, err := sparse.TacticFixedTokens(opts.Sinks, prefill, pos)
	require.NoError(t, err)
	row := float64(2 * d) // bytes of an fp16 row
	traffic := make([]StepTraffic, len(opts.P))
	for g := 0; g < tr.KVHeads; g++ {
		off := g * tr.Tokens * d
		keys := sparse.HalvesToFloat64(tr.K[off : off+(pos+1)*d])
		values := sparse.HalvesToFloat64(tr.V[off : off+(pos+1)*d])
		idx, err := sparse.BuildClusterIndexRef(keys, d, opts.Sinks, prefill-opts.Sinks, opts.AvgClusterSize, opts.KMeansIters, opts.Seed+uint64(g))
		require.NoError(t, err)
		// The selection scores the centroids in 8 bits.
		idx.Centroids, err = sparse.QuantizedCentroidsRef(idx.Centroids, d)
		require.NoError(t, err)
		qs := make([][]float64, group)
		for j := range qs {
			h := g*group + j
			for _, x := range tr.Query(qi)[h*d : (h+1)*d] {
				qs[j] = append(qs[j], float64(x))
			}
		}
		for pi, p := range opts.P {
			_, union, budgets, err := sparse.TacticDecodeRef(qs, keys, values, tr.Scale, idx, fixed, p, opts.Fit)
			require.NoError(t, err)
			traffic[pi].Centroids += float64(kvcache.CodedHeadBytes(idx.Clusters(), d))
			traffic[pi].Attended += float64(2*len(union)) * row
			traffic[pi].Dense += float64(2*(pos+1)) * row
			for j, q := range qs {
				sampled := len(fixed) + budgets[j].SampledTokens()
				traffic[pi].Sampled += float64(sampled) * row
				fu, err := sparse.FidelityRef(q, keys, values, tr.Scale, union, idx.Members, fixed, p)
				require.NoError(t, err)
				own := sparse.TacticSelectRef(idx, fixed, budgets[j])
				fo, err := sparse.FidelityRef(q, keys, values, tr.Scale, own, idx.Members, fixed, p)
				require.NoError(t, err)
				h := ev.Results[pi].Heads[g*group+j]
				require.Equal(t, 1, h.Cases)
				assert.Equal(t, g, h.KVHead)
				assert.Equal(t, fu.Mass, h.Mass)
				assert.Equal(t, fo.Mass, h.OwnMass)
				assert.Equal(t, float64(fu.Selected), h.Union)
				assert.Equal(t, float64(fo.Selected), h.Selected)
				assert.Equal(t, float64(fu.ClusterOptimal), h.ClusterOptimal)
				assert.Equal(t, float64(fu.GlobalOptimal), h.GlobalOptimal)
				assert.InDelta(t, fu.RelErr, h.RelErr, 1e-12)
				assert.Equal(t, fu.Success(p), h.SuccessRate == 1)
				assert.Equal(t, float64(sampled), h.Sampled)
			}
		}
	}
	for pi := range opts.P {
		got := ev.Results[pi].Traffic
		assert.Equal(t, traffic[pi], got)
		assert.Less(t, got.Total(), got.Dense, "P=%v: a step reads less than dense attention", opts.P[pi])
	}
}

// TestStepTrafficBounds checks the bound's arithmetic: dispatches × floor
// plus the batch's bytes at the bandwidth, against dense attention as one
// dispatch over its bytes.
func TestStepTrafficBounds(t *testing.T) {
	s := StepTraffic{Centroids: 3e6, Sampled: 11e6, Attended: 40e6, Dense: 500e6}
	assert.Equal(t, 54e6, s.Total())
	const bw, floor = 2.5e6, 3.0 // bytes per µs, µs
	assert.InDelta(t, 3*floor+54e6/bw, s.BoundUs(bw, floor, 3, 1), 1e-9)
	assert.InDelta(t, 3*floor+8*54e6/bw, s.BoundUs(bw, floor, 3, 8), 1e-9)
	assert.InDelta(t, (floor+500e6/bw)/(3*floor+54e6/bw), s.BoundSpeedup(bw, floor, 3, 1), 1e-12)
	// A batch pays the floors once: it can gain more than one sequence.
	assert.Greater(t, s.BoundSpeedup(bw, floor, 3, 8), s.BoundSpeedup(bw, floor, 3, 1))
	// Without floors the bound is the ratio of bytes, whatever the batch.
	assert.InDelta(t, 500.0/54, s.BoundSpeedup(bw, 0, 3, 8), 1e-12)
}

func TestTacticEvaluateAggregatesDeterministically(t *testing.T) {
	tr := smallLayer(t)
	opts := DefaultTacticOptions()
	opts.P = []float64{0.6, 1}
	opts.Workers = 1
	calls := 0
	opts.Progress = func(done, total int) {
		calls++
		assert.Equal(t, calls, done)
		assert.Equal(t, tr.KVHeads*(1+tr.Queries()), total)
	}
	one, err := Tactic(tr, opts)
	require.NoError(t, err)
	assert.Equal(t, tr.KVHeads*(1+tr.Queries()), calls)
	opts.Workers, opts.Progress = 5, nil
	many, err := Tactic(tr, opts)
	require.NoError(t, err)
	assert.Equal(t, one.Results, many.Results)
	assert.Equal(t, one.Kinds, many.Kinds)
	assert.Equal(t, []int{0, 1, 2, 3, 4}, one.Options.Queries)

	for _, r := range one.Results {
		require.Equal(t, tr.Queries()*tr.QHeads, r.Cases)
		require.Len(t, r.Heads, tr.QHeads)
		var success, mass float64
		for _, h := range r.Heads {
			assert.Equal(t, tr.Queries(), h.Cases)
			success += h.SuccessRate
			mass += h.Mass
		}
		assert.InDelta(t, r.SuccessRate, success/float64(tr.QHeads), 1e-12)
		assert.InDelta(t, r.Mass, mass/float64(tr.QHeads), 1e-12)
		assert.LessOrEqual(t, r.BoundWorst, 1.0)
		assert.LessOrEqual(t, r.MinMass, r.Mass)
		assert.InDelta(t, r.Selected/r.ClusterOptimal, r.SelectedOverClusterOptimal, 1e-15)
	}
	// P = 1 selects every token: full mass, dense output.
	all := one.Results[1]
	assert.Equal(t, 1.0, all.SuccessRate)
	assert.InDelta(t, 1, all.Mass, 1e-12)
	assert.Equal(t, all.Attended, all.Selected)
	assert.Less(t, all.MaxRelErr, 1e-12)
	assert.Equal(t, float64(tr.Tokens-2), all.Attended) // positions 1495 … 1499
}

func TestTacticEvaluateErrors(t *testing.T) {
	tr := smallLayer(t)
	cases := map[string]func(*TacticOptions){
		"no P":             func(o *TacticOptions) { o.P = []float64{} },
		"bad P":            func(o *TacticOptions) { o.P = []float64{0.5, 1.5} },
		"sinks":            func(o *TacticOptions) { o.Sinks = -1 },
		"sinks in prefill": func(o *TacticOptions) { o.Prefill, o.Sinks = 4, 4 },
		"prefill":          func(o *TacticOptions) { o.Prefill = tr.Tokens + 1 },
		"query in prefill": func(o *TacticOptions) { o.Prefill = tr.Tokens - 1 },
		"repeated query":   func(o *TacticOptions) { o.Queries = []int{4, 4} },
		"query range":      func(o *TacticOptions) { o.Queries = []int{5} },
		"no queries":       func(o *TacticOptions) { o.Queries = []int{} },
		"cluster size":     func(o *TacticOptions) { o.AvgClusterSize = 0 },
		"iterations":       func(o *TacticOptions) { o.KMeansIters = 0 },
		"fit":              func(o *TacticOptions) { o.Fit.Window2 = 2 },
	}
	for name, change := range cases {
		opts := DefaultTacticOptions()
		change(&opts)
		ev, err := Tactic(tr, opts)
		assert.Error(t, err, name)
		assert.Nil(t, ev, name)
	}
	_, err := Tactic(nil, DefaultTacticOptions())
	assert.Error(t, err)
	_, err = Tactic(tr, TacticOptions{})
	assert.Error(t, err, "zero options")
}
