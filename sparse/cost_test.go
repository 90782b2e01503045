package sparse

import (
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/vk/vktest"
)

func TestCostModelArithmetic(t *testing.T) {
	m := CostModel{FloorUs: 4, ReadGBps: 2000}
	// 3 dispatches of 4 µs, and 10⁶ bytes at 2000 GB/s: 2·10⁶ bytes a µs.
	require.InDelta(t, 3*4+1e6/2e6, m.Us(Cost{Dispatches: 3, Bytes: 1e6}), 1e-12)
	require.Zero(t, m.Us(Cost{}))
	h := Heads{Query: 8, KV: 2, Dim: 64}
	// Dense: one dispatch, K and V of 2 KV heads × n rows of 64 fp16.
	d := h.DenseCost(1000)
	require.Equal(t, 1, d.Dispatches)
	require.InDelta(t, 2*2*1000*64*2, d.Bytes, 0)
	require.InDelta(t, d.Bytes, h.AttentionBytes(1000), 0)
	// Centroids: C rows of 8-bit codes and a float32 scale, and a float32
	// scale per dimension, per KV head, and a float32 score per query head.
	require.InDelta(t, 2*(50*(64+4)+4*64)+4*8*50, CentroidBytes(h, 50), 0)
	for _, bad := range []CostModel{{-1, 1, 0}, {1, 0, 0}, {1, -3, 0}, {math.NaN(), 1, 0}, {1, math.NaN(), 0}, {math.Inf(1), 1, 0}, {1, math.Inf(1), 0},
		{1, 1, -1}, {1, 1, math.NaN()}, {1, 1, math.Inf(1)}} {
		require.Error(t, bad.Validate(), "%+v", bad)
	}
	require.NoError(t, CostModel{0, 1, 0}.Validate())
	// A cost per token: 2 000 tokens at 5 ns add 10 µs.
	withTokens := CostModel{FloorUs: 4, ReadGBps: 2000, TokenNs: 5}
	require.InDelta(t, 3*4+10+1e6/2e6, withTokens.Us(Cost{Dispatches: 3, Bytes: 1e6, Tokens: 2000}), 1e-12)
	require.Equal(t, 1000, h.DenseCost(1000).Tokens)
}

// TestFitCostModel checks the fit through two timed steps on random
// costs, the bandwidth the fallback's: it recovers the floor and the cost
// per token and prices both points where the longer context is left with
// more than the bytes explain, whatever the two reads (a share that
// shrinks with the length reads less at the longer one); where it cannot,
// it prices the longer one exactly (equal contexts, the longer left with
// less, a floor that would be negative, a time shorter than its bytes);
// the points' order does not matter; and it refuses what no model fits.
func TestFitCostModel(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 11))
	fallback := CostModel{FloorUs: 2, ReadGBps: 3000}
	for range 200 {
		d := 1 + rng.IntN(4)
		truth := CostModel{FloorUs: 0.5 + 10*rng.Float64(), ReadGBps: fallback.ReadGBps, TokenNs: 2 * rng.Float64()}
		a := Cost{Dispatches: d, Bytes: 1e5 + 1e8*rng.Float64(), Tokens: 512 + rng.IntN(8192)}
		b := Cost{Dispatches: d, Bytes: 1e5 + 1e8*rng.Float64(), Tokens: a.Tokens * (2 + rng.IntN(8))}
		m, err := FitCostModel(b, truth.Us(b), a, truth.Us(a), fallback)
		require.NoError(t, err)
		require.InDelta(t, truth.FloorUs, m.FloorUs, 1e-6*truth.Us(b))
		require.InDelta(t, truth.TokenNs, m.TokenNs, 1e-6*(1+truth.TokenNs))
		require.Equal(t, fallback.ReadGBps, m.ReadGBps)
		require.InEpsilon(t, truth.Us(a), m.Us(a), 1e-9)
		require.InEpsilon(t, truth.Us(b), m.Us(b), 1e-9)
		swapped, err := FitCostModel(a, truth.Us(a), b, truth.Us(b), fallback)
		require.NoError(t, err)
		require.Equal(t, m, swapped, "the points' order")
		// Cases where only the longer context is priced exactly.
		same := Cost{Dispatches: d, Bytes: a.Bytes * 2, Tokens: a.Tokens}
		less := truth.Us(a) - 0.5*(truth.Us(a)-a.Bytes/(fallback.ReadGBps*1e3))
		for _, c := range []struct {
			what   string
			x, y   Cost
			xUs    float64
			yUs    float64
			tokens bool // TokenNs may be positive
		}{
			{"equal contexts", a, same, truth.Us(a), truth.Us(same) + 50, false},
			{"the longer left with less", Cost{Dispatches: d, Bytes: a.Bytes, Tokens: a.Tokens}, Cost{Dispatches: d, Bytes: a.Bytes, Tokens: b.Tokens}, truth.Us(a), less, false},
			{"a negative floor", Cost{Dispatches: d, Bytes: a.Bytes, Tokens: b.Tokens / 2}, Cost{Dispatches: d, Bytes: a.Bytes, Tokens: b.Tokens}, a.Bytes/(fallback.ReadGBps*1e3) + 1e-3, a.Bytes/(fallback.ReadGBps*1e3) + 100, true},
			{"faster than its bytes", a, b, truth.Us(a), 0.5 * b.Bytes / (fallback.ReadGBps * 1e3), false},
		} {
			m, err := FitCostModel(c.x, c.xUs, c.y, c.yUs, fallback)
			require.NoError(t, err, c.what)
			require.InEpsilon(t, c.yUs, m.Us(c.y), 1e-9, c.what)
			require.GreaterOrEqual(t, m.FloorUs, 0.0, c.what)
			if !c.tokens {
				require.Zero(t, m.TokenNs, c.what)
			} else {
				require.Zero(t, m.FloorUs, c.what)
			}
		}
	}
	one := Cost{Dispatches: 1, Bytes: 1e6, Tokens: 1000}
	for _, bad := range [][2]Cost{{one, {Dispatches: 2, Bytes: 2e6, Tokens: 2000}}, {{}, {}}, {{Dispatches: 1, Tokens: -1}, one}, {{Dispatches: 1, Bytes: math.NaN()}, one}} {
		_, err := FitCostModel(bad[0], 1, bad[1], 2, fallback)
		require.Error(t, err, "%v", bad)
	}
	for _, us := range []float64{0, -1, math.NaN(), math.Inf(1)} {
		_, err := FitCostModel(one, us, Cost{Dispatches: 1, Bytes: 2e6, Tokens: 2000}, 2, fallback)
		require.Error(t, err, "%v µs", us)
	}
	_, err := FitCostModel(one, 1, Cost{Dispatches: 1, Bytes: 2e6, Tokens: 2000}, 2, CostModel{})
	require.Error(t, err, "an invalid fallback")
}

