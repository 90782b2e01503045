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

// TestDeltaSelectMatchesReference picks pages on the GPU from random
// scores with many ties (a few distinct values) and without, over page
// counts below and far above the budget, with the ranks and cuts poisoned
// first, and compares every query head's pick with DeltaSelectRef.
func TestDeltaSelectMatchesReference(t *testing.T) {
	dev := vktest.Open(t)
	rng := rand.New(rand.NewSource(17))
	h := Heads{Query: 8, KV: 2, Dim: 64}
	d, err := NewDense(dev, h)
	require.NoError(t, err)
	defer d.Release()
	const most = 8191
	scores, err := dev.NewBuffer(most*4, vk.DeviceLocal)
	require.NoError(t, err)
	defer scores.Release()
	x, err := NewDeltaSelect(d, scores.All(), most)
	require.NoError(t, err)
	defer func() { require.NoError(t, x.Release()) }()
	for _, tc := range []struct{ pages, budget, recent, distinct int }{
		{1, 64, 8, 0}, {5, 64, 8, 0}, {64, 64, 8, 0}, {65, 64, 8, 3},
		{100, 10, 3, 0}, {1000, 64, 8, 4}, {most, 64, 8, 0}, {most, 2, 1, 2}, {300, 20, 0, 0},
	} {
		s := make([]float32, tc.pages)
		s64 := make([]float64, tc.pages)
		for i := range s {
			if tc.distinct > 0 {
				s[i] = float32(rng.Intn(tc.distinct)) * 0.25
			} else {
				s[i] = float32(rng.ExpFloat64() * 0.01)
			}
			s64[i] = float64(s[i])
		}
		require.NoError(t, scores.WriteFloat32(0, s))
		nan := math.Float32bits(float32(math.NaN()))
		require.NoError(t, dev.Run(func(c *vk.Commands) {
			c.Fill(x.Rank(), nan)
			c.Fill(x.Cut(), nan)
		}))
		require.NoError(t, runOnce(dev, func(c *vk.Commands) error { return x.Record(c, tc.pages, tc.budget, tc.recent) }))
		want, err := DeltaSelectRef(s64, tc.budget, tc.recent)
		require.NoError(t, err)
		got, err := x.Picked(tc.pages)
		require.NoError(t, err)
		require.Equal(t, want, got, "%d pages, K %d, L %d, %d distinct scores", tc.pages, tc.budget, tc.recent, tc.distinct)
		ranks, err := readInts(x.rank, h.Query*tc.pages)
		require.NoError(t, err)
		for hh := 1; hh < h.Query; hh++ {
			require.Equal(t, ranks[:tc.pages], ranks[hh*tc.pages:(hh+1)*tc.pages], "head %d's pick", hh)
		}
		cuts, err := readInts(x.cut, h.Query)
		require.NoError(t, err)
		for _, c := range cuts {
			require.Equal(t, 1, c)
		}
	}
	require.Error(t, runOnce(dev, func(c *vk.Commands) error { return x.Record(c, most+1, 64, 8) }))
	require.Error(t, runOnce(dev, func(c *vk.Commands) error { return x.Record(c, 10, 8, 8) }))
}
