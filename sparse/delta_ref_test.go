package sparse

import (
	"math"
	"math/rand"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestDeltaResolve checks the paper's defaults and every refusal.
func TestDeltaResolve(t *testing.T) {
	d, err := Delta{}.Resolve(6)
	require.NoError(t, err)
	require.Equal(t, Delta{Warmup: 2, Refresh: []int{2}, Pages: 64, Recent: 8, PageSize: 16, RunPages: 8}, d)
	d, err = Delta{Warmup: 1, Refresh: []int{1, 4}, Pages: 10, Recent: 3, PageSize: 8}.Resolve(6)
	require.NoError(t, err)
	require.Equal(t, []int{1, 4}, d.Refresh)
	for name, bad := range map[string]Delta{
		"L = K":               {Pages: 8, Recent: 8},
		"L > K":               {Pages: 4, Recent: 9},
		"negative pages":      {Pages: -1},
		"negative page size":  {PageSize: -16},
		"warm-up past layers": {Warmup: 6},
		"Δ-layer past layers": {Refresh: []int{2, 6}},
		"Δ-layer in warm-up":  {Warmup: 2, Refresh: []int{1}},
		"Δ-layers unsorted":   {Refresh: []int{2, 5, 4}},
		"Δ-layers repeated":   {Refresh: []int{2, 2}},
		"no Δ-layer":          {Refresh: []int{}},
		"first Δ-layer late":  {Warmup: 2, Refresh: []int{3}},
		"negative recent":     {Recent: -1},
		"negative warm-up":    {Warmup: -1, Refresh: []int{0}},
		"negative run pages":  {RunPages: -2},
	} {
		_, err := bad.Resolve(6)
		require.Error(t, err, name)
	}
}

// TestDeltaTokenScoresRef checks the scores on a case written out by hand
// and, on random layers of realistic scale, that each is the greatest of
// the heads' weights: in (0, 1], and together at least 1.
func TestDeltaTokenScoresRef(t *testing.T) {
	// One KV head of D 2, two query heads, two tokens: head 0 gives token 1
	// weight e/(1+e), head 1 gives token 0 the same.
	h := Heads{Query: 2, KV: 1, Dim: 8}
	q := make([]float64, 16)
	q[0], q[8] = 1, -1
	keys := make([]float64, 16)
	keys[8] = 1 // token 1: (1, 0, …)
	s, err := DeltaTokenScoresRef(h, q, keys, 2, 1)
	require.NoError(t, err)
	e := math.E
	require.InDeltaSlice(t, []float64{e / (1 + e), e / (1 + e)}, s, 1e-12)

	rng := rand.New(rand.NewSource(3))
	h = Heads{Query: 8, KV: 2, Dim: 64}
	for _, n := range []int{1, 17, 1000} {
		q := make([]float64, h.Query*h.Dim)
		keys := make([]float64, h.KV*n*h.Dim)
		for i := range q {
			q[i] = rng.NormFloat64()
		}
		for i := range keys {
			keys[i] = rng.NormFloat64() * 2
		}
		s, err := DeltaTokenScoresRef(h, q, keys, n, 1/8.0)
		require.NoError(t, err)
		sum := 0.0
		for tok, x := range s {
			require.True(t, x > 0 && x <= 1, "token %d score %v", tok, x)
			sum += x
			best := 0.0
			for hh := 0; hh < h.Query; hh++ {
				g := hh / h.Group()
				p, err := SoftmaxRef(q[hh*h.Dim:(hh+1)*h.Dim], keys[g*n*h.Dim:(g+1)*n*h.Dim], 1/8.0)
				require.NoError(t, err)
				best = math.Max(best, p[tok])
			}
			require.Equal(t, best, x)
		}
		require.GreaterOrEqual(t, sum, 1-1e-12)
	}
	_, err = DeltaTokenScoresRef(h, q[:3], keys, 2, 1)
	require.Error(t, err)
}

// TestDeltaPagesRef checks page sums (the last page short), the pick of
// recent and top pages with ties to the lower page, the tokens of the
// picked pages, and the refusals.
func TestDeltaPagesRef(t *testing.T) {
	scores := []float64{1, 2, 3, 4, 5, 6, 7}
	require.Equal(t, []float64{3, 7, 11, 7}, DeltaPageScoresRef(scores, 2))

	pages := []float64{5, 1, 9, 5, 0, 2, 3}
	got, err := DeltaSelectRef(pages, 4, 2) // recent: 5, 6; older top 2: page 2 (9), then 0 and 3 tie at 5: page 0
	require.NoError(t, err)
	require.Equal(t, []int{0, 2, 5, 6}, got)
	got, err = DeltaSelectRef(pages, 3, 0)
	require.NoError(t, err)
	require.Equal(t, []int{0, 2, 3}, got)
	got, err = DeltaSelectRef(pages, 7, 3)
	require.NoError(t, err)
	require.Equal(t, []int{0, 1, 2, 3, 4, 5, 6}, got, "a budget covering every page takes them all")
	for _, bad := range [][2]int{{4, 4}, {4, 5}, {4, -1}} {
		_, err := DeltaSelectRef(pages, bad[0], bad[1])
		require.Error(t, err, "budget %d, recent %d", bad[0], bad[1])
	}
	require.Equal(t, []int32{0, 1, 2, 6, 7, 8, 12}, DeltaTokensRef([]int{0, 2, 4}, 3, 13))
}

// TestAttentionShiftRef checks the shift of equal, orthogonal and
// scaled distributions, and the refusals.
func TestAttentionShiftRef(t *testing.T) {
	s, err := AttentionShiftRef([]float64{0.2, 0.8}, []float64{0.2, 0.8})
	require.NoError(t, err)
	require.InDelta(t, 0, s, 1e-15)
	s, err = AttentionShiftRef([]float64{1, 0}, []float64{0, 1})
	require.NoError(t, err)
	require.Equal(t, 1.0, s)
	s, err = AttentionShiftRef([]float64{0.5, 0.5}, []float64{1, 0})
	require.NoError(t, err)
	require.InDelta(t, 1-1/math.Sqrt2, s, 1e-15)
	_, err = AttentionShiftRef([]float64{1}, []float64{1, 0})
	require.Error(t, err)
	_, err = AttentionShiftRef([]float64{0, 0}, []float64{1, 0})
	require.Error(t, err)
}
