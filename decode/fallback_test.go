package decode

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/vk/vktest"
)

// fallbackLayout is one layer of each policy that falls back.
func fallbackLayout(recluster int) []Policy {
	opts := sparse.TacticDecoderOptions{Sinks: 4, Recluster: recluster, KMeans: sparse.KMeansOptions{Seed: 3}}
	return []Policy{
		Tactic(0.9, opts),
		DoubleP(sparse.DefaultDoubleP(), opts),
		Quest(64).WithRecluster(recluster),
		StreamingLLM(64).WithRecluster(recluster),
		H2O(64).WithRecluster(recluster),
	}
}

var (
	// cheapFloor prices dispatches at nothing: the step reading fewer
	// bytes wins.
	cheapFloor = sparse.CostModel{FloorUs: 0, ReadGBps: 1}
	// dearFloor prices a dispatch far above any read here: the step of
	// fewer dispatches wins.
	dearFloor = sparse.CostModel{FloorUs: 1e6, ReadGBps: 1}
)

// poison fills the layer's output buffer with NaN, so that a sequence no
// kernel writes shows.
func poison(t *testing.T, m *Model, layer int) {
	t.Helper()
	b := m.layers[layer].out
	nan := make([]float32, b.Size()/4)
	for i := range nan {
		nan[i] = float32(math.NaN())
	}
	require.NoError(t, b.WriteFloat32(0, nan))
}

// attendAll attends every layer of m with query i of each active slot's
// sequence (outputs poisoned first), returning [layer][B·Hq·D].
func attendAll(t *testing.T, f *fixture, m *Model, i int) [][]float32 {
	t.Helper()
	var outs [][]float32
	for l := 0; l < m.cfg.Layers; l++ {
		if m.layers[l].out != nil {
			poison(t, m, l)
		}
		out, err := m.Attend(l, f.queries(m, l, i))
		require.NoError(t, err)
		outs = append(outs, out)
	}
	return outs
}

// requireBits requires a and b bit-identical.
func requireBits(t *testing.T, a, b []float32, what string, args ...any) {
	t.Helper()
	require.Len(t, b, len(a))
	for i := range a {
		if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
			require.Failf(t, "outputs differ", "%s: value %d: %v and %v", fmt.Sprintf(what, args...), i, a[i], b[i])
		}
	}
}

// checkDense requires slot i's output of the layer to be dense
// attention's: bit-identical to a dense plan's over the slot's cache (in
// cluster order under a clustered policy), close to the float64
// reference.
func checkDense(t *testing.T, f *fixture, m *Model, layer, i int, q, got []float32, what string) {
	t.Helper()
	h := f.h
	per := h.Query * h.Dim
	s := m.Active()[i]
	plan, err := m.dense.Plan([]*kvcache.Layer{m.slots[s].seq[layer].cache})
	require.NoError(t, err)
	want, err := plan.Attend(q[i*per : (i+1)*per])
	require.NoError(t, errors.Join(err, plan.Release()))
	requireBits(t, want, got[i*per:(i+1)*per], "%s: slot %d attended densely and by a dense plan", what, s)
	requireClose(t, subsetRef(t, h, f.data[s][layer], q[i*per:(i+1)*per], m.Len(s, layer), nil), got[i*per:(i+1)*per], h.Dim, 1e-3, what)
}

