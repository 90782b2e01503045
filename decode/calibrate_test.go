package decode

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/vk/vktest"
	"github.com/x448/float16"
)

// TestMeasureSteps measures a clustered and a positional policy's steps
// beside dense attention at two short lengths and checks what comes
// back: one point per length with the costs the library counts and
// positive times, models that price each run's larger read at its time,
// the same result from the cache, dense attention timed at the model's
// own lengths where a budget moves the policy's runs beyond them, and
// refused input.
func TestMeasureSteps(t *testing.T) {
	vktest.HostLogic(t)
	dev := vktest.Open(t)
	h := testHeads
	lengths := [2]int{512, 2048}
	opts := sparse.TacticDecoderOptions{Sinks: 4, KMeans: sparse.KMeansOptions{Seed: 5}}
	for _, p := range []Policy{Tactic(0.9, opts), StreamingLLM(64)} {
		sc, err := MeasureSteps(dev, h, p, lengths, 1, cheapFloor)
		require.NoError(t, err, "%s", p)
		require.Len(t, sc.Points, 2)
		for i, pt := range sc.Points {
			require.Equal(t, lengths[i], pt.Tokens)
			require.Equal(t, h.DenseCost(pt.Tokens), pt.DenseCost)
			require.Positive(t, pt.PolicyUs, "%s", p)
			require.Positive(t, pt.DenseUs, "%s", p)
			require.Positive(t, pt.PolicyCost.Bytes, "%s", p)
		}
		require.Equal(t, sc.Points[0].PolicyCost.Dispatches, sc.Points[1].PolicyCost.Dispatches)
		a, b := sc.Points[0], sc.Points[1]
		require.Equal(t, a.Tokens, a.PolicyCost.Tokens)
		require.Equal(t, b.Tokens, b.PolicyCost.Tokens)
		require.InEpsilon(t, b.PolicyUs, sc.Policy.Us(b.PolicyCost), 1e-9, "%s: the policy's model prices its longer run at its time", p)
		require.InEpsilon(t, b.DenseUs, sc.Dense.Us(b.DenseCost), 1e-9, "dense attention's model prices its longer run at its time")
		require.Nil(t, sc.DensePoints, "%s: dense attention timed beside the step at the same lengths", p)
		again, err := MeasureSteps(dev, h, p, lengths, 1, cheapFloor)
		require.NoError(t, err)
		require.Equal(t, sc, again, "%s: measured once per process", p)
	}

	// A budget of 1 024 tokens (more than the shorter length holds) moves
	// the policy's runs to 2 048 and 4 096 tokens; dense attention is
	// timed alone at 512 and 2 048 and priced by those runs.
	sc, err := MeasureSteps(dev, h, StreamingLLM(1024), lengths, 1, cheapFloor)
	require.NoError(t, err)
	require.Equal(t, []int{2048, 4096}, []int{sc.Points[0].Tokens, sc.Points[1].Tokens})
	require.Len(t, sc.DensePoints, 2)
	for i, pt := range sc.DensePoints {
		require.Equal(t, lengths[i], pt.Tokens)
		require.Equal(t, h.DenseCost(pt.Tokens), pt.DenseCost)
		require.Positive(t, pt.DenseUs)
		require.Zero(t, pt.PolicyUs, "dense attention alone")
		require.Zero(t, pt.PolicyCost, "dense attention alone")
	}
	b := sc.DensePoints[1]
	require.InEpsilon(t, b.DenseUs, sc.Dense.Us(b.DenseCost), 1e-9, "dense attention priced by its run at the model's capacity")
	require.InEpsilon(t, sc.Points[1].PolicyUs, sc.Policy.Us(sc.Points[1].PolicyCost), 1e-9, "the policy priced by its own runs")
	// A batch of 3: measured apart from one sequence, the costs a
	// sequence's.
	alone, err := MeasureSteps(dev, h, StreamingLLM(64), lengths, 1, cheapFloor)
	require.NoError(t, err)
	three, err := MeasureSteps(dev, h, StreamingLLM(64), lengths, 3, cheapFloor)
	require.NoError(t, err)
	require.NotEqual(t, alone, three, "cached per batch")
	for i, pt := range three.Points {
		require.Equal(t, alone.Points[i].PolicyCost, pt.PolicyCost, "the costs are a sequence's")
	}
	// Each time is the batch's over 3. One sequence and the batch are
	// timed in turn, five times, at the shorter length (the division
	// does not depend on it), and the fastest of each compared, so that
	// load from other processes falls on both (on a CPU renderer beside
	// other test packages, three rounds once left every batch's run
	// three times slower).
	best := map[int]*StepPoint{1: {PolicyUs: math.Inf(1), DenseUs: math.Inf(1)}, 3: {PolicyUs: math.Inf(1), DenseUs: math.Inf(1)}}
	for range 5 {
		for _, batch := range []int{1, 3} {
			pt, err := measureStep(dev, h, StreamingLLM(64), lengths[0], batch, 1, true, true)
			require.NoError(t, err)
			best[batch].PolicyUs = min(best[batch].PolicyUs, pt.PolicyUs)
			best[batch].DenseUs = min(best[batch].DenseUs, pt.DenseUs)
		}
	}
	t.Logf("a sequence alone %.1f µs (dense %.1f), in a batch of 3 %.1f µs (dense %.1f)", best[1].PolicyUs, best[1].DenseUs, best[3].PolicyUs, best[3].DenseUs)
	require.Less(t, best[3].PolicyUs, 2*best[1].PolicyUs, "a sequence's part of the batch's time, not the batch's")
	require.Less(t, best[3].DenseUs, 2*best[1].DenseUs, "a sequence's part of the batch's time, not the batch's")
	_, err = MeasureSteps(dev, h, StreamingLLM(64), lengths, 0, cheapFloor)
	require.Error(t, err, "a batch of none")
	_, err = MeasureSteps(dev, h, Dense(), lengths, 1, cheapFloor)
	require.Error(t, err, "dense attention never falls back")
	_, err = MeasureSteps(dev, h, StreamingLLM(64), [2]int{2048, 512}, 1, cheapFloor)
	require.Error(t, err, "decreasing lengths")
	_, err = MeasureSteps(dev, h, StreamingLLM(64), lengths, 1, sparse.CostModel{})
	require.Error(t, err, "an invalid fallback model")
}

