package sparse

import (
	"math"
	"sort"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestH2OSplit(t *testing.T) {
	for _, c := range [][3]int{{0, 0, 0}, {1, 0, 1}, {2, 1, 1}, {7, 3, 4}, {64, 32, 32}} {
		h, r := H2OSplit(c[0])
		assert.Equal(t, [2]int{c[1], c[2]}, [2]int{h, r}, "budget %d", c[0])
	}
}

// TestH2OHandComputed follows two heads over two steps in one dimension
// (q·k = q·key) with one sink, a window of one token and a budget of 2
// middle tokens (1 heavy, 1 recent), and checks the selections and the
// accumulated weights against values worked out by hand.
func TestH2OHandComputed(t *testing.T) {
	l := BaselineLayout{Sinks: 1, Window: 1}
	h, err := NewH2O(2, l)
	require.NoError(t, err)
	keys := []float64{0, 1, 2, 0.5, 3, 0, 1}
	values := []float64{1, 2, 3, 4, 5, 6, 7}
	e := math.Exp

	// Step 1 over tokens 0…5: middle [1, 5), recent part {4}, heavy part
	// from [1, 4) with nothing accumulated: the lowest id, 1. Both heads
	// select {0, 1, 4, 5}.
	qs := [][]float64{{1}, {-1}}
	outs, tokens, own, err := h.Step(qs, keys[:6], values[:6], 1, 2)
	require.NoError(t, err)
	require.Equal(t, []int32{0, 1, 4, 5}, tokens)
	require.Equal(t, [][]int32{{0, 1, 4, 5}, {0, 1, 4, 5}}, own)
	// Head 0 scores 0, 1, 3, 0; head 1 scores 0, −1, −3, 0.
	z0 := 2 + e(1) + e(3)
	z1 := 2 + e(-1) + e(-3)
	a0 := []float64{1 / z0, e(1) / z0, 0, 0, e(3) / z0, 1 / z0}
	a1 := []float64{1 / z1, e(-1) / z1, 0, 0, e(-3) / z1, 1 / z1}
	assert.InDeltaSlice(t, a0, h.Accumulated(0), 1e-15)
	assert.InDeltaSlice(t, a1, h.Accumulated(1), 1e-15)
	assert.InDelta(t, (1+2*e(1)+5*e(3)+6)/z0, outs[0][0], 1e-14)
	assert.InDelta(t, (1+2*e(-1)+5*e(-3)+6)/z1, outs[1][0], 1e-14)
	assert.Equal(t, 1, h.Steps())

	// Step 2 over tokens 0…6: middle [1, 6), recent part {5}, heavy part
	// from [1, 5): head 0's largest is token 4 (e³/z0), head 1's is token 1
	// (e⁻¹/z1 > e⁻³/z1). Union {0, 1, 4, 5, 6}.
	_, tokens, own, err = h.Step(qs, keys, values, 1, 2)
	require.NoError(t, err)
	require.Equal(t, [][]int32{{0, 4, 5, 6}, {0, 1, 5, 6}}, own)
	require.Equal(t, []int32{0, 1, 4, 5, 6}, tokens)
	// Scores over the union: head 0: 0, 1, 3, 0, 1; head 1: 0, −1, −3, 0, −1.
	y0 := 2 + 2*e(1) + e(3)
	y1 := 2 + 2*e(-1) + e(-3)
	a0 = []float64{a0[0] + 1/y0, a0[1] + e(1)/y0, 0, 0, a0[4] + e(3)/y0, a0[5] + 1/y0, e(1) / y0}
	a1 = []float64{a1[0] + 1/y1, a1[1] + e(-1)/y1, 0, 0, a1[4] + e(-3)/y1, a1[5] + 1/y1, e(-1) / y1}
	assert.InDeltaSlice(t, a0, h.Accumulated(0), 1e-15)
	assert.InDeltaSlice(t, a1, h.Accumulated(1), 1e-15)

	// Observe adds the dense softmax.
	require.NoError(t, h.Observe([][]float64{{0}, {0}}, keys, 1))
	for j, a := range [][]float64{a0, a1} {
		got := h.Accumulated(j)
		for i := range a {
			assert.InDelta(t, a[i]+1.0/7, got[i], 1e-15)
		}
	}
	assert.Equal(t, 2, h.Steps())
}

// TestH2OMatchesDefinition runs fresh random sequences of steps (with a
// dense observation first or not) and checks every step against the
// definition recomputed independently: the selection sizes, the recent
// part, the heavy part being the top accumulated scores with ties by id,
// the union and outputs, and that each head's accumulation grows by exactly
// one per step.
func TestH2OMatchesDefinition(t *testing.T) {
	r := baselineRand(t)
	for trial := 0; trial < 12; trial++ {
		d := 1 + r.IntN(9)
		l := BaselineLayout{Sinks: r.IntN(6), Window: r.IntN(40)}
		if trial == 0 {
			l = DefaultBaselineLayout()
		}
		heads := 1 + r.IntN(4)
		total := 40 + r.IntN(250)
		keys, values := randMatrix(r, total, d), randMatrix(r, total, d)
		h, err := NewH2O(heads, l)
		require.NoError(t, err)
		n := total / 2
		mass := 0.0
		if trial%2 == 1 {
			qs := make([][]float64, heads)
			for j := range qs {
				qs[j] = randMatrix(r, 1, d)
			}
			require.NoError(t, h.Observe(qs, keys[:n*d], 0.5))
			mass++
		}
		for ; n <= total; n += 1 + r.IntN(7) {
			lo, hi := l.Middle(n)
			budget := baselineBudgets(r, hi-lo)[r.IntN(8)]
			qs := make([][]float64, heads)
			for j := range qs {
				qs[j] = randMatrix(r, 1, d)
			}
			before := make([][]float64, heads)
			for j := range before {
				before[j] = h.Accumulated(j)
			}
			outs, tokens, own, err := h.Step(qs, keys[:n*d], values[:n*d], 0.5, budget)
			if len(l.Fixed(n)) == 0 && min(budget, hi-lo) == 0 {
				require.Error(t, err, "a step that attends nothing")
				continue
			}
			require.NoError(t, err)
			mass++
			heavy, recent := H2OSplit(budget)
			for j := range qs {
				sel := map[int32]bool{}
				for _, x := range own[j] {
					sel[x] = true
				}
				require.Len(t, own[j], n-(hi-lo)+min(budget, hi-lo))
				for _, x := range l.Fixed(n) {
					require.True(t, sel[x])
				}
				if budget >= hi-lo {
					continue
				}
				split := max(lo, hi-recent)
				for x := split; x < hi; x++ {
					require.True(t, sel[int32(x)], "recent token %d", x)
				}
				score := func(x int) float64 {
					if x < len(before[j]) {
						return before[j][x]
					}
					return 0
				}
				var in, out []int
				for x := lo; x < split; x++ {
					if sel[int32(x)] {
						in = append(in, x)
					} else {
						out = append(out, x)
					}
				}
				require.Len(t, in, heavy)
				for _, a := range in {
					for _, b := range out {
						require.True(t, score(a) > score(b) || (score(a) == score(b) && a < b), "heavy %d (%v) over %d (%v)", a, score(a), b, score(b))
					}
				}
			}
			require.Equal(t, UnionTokens(own...), tokens)
			for j, q := range qs {
				want, err := AttendSubsetRef(q, keys[:n*d], values[:n*d], tokens, 0.5)
				require.NoError(t, err)
				require.Equal(t, want, outs[j])
				acc := h.Accumulated(j)
				require.Len(t, acc, n)
				sum := 0.0
				for _, x := range acc {
					sum += x
				}
				require.InDelta(t, mass, sum, 1e-12*mass)
				// Only the attended tokens gained weight.
				attended := map[int32]bool{}
				for _, x := range tokens {
					attended[x] = true
				}
				for x := range acc {
					old := 0.0
					if x < len(before[j]) {
						old = before[j][x]
					}
					if !attended[int32(x)] {
						require.Equal(t, old, acc[x])
					} else {
						require.Greater(t, acc[x], old)
					}
				}
			}
		}
	}
}

func TestH2OBudgetEdges(t *testing.T) {
	r := baselineRand(t)
	const d = 5
	n := 100 + r.IntN(100)
	keys, values := randMatrix(r, n, d), randMatrix(r, n, d)
	qs := [][]float64{randMatrix(r, 1, d), randMatrix(r, 1, d)}
	l := DefaultBaselineLayout()
	h, err := NewH2O(2, l)
	require.NoError(t, err)
	_, tokens, _, err := h.Step(qs, keys, values, 0.3, 0)
	require.NoError(t, err)
	require.Equal(t, l.Fixed(n), tokens)
	outs, tokens, _, err := h.Step(qs, keys, values, 0.3, n)
	require.NoError(t, err)
	require.Len(t, tokens, n)
	for j, q := range qs {
		dense, err := AttendRef(q, keys, values, 0.3)
		require.NoError(t, err)
		require.InDeltaSlice(t, dense, outs[j], 1e-12)
	}
	// Tokens the state never attended, ranked by id after the recent part.
	fresh, err := NewH2O(1, l)
	require.NoError(t, err)
	sel, err := fresh.Select(0, n, 9)
	require.NoError(t, err)
	lo, hi := l.Middle(n)
	want := append(l.Fixed(n), int32(lo), int32(lo+1), int32(lo+2), int32(lo+3))
	for x := hi - 5; x < hi; x++ {
		want = append(want, int32(x))
	}
	sort.Slice(want, func(a, b int) bool { return want[a] < want[b] })
	require.Equal(t, want, sel)

	for name, f := range map[string]func() error{
		"heads0":   func() error { _, err := NewH2O(0, l); return err },
		"layout":   func() error { _, err := NewH2O(1, BaselineLayout{Sinks: -1}); return err },
		"budget":   func() error { _, _, _, err := h.Step(qs, keys, values, 1, -1); return err },
		"shrink":   func() error { _, _, _, err := h.Step(qs, keys[:d*10], values[:d*10], 1, 1); return err },
		"nheads":   func() error { _, _, _, err := h.Step(qs[:1], keys, values, 1, 1); return err },
		"obsHeads": func() error { return h.Observe(qs[:1], keys, 1) },
		"obsShort": func() error { return h.Observe(qs, keys[:d], 1) },
		"values":   func() error { _, _, _, err := h.Step(qs, keys, values[:d], 1, 1); return err },
		"select":   func() error { _, err := h.Select(2, n, 1); return err },
		"selectN":  func() error { _, err := h.Select(0, n-1, 1); return err },
	} {
		assert.Error(t, f(), name)
	}
}