// TestFallbackChoosesByCost builds models of one layer per policy that
// falls back, two slots, under forced cost models and overrides, and
// checks each layer's choice per slot (Choices, Attended) and that a
// sequence attended densely gets dense attention's output.
func TestFallbackChoosesByCost(t *testing.T) {
	vktest.HostLogic(t)
	dev := vktest.Open(t)
	layout := fallbackLayout(64)
	layers := len(layout)
	prefill := []int{600, 1000}
	f := newFixture(t, testHeads, layers, []int{1100, 1100})
	newModel := func(cfg Config) *Model {
		cfg.Heads, cfg.Layers, cfg.Slots, cfg.Capacity = testHeads, layers, 2, 1100
		return f.prefilledModel(t, dev, cfg, prefill)
	}
	denseModel := newModel(Config{Policy: Dense()})
	attendAll(t, f, denseModel, 0)
	_, err := denseModel.Choices(0)
	require.Error(t, err, "a dense layer never falls back")

	perLayer := slices.Clone(layout)
	perLayer[2] = perLayer[2].WithFallback(FallbackNever)
	cheap, dear := cheapFloor, dearFloor
	for _, c := range []struct {
		name  string
		cfg   Config
		dense func(l int) bool // whether layer l attends densely
	}{
		{"cheap floor", Config{Layout: layout, Costs: &cheap}, func(int) bool { return false }},
		// StreamingLLM has no selection stage: one dispatch, as dense.
		{"dear floor", Config{Layout: layout, Costs: &dear}, func(l int) bool { return l != 3 }},
		{"always dense, cheap floor", Config{Layout: layout, Costs: &cheap, Fallback: FallbackAlways}, func(int) bool { return true }},
		{"never dense, dear floor", Config{Layout: layout, Costs: &dear, Fallback: FallbackNever}, func(int) bool { return false }},
		{"always dense but layer 2", Config{Layout: perLayer, Fallback: FallbackAlways}, func(l int) bool { return l != 2 }},
	} {
		t.Run(c.name, func(t *testing.T) {
			m := newModel(c.cfg)
			_, err := m.Choices(0)
			require.Error(t, err, "no choice before the first SetQuery")
			outs := attendAll(t, f, m, 0)
			for l := range layers {
				what := fmt.Sprintf("layer %d (%s)", l, layout[l])
				choices, err := m.Choices(l)
				require.NoError(t, err)
				attended, err := m.Attended(l)
				require.NoError(t, err)
				require.Len(t, choices, len(prefill))
				for i, ch := range choices {
					require.Equal(t, i, ch.Slot)
					require.Equal(t, prefill[i], ch.Tokens)
					require.Equal(t, c.dense(l), ch.Dense, "%s slot %d: %+v", what, i, ch)
					require.Equal(t, testHeads.DenseCost(ch.Tokens), ch.DenseCost)
					if ch.Fallback == FallbackAuto {
						require.Equal(t, ch.Dense, ch.PolicyUs > ch.DenseUs, "%s slot %d: the cheaper one is chosen", what, i)
					}
					if ch.Dense {
						require.Equal(t, float64(prefill[i]), attended[i], what)
						checkDense(t, f, m, l, i, f.queries(m, l, 0), outs[l], what)
					} else {
						require.Less(t, attended[i], float64(prefill[i]), "%s slot %d: the policy reads fewer rows", what, i)
						require.False(t, slices.ContainsFunc(outs[l], func(x float32) bool { return math.IsNaN(float64(x)) }), what)
					}
				}
			}
		})
	}
}

// TestFallbackCostMatchesSteps compares Policy.Cost's estimate with the
// cost its step counts after running (sparse.Step.Cost): the same
// dispatches, and the same bytes within what the estimate cannot know
// (whole bins past Quest's pages, Tactic's fit rows the step does not
// count).
func TestFallbackCostMatchesSteps(t *testing.T) {
	dev := vktest.Open(t)
	layout := fallbackLayout(64)
	f := newFixture(t, testHeads, len(layout), []int{1000})
	m, err := New(dev, Config{Heads: testHeads, Layers: len(layout), Slots: 1, Capacity: 1000, Layout: layout, Fallback: FallbackNever})
	require.NoError(t, err)
	defer func() { require.NoError(t, m.Release()) }()
	f.prefill(t, m, 0, 900)
	attendAll(t, f, m, 0)
	for l, pol := range layout {
		step := m.layers[l].step(0)
		got, err := step.Cost()
		require.NoError(t, err)
		share, err := step.IndexedShare()
		require.NoError(t, err)
		sl := &m.slots[0].seq[l]
		indexed, clusters := 0, 0
		if sl.clusters != nil {
			indexed, clusters = sl.clusters.Count, sl.clusters.C
		}
		want, err := pol.Cost(testHeads, 900, indexed, clusters, share)
		require.NoError(t, err)
		require.Equal(t, len(step.Stages()), want.Dispatches, "%s", pol)
		require.Equal(t, got.Dispatches, want.Dispatches, "%s", pol)
		require.Equal(t, 900, got.Tokens, "%s: the step's context", pol)
		require.Equal(t, got.Tokens, want.Tokens, "%s", pol)
		switch {
		case pol.IsTactic():
			// The step counts its centroids, not its fit's rows.
			require.Greater(t, want.Bytes, got.Bytes, "%s", pol)
			require.InDelta(t, got.Bytes, want.Bytes, float64(2*testHeads.Dim*testHeads.Query)*pol.opts.Fit.SampledRows(sl.clusters.Count, sl.clusters.C)+1, "%s", pol)
		default:
			require.InEpsilon(t, want.Bytes, got.Bytes, 1e-9, "%s", pol)
		}
	}
	// The next choice counts the share the step took.
	shares := make([]float64, len(layout))
	for l := range layout {
		shares[l], err = m.layers[l].step(0).IndexedShare()
		require.NoError(t, err)
	}
	attendAll(t, f, m, 1)
	for l, pol := range layout {
		choices, err := m.Choices(l)
		require.NoError(t, err)
		require.Equal(t, shares[l], choices[0].Share, "%s", pol)
		if pol.kind != kindStreaming { // its kept tokens lie outside its index
			require.Positive(t, choices[0].Share, "%s", pol)
		}
	}
	_, err = Dense().Cost(testHeads, 900, 0, 0, 0)
	require.Error(t, err)
	_, err = layout[0].Cost(testHeads, 900, 901, 10, 0)
	require.Error(t, err, "more indexed tokens than tokens")
}