// TestModelMeasuresSteps checks when a model measures its layers' steps
// (Config.Measure, the capacity, the fallback) and that its choices are
// priced by what it measured.
func TestModelMeasuresSteps(t *testing.T) {
	vktest.HostLogic(t)
	dev := vktest.Open(t)
	opts := sparse.TacticDecoderOptions{Sinks: 4, KMeans: sparse.KMeansOptions{Seed: 5}}
	layout := []Policy{Tactic(0.9, opts), Quest(64), Quest(64).WithFallback(FallbackNever), Dense()}
	f := newFixture(t, testHeads, len(layout), []int{2048})
	cheap := cheapFloor
	cfg := Config{Heads: testHeads, Layers: len(layout), Slots: 1, Capacity: 2048, Layout: layout, Costs: &cheap, Measure: MeasureAlways}
	m := f.prefilledModel(t, dev, cfg, []int{1500})
	attendAll(t, f, m, 0)
	for l := range layout {
		sc, ok := m.StepCosts(l)
		require.Equal(t, l < 2, ok, "layer %d (%s): measured only under FallbackAuto", l, layout[l])
		if !ok {
			continue
		}
		require.Len(t, sc.Points, 2)
		choices, err := m.Choices(l)
		require.NoError(t, err)
		for _, ch := range choices {
			require.True(t, ch.Measured)
			require.Equal(t, sc.Policy.Us(ch.PolicyCost), ch.PolicyUs)
			require.Equal(t, sc.Dense.Us(ch.DenseCost), ch.DenseUs)
			require.Equal(t, ch.PolicyUs > ch.DenseUs, ch.Dense, "layer %d: the cheaper one is chosen", l)
		}
	}
	_, ok := m.StepCosts(len(layout))
	require.False(t, ok, "no such layer")

	// Under FallbackNever nothing is measured until a layer turns to
	// FallbackAuto.
	cfg.Fallback = FallbackNever
	m = f.prefilledModel(t, dev, cfg, []int{1500})
	_, ok = m.StepCosts(1)
	require.False(t, ok)
	require.NoError(t, m.SetFallback(1, FallbackAuto))
	_, ok = m.StepCosts(1)
	require.True(t, ok)

	// Below MinMeasureTokens, and by default on a CPU device or with
	// Costs given, the device's model prices both.
	f = newFixture(t, testHeads, 1, []int{2048})
	small := Config{Heads: testHeads, Layers: 1, Slots: 1, Capacity: MinMeasureTokens - 1, Policy: Quest(64), Costs: &cheap, Measure: MeasureAlways}
	m = f.prefilledModel(t, dev, small, []int{1500})
	_, ok = m.StepCosts(0)
	require.False(t, ok)
	byDefault := Config{Heads: testHeads, Layers: 1, Slots: 1, Capacity: 2048, Policy: Quest(64)}
	m = f.prefilledModel(t, dev, byDefault, []int{1500})
	_, ok = m.StepCosts(0)
	require.Equal(t, dev.Info().Type != "cpu", ok, "measured by default on a GPU only")
	byDefault.Costs = &cheap
	m = f.prefilledModel(t, dev, byDefault, []int{1500})
	_, ok = m.StepCosts(0)
	require.False(t, ok, "given costs price both")

	_, err := New(dev, Config{Heads: testHeads, Layers: 1, Slots: 1, Capacity: 2048, Policy: Quest(64), Measure: Measure(7)})
	require.Error(t, err, "an unknown measure")
}