// TestCostCrossover checks the shape the dense fallback relies on: with a
// floor, a step of more dispatches that reads a shrinking share of dense
// attention's bytes loses to dense attention below some length and wins
// above it, and a dearer floor moves that length up.
func TestCostCrossover(t *testing.T) {
	h := Heads{Query: 8, KV: 2, Dim: 64}
	fit := TacticCurveFit()
	crossover := func(m CostModel) int {
		for n := 64; n <= 1<<22; n *= 2 {
			c := n / 16 // clusters of 16
			step := h.TacticCost(fit, n, c, 0.1*float64(n))
			if m.Us(step) < m.Us(h.DenseCost(n)) {
				return n
			}
		}
		return -1
	}
	cheap, dear := crossover(CostModel{FloorUs: 1, ReadGBps: 3000}), crossover(CostModel{FloorUs: 8, ReadGBps: 3000})
	require.Positive(t, cheap)
	require.Greater(t, dear, cheap)
	require.Equal(t, 64, crossover(CostModel{FloorUs: 0, ReadGBps: 3000}), "no floor: the fewer bytes win at once")
}

func TestTacticFitSampledRows(t *testing.T) {
	fit := TacticCurveFit()
	require.Zero(t, fit.SampledRows(0, 1))
	for _, n := range []int{100, 10_000, 1 << 20} {
		got := fit.SampledRows(n, n/16)
		require.LessOrEqual(t, got, float64(n))
		// At least the exact part; at most the exact part and two windows.
		require.GreaterOrEqual(t, got, math.Ceil(fit.InitialFrac*float64(n)))
		require.LessOrEqual(t, got, math.Ceil(fit.InitialFrac*float64(n))+2*float64(fit.MaxWindow))
	}
	fit.Moments = true
	require.Zero(t, fit.SampledRows(10_000, 625), "the moment estimate samples no key row")
	h := Heads{Query: 32, KV: 8, Dim: 128}
	require.Less(t, h.TacticCost(fit, 10_000, 625, 500).Bytes, h.TacticCost(TacticCurveFit(), 10_000, 625, 500).Bytes)
}

// TestCalibrate measures the device's cost model once and serves it from
// the cache after.
func TestCalibrate(t *testing.T) {
	dev := vktest.Open(t)
	m, err := Calibrate(dev)
	require.NoError(t, err)
	require.NoError(t, m.Validate())
	require.Positive(t, m.FloorUs)
	again, err := Calibrate(dev)
	require.NoError(t, err)
	require.Equal(t, m, again, "the second call is the cached model")
	t.Logf("%s: %.2f µs a dispatch, %.1f GB/s", dev.Info().Name, m.FloorUs, m.ReadGBps)
}

// TestWarmUp runs the warm-up: on a GPU it keeps the device busy about as
// long as asked (and leaves it usable), on a CPU device it returns at once.
func TestWarmUp(t *testing.T) {
	dev := vktest.Open(t)
	require.NoError(t, WarmUp(dev, 0))
	const d = 100 * time.Millisecond
	start := time.Now()
	require.NoError(t, WarmUp(dev, d))
	took := time.Since(start)
	if dev.Info().Type == "cpu" {
		require.Less(t, took, d/2, "a software renderer has no clocks to raise")
	} else {
		require.GreaterOrEqual(t, took, d)
	}
	_, err := Calibrate(dev)
	require.NoError(t, err, "the device works after the warm-up")
}

// TestCostModelPerSequence checks a sequence's part of a step shared by n
// sequences: its dispatches' floor divided by n, its bytes and tokens
// priced in full, and n below 2 changing nothing.
func TestCostModelPerSequence(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 5))
	for range 100 {
		m := CostModel{FloorUs: 10 * rng.Float64(), ReadGBps: 100 + 4000*rng.Float64(), TokenNs: rng.Float64()}
		c := Cost{Dispatches: 1 + rng.IntN(4), Bytes: 1e8 * rng.Float64(), Tokens: rng.IntN(1 << 17)}
		n := 1 + rng.IntN(16)
		shared := float64(c.Dispatches) * m.FloorUs
		require.InDelta(t, m.Us(c)-shared+shared/float64(n), m.PerSequence(n).Us(c), 1e-9*m.Us(c))
		require.Equal(t, m, m.PerSequence(1))
		require.Equal(t, m, m.PerSequence(0))
	}
}
