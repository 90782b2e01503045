package sparse

import (
	"fmt"
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/vk/vktest"
)

// baselineFixture is a generated layer in positional order with its
// float64 keys and values and one query.
type baselineFixture struct {
	dev          *vk.Device
	h            Heads
	n            int
	layer        *kvcache.Layer
	dense        *Dense
	k, v         []float64
	q            []float32
	scale        float64
	lo, hi       int     // the middle
	fixed        []int32 // the sinks and the window
	queryHeadsOf func(g int) [][]float64
}

func newBaselineFixture(t *testing.T, n int) *baselineFixture {
	return newBaselineFixtureOf(t, Heads{Query: 8, KV: 2, Dim: 64}, n)
}

// newBaselineFixtureOf is newBaselineFixture for heads h.
func newBaselineFixtureOf(t *testing.T, h Heads, n int) *baselineFixture {
	dev := vktest.Open(t)
	tr := generated(t, h, n, 2)
	layer, err := kvcache.NewLayer(dev, h.KV, h.Dim, n)
	require.NoError(t, err)
	t.Cleanup(func() { layer.Release() })
	require.NoError(t, layer.Prefill(tr.K, tr.V, n))
	dense, err := NewDense(dev, h)
	require.NoError(t, err)
	t.Cleanup(func() { dense.Release() })
	f := &baselineFixture{dev: dev, h: h, n: n, layer: layer, dense: dense,
		k: HalvesToFloat64(tr.K), v: HalvesToFloat64(tr.V), q: tr.Query(tr.Queries() - 1), scale: 1 / math.Sqrt(float64(h.Dim))}
	f.lo, f.hi = DefaultBaselineLayout().Middle(n)
	f.fixed = DefaultBaselineLayout().Fixed(n)
	f.queryHeadsOf = func(g int) [][]float64 {
		var qs [][]float64
		for hh := g * h.Group(); hh < (g+1)*h.Group(); hh++ {
			qh := make([]float64, h.Dim)
			for i := range qh {
				qh[i] = float64(f.q[hh*h.Dim+i])
			}
			qs = append(qs, qh)
		}
		return qs
	}
	return f
}

// kv returns KV head g's keys and values.
func (f *baselineFixture) kv(g int) (keys, values []float64) {
	w := f.n * f.h.Dim
	return f.k[g*w : (g+1)*w], f.v[g*w : (g+1)*w]
}

// run poisons the outputs (NaN) and attends once. That counters and
// extremes are reset between steps is the conformance suite's to check.
func (f *baselineFixture) run(t *testing.T, step *Step, poison ...*vk.Buffer) []float32 {
	t.Helper()
	nan := math.Float32bits(float32(math.NaN()))
	require.NoError(t, f.dev.Run(func(c *vk.Commands) {
		for _, b := range append(poison, step.Output()) {
			c.Fill(b.All(), nan)
		}
	}))
	got, err := step.Attend(f.q)
	require.NoError(t, err)
	return got
}

// TestQuestStepMatchesReference runs Quest steps (pages of 16 over the
// middle of 4 sinks and a 64-token window) and checks each stage against
// float64: the pages' key minima and maxima (QuestPagesRef, exactly), each
// page's bound (scale·BoundsRef), the bins and cut (BinnedTopKRef of the
// GPU's bounds, exactly), that the pages taken include Quest's exact top k
// (QuestSelectRef) up to near-ties; a budget covering the middle attends
// every token. The output is the conformance suite's to check.
func TestQuestStepMatchesReference(t *testing.T) {
	// Groups of 4 (one block, its heads cut together), 1, 3 (cut two and
	// one), 8 (a block cut in two chunks) and 16 (two blocks).
	for _, h := range []Heads{{8, 2, 64}, {8, 8, 32}, {6, 2, 64}, {16, 2, 64}, {32, 2, 16}} {
		t.Run(fmt.Sprintf("%d-%d-%d", h.Query, h.KV, h.Dim), func(t *testing.T) {
			checkQuestStep(t, newBaselineFixtureOf(t, h, 3000))
		})
	}
}

// checkQuestStep is TestQuestStepMatchesReference on f.
func checkQuestStep(t *testing.T, f *baselineFixture) {
	h, d := f.h, f.h.Dim
	for _, budget := range []int{15, 100, 512, f.hi - f.lo} { // 15: less than a page, none taken
		step, err := NewQuestStep(f.dense, f.layer, budget)
		require.NoError(t, err)
		sel := step.Selector().(*QuestSelector)
		x := sel.clusters
		f.run(t, step, sel.score, sel.binOf, sel.cut)
		scores, err := sel.Scores()
		require.NoError(t, err)
		bins, err := sel.Bins()
		require.NoError(t, err)
		cuts, err := sel.Cuts()
		require.NoError(t, err)
		lo, hi, err := sel.Bounds()
		require.NoError(t, err)
		index := hostIndex(t, x)
		require.NoError(t, step.Release())
		k := budget / QuestPageSize
		if budget >= f.hi-f.lo {
			k = x.C
		}
		t.Logf("budget %d (%d pages of %d): cuts %v (bins)", budget, k, x.C, cuts)

		for g := 0; g < h.KV; g++ {
			keys, values := f.kv(g)
			pages, err := QuestPagesRef(keys, d, f.lo, f.hi, QuestPageSize)
			require.NoError(t, err)
			require.Equal(t, x.C, pages.Pages())
			span := x.C * d
			requireNear(t, pages.Min, lo[g*span:(g+1)*span], 0, fmt.Sprintf("key minima of KV head %d", g))
			requireNear(t, pages.Max, hi[g*span:(g+1)*span], 0, fmt.Sprintf("key maxima of KV head %d", g))
			qs := f.queryHeadsOf(g)
			var ranks [][]int
			var cs []int
			for j, q := range qs {
				hh := g*h.Group() + j
				u, err := pages.BoundsRef(q)
				require.NoError(t, err)
				for i := range u {
					u[i] *= f.scale
				}
				row := scores[hh*x.C : (hh+1)*x.C]
				requireNear(t, u, row, 1e-5, fmt.Sprintf("budget %d head %d: page bounds", budget, hh))
				rank, cut := BinnedTopKRef(row, k)
				require.Equal(t, rank, bins[hh*x.C:(hh+1)*x.C], "head %d: bins", hh)
				require.Equal(t, cut, cuts[hh], "head %d: cut", hh)
				taken, least := 0, math.Inf(1)
				for c, r := range rank {
					if r < cut {
						taken++
						least = min(least, u[c])
					}
				}
				require.GreaterOrEqual(t, taken, k, "head %d takes whole bins", hh)
				exact, err := QuestSelectRef(q, pages, budget)
				require.NoError(t, err)
				for _, tok := range exact {
					c := (int(tok) - f.lo) / QuestPageSize
					if rank[c] >= cut {
						require.InDelta(t, least, u[c], 1e-5*(1+math.Abs(least)), "head %d: page %d of Quest's top %d not taken", hh, c, k)
					}
				}
				ranks, cs = append(ranks, rank), append(cs, cut)
			}
			_, tokens, err := SelectionGroupRef(qs, keys, values, f.scale, index[g], f.fixed, ranks, cs)
			require.NoError(t, err)
			t.Logf("KV head %d: %d of %d tokens", g, len(tokens), f.n)
			if budget >= f.hi-f.lo {
				require.Len(t, tokens, f.n, "a budget covering the middle attends every token")
			}
		}
	}
}