// TestPriceBatch checks that Config.PriceBatch prices a sequence's
// choice as its part of a batch's step: with a floor that makes a Quest
// layer's extra dispatches cost more than the bytes they save for one
// sequence, the sequence is attended densely alone and by the policy when
// priced for a batch of 4, whose sequences share each dispatch; and that
// a batch beyond the slots is refused.
func TestPriceBatch(t *testing.T) {
	dev := vktest.Open(t)
	f := newFixture(t, testHeads, 1, []int{2048})
	cheap := cheapFloor
	cfg := Config{Heads: testHeads, Layers: 1, Slots: 4, Capacity: 2048, Policy: Quest(64), Costs: &cheap, Measure: MeasureNever}
	m := f.prefilledModel(t, dev, cfg, []int{1500})
	attendAll(t, f, m, 0) // chosen at its SetQuery, by the budget (no share yet)
	choices, err := m.Choices(0)
	require.NoError(t, err)
	c := choices[0]
	saved := c.DenseCost.Bytes - c.PolicyCost.Bytes
	extra := c.PolicyCost.Dispatches - c.DenseCost.Dispatches
	require.Positive(t, saved)
	require.Positive(t, extra)
	// extra floors cost 1.5 times the saved bytes alone, 0.375 times in 4.
	costs := sparse.CostModel{ReadGBps: 1, FloorUs: 1.5 * saved / 1e3 / float64(extra)}
	for _, batch := range []int{0, 1, 4} {
		cfg.Costs, cfg.PriceBatch = &costs, batch
		m := f.prefilledModel(t, dev, cfg, []int{1500})
		attendAll(t, f, m, 0)
		choices, err := m.Choices(0)
		require.NoError(t, err)
		c := choices[0]
		per := costs.PerSequence(batch)
		require.InEpsilon(t, per.Us(c.PolicyCost), c.PolicyUs, 1e-12)
		require.InEpsilon(t, per.Us(c.DenseCost), c.DenseUs, 1e-12)
		require.Equal(t, batch < 4, c.Dense, "a batch of %d", batch)
	}
	cfg.PriceBatch = 5
	_, err = New(dev, cfg)
	require.Error(t, err, "a batch beyond the slots")
	cfg.PriceBatch = -1
	_, err = New(dev, cfg)
	require.Error(t, err)
}

// TestTopicKeys checks the keys MeasureSteps times over: 90 % of a query
// head's attention (softmax of scale·q·k, float64) lies on less than a
// quarter of the tokens on average (a few percent, mostly; flat attention
// would take 90 %), on more than a handful and less than half for every
// head.
func TestTopicKeys(t *testing.T) {
	for _, c := range []struct {
		h sparse.Heads
		n int
	}{{sparse.Heads{Query: 8, KV: 2, Dim: 64}, 4096}, {sparse.Heads{Query: 32, KV: 8, Dim: 128}, 8192}} {
		rng := rand.New(rand.NewPCG(3, 4))
		k, q := topicKeys(rng, c.h, c.n)
		require.Len(t, k, c.h.KV*c.n*c.h.Dim)
		require.Len(t, q, c.h.Query*c.h.Dim)
		mean := 0.0
		for hq := range c.h.Query {
			g := hq / c.h.Group()
			logits := make([]float64, c.n)
			for u := range c.n {
				dot := 0.0
				for d := range c.h.Dim {
					dot += float64(q[hq*c.h.Dim+d]) * float64(float16.Frombits(k[(g*c.n+u)*c.h.Dim+d]).Float32())
				}
				logits[u] = dot * c.h.Scale()
			}
			// The fewest tokens holding 90 % of the mass.
			m := slices.Max(logits)
			w := make([]float64, c.n)
			sum := 0.0
			for u, l := range logits {
				w[u] = math.Exp(l - m)
				sum += w[u]
			}
			slices.Sort(w)
			slices.Reverse(w)
			acc, top := 0.0, 0
			for acc < 0.9*sum {
				acc += w[top]
				top++
			}
			share := float64(top) / float64(c.n)
			if hq == 0 {
				t.Logf("%+v, %d tokens: 90 %% of head 0's attention on %.1f %% of the tokens", c.h, c.n, 100*share)
			}
			require.Less(t, share, 0.5, "%+v head %d: 90 %% of the attention takes %.1f %% of the tokens", c.h, hq, 100*share)
			require.Greater(t, share, 0.001, "%+v head %d: attention on a handful of tokens", c.h, hq)
			mean += share / float64(c.h.Query)
		}
		require.Less(t, mean, 0.25, "%+v: 90 %% of the attention takes %.1f %% of the tokens on average", c.h, 100*mean)
	}
}