// TestFallbackSwitchesKeepOutputs switches every layer of a model between
// dense attention and its policy from step to step (SetFallback:
// FallbackAlways, FallbackNever, FallbackAuto under a cheap floor), with
// appends crossing reclustering boundaries, beside a twin that always
// runs the policy. A sequence attended densely gets dense attention's
// output; under a clustered policy the outputs are bit-identical to the
// twin's (its batch, built again at every switch, attends as the twin's);
// under a positional one, whose index (and H2O's accumulated attention)
// is made with the batch, the first step after a switch is bit-identical
// to that of a new model holding the same tokens.
func TestFallbackSwitchesKeepOutputs(t *testing.T) {
	vktest.HostLogic(t)
	dev := vktest.Open(t)
	const recluster = 8
	layout := fallbackLayout(recluster)
	layers := len(layout)
	prefill := []int{300, 420}
	f := newFixture(t, testHeads, layers, []int{500, 500})
	cheap := cheapFloor
	var models []*Model
	for _, fb := range []Fallback{FallbackAlways, FallbackNever} {
		models = append(models, f.prefilledModel(t, dev, Config{Heads: testHeads, Layers: layers, Slots: 2, Capacity: 500, Layout: layout, Fallback: fb, Costs: &cheap}, prefill))
	}
	m, twin := models[0], models[1]
	per := testHeads.Query * testHeads.Dim
	schedule := []Fallback{FallbackAlways, FallbackNever, FallbackAlways, FallbackAuto, FallbackAuto, FallbackAlways,
		FallbackNever, FallbackNever, FallbackAlways, FallbackAuto, FallbackNever, FallbackAlways}
	for step, mode := range schedule {
		if step > 0 {
			for s := range prefill {
				f.appendAll(t, m, s, 1)
				f.appendAll(t, twin, s, 1)
			}
		}
		for l := range layout {
			require.NoError(t, m.SetFallback(l, mode))
		}
		outs, twinOuts := attendAll(t, f, m, step%2), attendAll(t, f, twin, step%2)
		for l, pol := range layout {
			what := fmt.Sprintf("step %d (%s) layer %d (%s)", step, mode, l, pol)
			choices, err := m.Choices(l)
			require.NoError(t, err)
			q := f.queries(m, l, step%2)
			for i, ch := range choices {
				if mode == FallbackAuto {
					// With no floor the choice is by bytes alone: a step
					// taking most of its index reads more than dense.
					require.Equal(t, ch.PolicyUs > ch.DenseUs, ch.Dense, "%s: %+v", what, ch)
				} else {
					require.Equal(t, mode == FallbackAlways, ch.Dense, what)
				}
				got := outs[l][i*per : (i+1)*per]
				switch {
				case ch.Dense:
					checkDense(t, f, m, l, i, q, outs[l], what)
				case pol.Clustered():
					requireBits(t, twinOuts[l][i*per:(i+1)*per], got, "%s slot %d: switched and never switched", what, i)
				case schedule[step-1] == FallbackAlways && pol.kind == kindH2O:
					// H2O's first step reads what earlier steps of the
					// workspace left in its scratch, to the last bit.
					want := freshOutputs(t, f, m, l, step%2)[i*per : (i+1)*per]
					requireClose(t, float64s(want), got, testHeads.Dim, 1e-5, what)
				case schedule[step-1] == FallbackAlways:
					requireBits(t, freshOutputs(t, f, m, l, step%2)[i*per:(i+1)*per], got, "%s slot %d: switched and new", what, i)
				}
			}
		}
	}
}

