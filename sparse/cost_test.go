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
	for _, bad := range []CostModel{{-1, 1}, {1, 0}, {1, -3}, {math.NaN(), 1}, {1, math.NaN()}, {math.Inf(1), 1}, {1, math.Inf(1)}} {
		require.Error(t, bad.Validate(), "%+v", bad)
	}
	require.NoError(t, CostModel{0, 1}.Validate())
}

// TestFitCostModel checks the fit through two timed steps on random
// costs: it prices both exactly where the reads differ, the larger one
// exactly where they do not (with the fallback's bandwidth) or where the
// floor would come out negative (floor 0), in either order of the
// points, and refuses what no model fits.
func TestFitCostModel(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 11))
	fallback := CostModel{FloorUs: 2, ReadGBps: 3000}
	for range 200 {
		d := 1 + rng.IntN(4)
		truth := CostModel{FloorUs: 0.5 + 10*rng.Float64(), ReadGBps: 100 + 4000*rng.Float64()}
		a := Cost{Dispatches: d, Bytes: 1e5 + 1e8*rng.Float64()}
		b := Cost{Dispatches: d, Bytes: a.Bytes * (1.2 + 10*rng.Float64())}
		m, err := FitCostModel(b, truth.Us(b), a, truth.Us(a), fallback)
		require.NoError(t, err)
		require.InDelta(t, truth.FloorUs, m.FloorUs, 1e-6*truth.Us(b))
		require.InEpsilon(t, truth.ReadGBps, m.ReadGBps, 1e-6)
		// Equal reads: the fallback's bandwidth, the larger time kept.
		c := Cost{Dispatches: d, Bytes: a.Bytes * (1 + 0.05*rng.Float64())}
		slow := truth.Us(c) + 100
		m, err = FitCostModel(a, truth.Us(a), c, slow, fallback)
		require.NoError(t, err)
		require.Equal(t, fallback.ReadGBps, m.ReadGBps)
		require.InEpsilon(t, slow, m.Us(c), 1e-9)
		require.GreaterOrEqual(t, m.FloorUs, 0.0)
		// A time too short for its bytes at the fallback's bandwidth, and
		// a line through the points that crosses zero time: floor 0.
		for _, pair := range [][4]float64{{a.Bytes, 1e-3, c.Bytes, 2e-3}, {a.Bytes, 1e-3, b.Bytes, 1e3}} {
			x, y := Cost{Dispatches: d, Bytes: pair[0]}, Cost{Dispatches: d, Bytes: pair[2]}
			m, err = FitCostModel(x, pair[1], y, pair[3], fallback)
			require.NoError(t, err)
			require.Zero(t, m.FloorUs)
			require.InEpsilon(t, pair[3], m.Us(y), 1e-9)
		}
	}
	one := Cost{Dispatches: 1, Bytes: 1e6}
	for _, bad := range [][2]Cost{{one, {Dispatches: 2, Bytes: 2e6}}, {{}, {}}} {
		_, err := FitCostModel(bad[0], 1, bad[1], 2, fallback)
		require.Error(t, err, "%v", bad)
	}
	for _, us := range []float64{0, -1, math.NaN(), math.Inf(1)} {
		_, err := FitCostModel(one, us, Cost{Dispatches: 1, Bytes: 2e6}, 2, fallback)
		require.Error(t, err, "%v µs", us)
	}
	_, err := FitCostModel(one, 1, Cost{Dispatches: 1, Bytes: 2e6}, 2, CostModel{})
	require.Error(t, err, "an invalid fallback")
}

// TestCostCrossover checks the shape the dense fallback relies on: with a
// floor, a step of more dispatches that reads a shrinking share of dense
// attention's bytes loses to dense attention below some length and wins
// above it, and a dearer floor moves that length up.
func TestCostCrossover(t *testing.T) {
	h := Heads{Query: 8, KV: 2, Dim: 64}
	fit := DefaultTacticFit()
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
	fit := DefaultTacticFit()
	require.Zero(t, fit.SampledRows(0, 1))
	for _, n := range []int{100, 10_000, 1 << 20} {
		got := fit.SampledRows(n, n/16)
		require.LessOrEqual(t, got, float64(n))
		// At least the exact part; at most the exact part and two windows.
		require.GreaterOrEqual(t, got, math.Ceil(fit.InitialFrac*float64(n)))
		require.LessOrEqual(t, got, math.Ceil(fit.InitialFrac*float64(n))+2*float64(fit.MaxWindow))
	}
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
