package decode

import (
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/vk/vktest"
)

// TestTimeStack times a 6-layer DELTA model (dense layers 0–1, Δ-layers 2
// and 4, the others reusing their picks) and checks: TimeStack refuses
// bad counts and a layer without its SetQuery, naming it; it returns reps
// positive times, sorted, none below the slowest layer's median alone;
// and a pass attends every layer in order, each reusing layer the pick
// its Δ-layer made in the same pass: after a step for other queries (with
// other picks), one pass leaves the outputs of a step for the queries set.
func TestTimeStack(t *testing.T) {
	dev := vktest.Open(t)
	const layers, n = 6, 600
	layout, err := DeltaLayout(layers, sparse.Delta{Warmup: 2, Refresh: []int{2, 4}, Pages: 8, Recent: 2, PageSize: 16})
	require.NoError(t, err)
	f := newFixture(t, testHeads, layers, []int{n})
	m, err := New(dev, Config{Fallback: FallbackNever, Heads: testHeads, Layers: layers, Slots: 1, Capacity: n, Layout: layout})
	require.NoError(t, err)
	released := false
	defer func() {
		if !released {
			require.NoError(t, m.Release())
		}
	}()
	f.prefill(t, m, 0, n)

	_, err = m.TimeStack(1, 3)
	require.ErrorContains(t, err, "layer 0")
	// Attend the layers in order for query 0, then for its negation: a step
	// whose picks and outputs differ.
	want := make([][]float32, layers)
	other := make([][]float32, layers)
	picks := func() [][]int {
		var out [][]int
		for _, l := range []int{2, 4} {
			b := m.layers[l].delta
			p, err := b.picks[0].Picked()
			require.NoError(t, err)
			out = append(out, p)
		}
		return out
	}
	for l := range layers {
		want[l], err = m.Attend(l, f.queries(m, l, 0))
		require.NoError(t, err, "layer %d", l)
	}
	wantPicks := picks()
	for l := range layers {
		q := f.queries(m, l, 0)
		for i := range q {
			q[i] = -q[i]
		}
		other[l], err = m.Attend(l, q)
		require.NoError(t, err, "layer %d", l)
	}
	require.NotEqual(t, wantPicks, picks(), "the Δ-layers' picks for the queries and their negation")
	// The check below must tell the two steps apart.
	for l := range layers {
		require.Greater(t, headError(want[l], other[l], testHeads.Dim), 1e-2, "layer %d: the outputs of a query and its negation agree", l)
	}

	for _, bad := range [][2]int{{-1, 3}, {1, 0}, {0, -2}} {
		_, err = m.TimeStack(bad[0], bad[1])
		require.Error(t, err, "warm-up %d, reps %d", bad[0], bad[1])
	}
	for l := range layers {
		require.NoError(t, m.SetQuery(l, f.queries(m, l, 0)))
	}
	// One pass: each reusing layer attends the pick its Δ-layer made in it.
	_, err = m.TimeStack(0, 1)
	require.NoError(t, err)
	for l := range layers {
		got, err := m.ReadOutput(l)
		require.NoError(t, err)
		require.Less(t, headError(want[l], got, testHeads.Dim), 1e-4, "layer %d (%s): the stack's output against the step's for the same queries", l, m.policy[l])
	}
	const reps = 5
	times, err := m.TimeStack(1, reps)
	require.NoError(t, err)
	require.Len(t, times, reps)
	require.Positive(t, times[0])
	require.IsNonDecreasing(t, times)

	slowest := times[0] * 0
	for l := range layers {
		d, err := m.Time(l, 1, 5)
		require.NoError(t, err, "layer %d", l)
		slowest = max(slowest, d[len(d)/2])
	}
	require.GreaterOrEqual(t, times[len(times)/2], slowest, "the stack's median against the slowest layer's")

	// Another active slot set: every layer's queries are needed again.
	require.NoError(t, m.Free(0))
	f.prefill(t, m, 0, n)
	for l := range 3 {
		require.NoError(t, m.SetQuery(l, f.queries(m, l, 0)))
	}
	_, err = m.TimeStack(0, 1)
	require.ErrorContains(t, err, "layer 3")

	require.NoError(t, m.Release())
	released = true
	_, err = m.TimeStack(0, 1)
	require.Error(t, err)
}

// headError returns the largest relative error ‖got − want‖/‖want‖ of a
// head's output (dim values each); +Inf where got holds a NaN.
func headError(want, got []float32, dim int) float64 {
	worst := 0.0
	for h := 0; h*dim < len(want); h++ {
		var num, den float64
		for i := h * dim; i < (h+1)*dim; i++ {
			d := float64(got[i]) - float64(want[i])
			num += d * d
			den += float64(want[i]) * float64(want[i])
		}
		e := math.Sqrt(num / math.Max(den, 1e-300))
		if math.IsNaN(e) {
			return math.Inf(1)
		}
		worst = math.Max(worst, e)
	}
	return worst
}
