package sparse

import (
	"fmt"
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
			plan, err := d.PlanLogits(layer)
			require.NoError(t, err)
			x, err := NewDeltaPages(plan, QuestPageSize)
			require.NoError(t, err)
			q := randomQueries(rng, tc.h.Query*tc.h.Dim, 1)
			_, err = plan.Attend(q)
			require.NoError(t, err)
			nan := math.Float32bits(float32(math.NaN()))
			require.NoError(t, dev.Run(func(c *vk.Commands) { c.Fill(x.Pages().All(), nan) }))
			// The logits the attention wrote, against float64 products.
			logits := make([]float32, tc.h.Query*n)
			require.NoError(t, plan.Logits().ReadFloat32(0, logits))
			for hh := 0; hh < tc.h.Query; hh++ {
				g := hh / tc.h.Group()
				for tok := 0; tok < n; tok += max(1, n/50) {
					want := 0.0
					for i := 0; i < tc.h.Dim; i++ {
						want += float64(q[hh*tc.h.Dim+i]) * k[(g*n+tok)*tc.h.Dim+i]
					}
					want /= math.Sqrt(float64(tc.h.Dim))
					require.InDelta(t, want, float64(logits[hh*n+tok]), 1e-3*(1+math.Abs(want)), "head %d token %d logit", hh, tok)
				}
			}
			out := make([]float32, len(q))
			require.NoError(t, plan.Output().ReadFloat32(0, out))
			dense, err := d.Plan([]*kvcache.Layer{layer})
			require.NoError(t, err)
			ref, err := dense.Attend(q)
			require.NoError(t, err)
			require.NoError(t, dense.Release())
			require.Equal(t, ref, out, "writing the logits leaves the output as it was")
			require.NoError(t, dev.Do(x.Record))
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
	require.Error(t, err, "a plan without logits")
	one, err := d.PlanLogits(a)
	require.NoError(t, err)
	defer one.Release()
	for _, size := range []int{0, -16, 3, 512} {
		_, err = NewDeltaPages(one, size)
		require.Error(t, err, "pages of %d", size)
	}
}

// TestDeltaSelectMatchesReference picks pages on the GPU from random
// scores with many ties (a few distinct values) and without, over page
// counts below and far above the budget, with the index poisoned first,
// and compares the pick, for every KV head, with DeltaSelectRef.
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
	for _, tc := range []struct{ pages, budget, recent, distinct, size int }{
		{1, 64, 8, 0, 16}, {5, 64, 8, 0, 16}, {64, 64, 8, 0, 16}, {65, 64, 8, 3, 16},
		{100, 10, 3, 0, 7}, {1000, 64, 8, 4, 16}, {most, 64, 8, 0, 16}, {most, 2, 1, 2, 1}, {300, 20, 0, 0, 16},
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
		for _, held := range []int{0, 64} { // scores in shared memory, or read from the buffer past 64
			x, err := newDeltaSelect(d, scores.All(), tc.pages, tc.budget, tc.recent, tc.size, held)
			require.NoError(t, err)
			nan := math.Float32bits(float32(math.NaN()))
			require.NoError(t, dev.Run(func(c *vk.Commands) { c.Fill(x.Index().Starts.All(), nan) }))
			require.NoError(t, dev.Do(x.Record))
			want, err := DeltaSelectRef(s64, tc.budget, tc.recent)
			require.NoError(t, err)
			got, err := x.Picked()
			require.NoError(t, err)
			what := fmt.Sprintf("%d pages, K %d, L %d, %d distinct scores, %d held", tc.pages, tc.budget, tc.recent, tc.distinct, held)
			require.Equal(t, want, got, what)
			starts, err := readInts(x.Index().Starts, h.KV*len(want))
			require.NoError(t, err)
			for g := 0; g < h.KV; g++ {
				for i, u := range want {
					require.Equal(t, u*tc.size, starts[g*len(want)+i], "%s: KV head %d pick %d", what, g, i)
				}
			}
			require.Equal(t, tc.pages*tc.size, x.Index().Count, what)
			require.NoError(t, x.Release())
		}
	}
	_, err = NewDeltaSelect(d, scores.All(), most+1, 64, 8, 16)
	require.Error(t, err, "more pages than scores")
	_, err = NewDeltaSelect(d, scores.All(), 10, 8, 8, 16)
	require.Error(t, err, "L = K")
}
