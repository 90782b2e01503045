package sparse

import (
	"math"
	"math/rand"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/vk/vktest"
)

// TestDeltaPagesMatchReference runs a dense plan over random layers of odd
// and edge lengths (one token, a page and one, a last page short, several
// chunks) and two head shapes, then DELTA's page scores with the pages
// poisoned first, and compares them with DeltaPageScoresRef of
// DeltaTokenScoresRef, reporting the first mismatches.
func TestDeltaPagesMatchReference(t *testing.T) {
	dev := vktest.Open(t)
	rng := rand.New(rand.NewSource(41))
	for _, tc := range []struct {
		h Heads
		n []int
	}{
		{Heads{Query: 8, KV: 2, Dim: 64}, []int{1, 17, 1000, 2049}},
		{Heads{Query: 32, KV: 8, Dim: 128}, []int{300}},
	} {
		d, err := NewDense(dev, tc.h)
		require.NoError(t, err)
		for _, n := range tc.n {
			layer, k, _ := randomLayer(t, dev, rng, tc.h, n, n+7, 1.5)
			plan, err := d.Plan([]*kvcache.Layer{layer})
			require.NoError(t, err)
			x, err := NewDeltaPages(plan, QuestPageSize)
			require.NoError(t, err)
			q := randomQueries(rng, tc.h.Query*tc.h.Dim, 1)
			_, err = plan.Attend(q)
			require.NoError(t, err)
			nan := math.Float32bits(float32(math.NaN()))
			require.NoError(t, dev.Run(func(c *vk.Commands) { c.Fill(x.Pages().All(), nan) }))
			require.NoError(t, runOnce(dev, x.Record))
			got, err := x.Scores()
			require.NoError(t, err)

			q64 := make([]float64, len(q))
			for i, v := range q {
				q64[i] = float64(v)
			}
			scores, err := DeltaTokenScoresRef(tc.h, q64, k, n, 1/math.Sqrt(float64(tc.h.Dim)))
			require.NoError(t, err)
			want := DeltaPageScoresRef(scores, QuestPageSize)
			require.Len(t, got, len(want))
			bad := 0
			for u, w := range want {
				if !(math.Abs(float64(got[u])-w) <= 1e-4*math.Max(w, 1e-3)) {
					if bad < 5 {
						t.Errorf("%d heads, %d tokens: page %d scores %v, reference %v", tc.h.Query, n, u, got[u], w)
					}
					bad++
				}
			}
			require.Zero(t, bad)
			require.NoError(t, x.Release())
			require.NoError(t, plan.Release())
		}
		require.NoError(t, d.Release())
	}
}

// TestDeltaPagesRejectsBadInput checks the plans and page sizes refused.
func TestDeltaPagesRejectsBadInput(t *testing.T) {
	dev := vktest.Open(t)
	rng := rand.New(rand.NewSource(2))
	h := Heads{Query: 8, KV: 2, Dim: 64}
	d, err := NewDense(dev, h)
	require.NoError(t, err)
	defer d.Release()
	a, _, _ := randomLayer(t, dev, rng, h, 40, 40, 1)
	b, _, _ := randomLayer(t, dev, rng, h, 40, 40, 1)
	two, err := d.Plan([]*kvcache.Layer{a, b})
	require.NoError(t, err)
	defer two.Release()
	_, err = NewDeltaPages(two, 16)
	require.Error(t, err, "a plan over two sequences")
	one, err := d.Plan([]*kvcache.Layer{a})
	require.NoError(t, err)
	defer one.Release()
	for _, size := range []int{0, -16, 3, 512} {
		_, err = NewDeltaPages(one, size)
		require.Error(t, err, "pages of %d", size)
	}
}