// freshOutputs returns the layer's output of a new model of m's layout,
// never falling back, whose slots hold the tokens m's slots hold, for
// query i, its layers attended in order up to that one (they share its
// workspace).
func freshOutputs(t *testing.T, f *fixture, m *Model, layer, i int) []float32 {
	t.Helper()
	cfg := m.Config()
	cfg.Fallback = FallbackNever
	fresh, err := New(m.dev, cfg)
	require.NoError(t, err)
	defer func() { require.NoError(t, fresh.Release()) }()
	for _, s := range m.Active() {
		for l := range cfg.Layers {
			n := m.Len(s, l)
			k, v := f.data[s][l].rows(0, n)
			require.NoError(t, fresh.Prefill(s, l, k, v, n))
		}
	}
	var out []float32
	for l := 0; l <= layer; l++ {
		out, err = fresh.Attend(l, f.queries(fresh, l, i))
		require.NoError(t, err)
	}
	return out
}

// TestBatchInvarianceAcrossFallback is TestBatchInvariance with every
// layer switched between dense attention and its policy from step to step
// (the same switches in every run), for each policy that falls back; and,
// for the clustered ones, with the batched runs' batches built again at
// some steps where the lone run's are not, as a batch-mate's change of
// choice under FallbackAuto does.
func TestBatchInvarianceAcrossFallback(t *testing.T) {
	dev := vktest.Open(t)
	cheap := cheapFloor
	schedule := []Fallback{FallbackNever, FallbackAlways, FallbackAuto, FallbackAlways, FallbackNever, FallbackNever,
		FallbackAlways, FallbackAuto, FallbackAuto, FallbackNever}
	for _, p := range faultPolicies(t) {
		if !p.layout[0].FallsBack() {
			continue
		}
		t.Run(p.name, func(t *testing.T) {
			layers := len(p.layout)
			f := newFixture(t, faultHeads, layers, []int{faultCapacity, faultCapacity, faultCapacity})
			runs := placedRuns(t, dev, f, Config{Heads: faultHeads, Layers: layers, Slots: 3, Capacity: faultCapacity, Layout: p.layout, Costs: &cheap})
			for step, mode := range schedule {
				if step > 0 {
					for _, r := range runs {
						r.appendAll(t)
					}
				}
				for i, r := range runs {
					for l := range layers {
						require.NoError(t, r.m.SetFallback(l, mode))
						if i > 0 && step%3 == 2 && p.layout[l].Clustered() {
							require.NoError(t, r.m.releaseLayer(l))
						}
					}
				}
				var outs []map[int][][]uint32
				for _, r := range runs {
					outs = append(outs, r.attend(t, step%2))
				}
				for l := 0; l < layers; l++ {
					what := fmt.Sprintf("step %d (%s) layer %d (%s)", step, mode, l, p.layout[l])
					require.True(t, slices.Equal(outs[0][2][l], outs[1][2][l]), "%s: sequence 2 alone in slot 0 and batched in slot 2 differ", what)
					for seq := range 3 {
						require.True(t, slices.Equal(outs[1][seq][l], outs[2][seq][l]), "%s: sequence %d differs between two runs of the same batch", what, seq)
					}
				}
			}
		})
	}
}

func float64s(x []float32) []float64 {
	out := make([]float64, len(x))
	for i, v := range x {
		out[i] = float64(v)
	}
	return out
}

