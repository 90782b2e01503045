package sparse

import (
	"math/rand/v2"
	"sort"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// baselineRand returns a generator seeded from the clock, so that every run
// draws fresh inputs; the seed is logged to replay a failure.
func baselineRand(t *testing.T) *rand.Rand {
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	return rand.New(rand.NewPCG(seed, 0x5eed))
}

// baselineBudgets returns budgets for a middle of m tokens: the edges 0,
// 1, m−1, m, m+1 and one far above, and two random ones.
func baselineBudgets(r *rand.Rand, m int) []int {
	b := []int{0, 1, max(0, m-1), m, m + 1, 1 << 20, r.IntN(m + 1), r.IntN(2*m + 40)}
	return b
}

func TestStreamingBaselineLayout(t *testing.T) {
	l := DefaultBaselineLayout()
	assert.Equal(t, BaselineLayout{Sinks: 4, Window: 64}, l)
	for _, c := range []struct{ n, lo, hi int }{{0, 0, 0}, {3, 3, 3}, {4, 4, 4}, {50, 4, 4}, {68, 4, 4}, {69, 4, 5}, {1000, 4, 936}} {
		lo, hi := l.Middle(c.n)
		assert.Equalf(t, [2]int{c.lo, c.hi}, [2]int{lo, hi}, "n=%d", c.n)
		f := l.Fixed(c.n)
		assert.Len(t, f, c.n-(hi-lo))
	}
	assert.Equal(t, []int32{0, 1, 3, 4}, BaselineLayout{Sinks: 2, Window: 2}.Fixed(5))
	assert.Error(t, BaselineLayout{Sinks: -1}.Validate())
	assert.Error(t, BaselineLayout{Window: -1}.Validate())
}

func TestStreamingUnionTokens(t *testing.T) {
	r := baselineRand(t)
	for trial := 0; trial < 50; trial++ {
		var sets [][]int32
		want := map[int32]bool{}
		for s := r.IntN(5); s > 0; s-- {
			var set []int32
			for k := r.IntN(20); k > 0; k-- {
				x := int32(r.IntN(40))
				set = append(set, x)
				want[x] = true
			}
			sets = append(sets, set)
		}
		got := UnionTokens(sets...)
		require.Len(t, got, len(want))
		require.True(t, sort.SliceIsSorted(got, func(a, b int) bool { return got[a] < got[b] }))
		for i, x := range got {
			require.True(t, want[x])
			if i > 0 {
				require.Less(t, got[i-1], x)
			}
		}
	}
	assert.Empty(t, UnionTokens())
}

// TestStreamingSelectIsSinksPlusRecent checks StreamingLLM's set against its
// definition token by token: t is in it iff t < Sinks or t ≥ n − Window −
// budget, on odd and edge sizes (fewer tokens than the sinks, than sinks and
// window, budgets 0 and beyond the middle).
func TestStreamingSelectIsSinksPlusRecent(t *testing.T) {
	r := baselineRand(t)
	layouts := []BaselineLayout{DefaultBaselineLayout(), {Sinks: 0, Window: 0}, {Sinks: 3, Window: 0}, {Sinks: 0, Window: 5}}
	for trial := 0; trial < 30; trial++ {
		layouts = append(layouts, BaselineLayout{Sinks: r.IntN(7), Window: r.IntN(70)})
	}
	for _, l := range layouts {
		for _, n := range []int{0, 1, 2, 3, 5, 67, 68, 69, 70, 131, 257 + r.IntN(300)} {
			lo, hi := l.Middle(n)
			for _, b := range baselineBudgets(r, hi-lo) {
				got, err := StreamingSelectRef(n, l, b)
				require.NoError(t, err)
				in := map[int32]bool{}
				for _, x := range got {
					in[x] = true
				}
				require.Len(t, in, len(got), "repeats")
				require.True(t, sort.SliceIsSorted(got, func(a, b int) bool { return got[a] < got[b] }))
				for x := 0; x < n; x++ {
					want := x < l.Sinks || x >= n-l.Window-b
					require.Equalf(t, want, in[int32(x)], "layout %+v n=%d budget %d token %d", l, n, b, x)
				}
				require.Len(t, got, min(n, l.Sinks+l.Window+b))
			}
		}
	}
}

func TestStreamingDecodeRef(t *testing.T) {
	r := baselineRand(t)
	const d = 7
	n := 150 + r.IntN(50)
	keys, values := randMatrix(r, n, d), randMatrix(r, n, d)
	qs := [][]float64{randMatrix(r, 1, d), randMatrix(r, 1, d), randMatrix(r, 1, d)}
	l := DefaultBaselineLayout()
	for _, b := range []int{0, 17, n} {
		outs, tokens, err := StreamingDecodeRef(qs, keys, values, 0.3, l, b)
		require.NoError(t, err)
		set, err := StreamingSelectRef(n, l, b)
		require.NoError(t, err)
		require.Equal(t, set, tokens)
		for j, q := range qs {
			want, err := AttendSubsetRef(q, keys, values, set, 0.3)
			require.NoError(t, err)
			require.Equal(t, want, outs[j])
			if b >= n {
				dense, err := AttendRef(q, keys, values, 0.3)
				require.NoError(t, err)
				require.InDeltaSlice(t, dense, outs[j], 1e-12)
			}
		}
	}
	for name, f := range map[string]func() error{
		"budget": func() error { _, _, err := StreamingDecodeRef(qs, keys, values, 1, l, -1); return err },
		"layout": func() error {
			_, _, err := StreamingDecodeRef(qs, keys, values, 1, BaselineLayout{Sinks: -1}, 1)
			return err
		},
		"heads": func() error { _, _, err := StreamingDecodeRef(nil, keys, values, 1, l, 1); return err },
		"ragged": func() error {
			_, _, err := StreamingDecodeRef([][]float64{qs[0], {1}}, keys, values, 1, l, 1)
			return err
		},
		"values":   func() error { _, _, err := StreamingDecodeRef(qs, keys, values[:d], 1, l, 1); return err },
		"novalues": func() error { _, _, err := StreamingDecodeRef(qs, keys, nil, 1, l, 1); return err },
		"nokeys":   func() error { _, _, err := StreamingDecodeRef(qs, nil, nil, 1, l, 1); return err },
		"shape":    func() error { _, _, err := StreamingDecodeRef(qs, keys[:d+1], values[:d+1], 1, l, 1); return err },
		"empty":    func() error { _, _, err := StreamingDecodeRef(qs, keys, values, 1, BaselineLayout{}, 0); return err },
		"n":        func() error { _, err := StreamingSelectRef(-1, l, 0); return err },
	} {
		assert.Error(t, f(), name)
	}
}