// TestFallbackMixedBatch prices dispatches so that, under each policy
// with more dispatches than dense attention, the shorter of two slots is
// attended densely and the longer by the policy, in one layer's batch: the
// dense one gets dense attention's output, the other the output a model
// that never falls back gives it (batch invariance); then, over appends,
// every choice stays the cheaper one and every dense one dense attention.
func TestFallbackMixedBatch(t *testing.T) {
	dev := vktest.Open(t)
	prefill := []int{600, 1000}
	per := testHeads.Query * testHeads.Dim
	for _, pol := range fallbackLayout(64) {
		if pol.kind == kindStreaming {
			continue // one dispatch, as dense attention: the floor cannot tip it
		}
		t.Run(pol.String(), func(t *testing.T) {
			f := newFixture(t, testHeads, 1, []int{1100, 1100})
			var models []*Model
			for _, fb := range []Fallback{FallbackAuto, FallbackNever} {
				// The cost model is set below, once the indexes are known.
				costs := cheapFloor
				models = append(models, f.prefilledModel(t, dev, Config{Heads: testHeads, Layers: 1, Slots: 2, Capacity: 1100, Policy: pol, Fallback: fb, Costs: &costs}, prefill))
			}
			m, twin := models[0], models[1]
			// The floor at which a slot's policy step and dense attention
			// cost the same, at 1 GB/s: the extra dispatches pay for the
			// bytes saved.
			tie := func(s int) float64 {
				sl := &m.slots[s].seq[0]
				indexed, clusters := 0, 0
				if sl.clusters != nil {
					indexed, clusters = sl.clusters.Count, sl.clusters.C
				}
				c, err := pol.Cost(testHeads, prefill[s], indexed, clusters, 0)
				require.NoError(t, err)
				saved := testHeads.DenseCost(prefill[s]).Bytes - c.Bytes
				require.Positive(t, saved)
				return saved / 1e3 / float64(c.Dispatches-1)
			}
			short, long := tie(0), tie(1)
			require.Less(t, short, long, "the longer sequence saves more")
			*m.costs = sparse.CostModel{FloorUs: (short + long) / 2, ReadGBps: 1}
			q := f.queries(m, 0, 0)
			poison(t, m, 0)
			out, err := m.Attend(0, q)
			require.NoError(t, err)
			twinOut, err := twin.Attend(0, q)
			require.NoError(t, err)
			choices, err := m.Choices(0)
			require.NoError(t, err)
			require.True(t, choices[0].Dense, "the short slot: %+v", choices[0])
			require.False(t, choices[1].Dense, "the long slot: %+v", choices[1])
			checkDense(t, f, m, 0, 0, q, out, "the short slot")
			if pol.kind == kindH2O {
				// H2O's first step differs in the last bit between a batch
				// of one and of two, with or without a fallback.
				requireClose(t, float64s(twinOut[per:]), out[per:], testHeads.Dim, 1e-5, "the long slot")
			} else {
				requireBits(t, twinOut[per:], out[per:], "the long slot, by the policy beside a dense slot and in a model that never falls back")
			}
			for step := 1; step <= 4; step++ {
				for s := range prefill {
					f.appendAll(t, m, s, 1)
				}
				q := f.queries(m, 0, step%2)
				poison(t, m, 0)
				out, err := m.Attend(0, q)
				require.NoError(t, err)
				choices, err := m.Choices(0)
				require.NoError(t, err)
				for i, c := range choices {
					require.Equal(t, c.PolicyUs > c.DenseUs, c.Dense, "step %d slot %d: %+v", step, i, c)
					if c.Dense {
						checkDense(t, f, m, 0, i, q, out, fmt.Sprintf("step %d", step))
					}
				}
				require.False(t, slices.ContainsFunc(out, func(x float32) bool { return math.IsNaN(float64(x)) }), "step %d: a slot unwritten", step)
			}
		})
	}
}

// prefilledModel returns a model of cfg (released when the test ends)
// whose slot s holds the fixture's sequence s prefilled with prefill[s]
// tokens.
func (f *fixture) prefilledModel(t *testing.T, dev *vk.Device, cfg Config, prefill []int) *Model {
	t.Helper()
	m, err := New(dev, cfg)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, m.Release()) })
	for s, n := range prefill {
		f.prefill(t, m, s, n)
	}
	return m
}
