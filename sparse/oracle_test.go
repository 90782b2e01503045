package sparse

import (
	"fmt"
	"math"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestTokenOracleStepMatchesReference runs the token oracle (single-token
// index over the middle) and checks each stage against float64, with
// groups of 4, 3 and 8 (a block's heads cut one after another).
func TestTokenOracleStepMatchesReference(t *testing.T) {
	for _, h := range []Heads{{8, 2, 64}, {6, 2, 64}, {16, 2, 32}} {
		t.Run(fmt.Sprintf("%d-%d-%d", h.Query, h.KV, h.Dim), func(t *testing.T) {
			checkTokenOracle(t, newBaselineFixtureOf(t, h, 3000))
		})
	}
}

// checkTokenOracle is TestTokenOracleStepMatchesReference on f.
func checkTokenOracle(t *testing.T, f *baselineFixture) {
	for _, p := range []float64{0.5, 0.9, 1} {
		step, err := NewTokenOracleStep(f.dense, f.layer, p)
		require.NoError(t, err)
		checkOracleStep(t, f, step, p, fmt.Sprintf("token oracle p %v", p), func(g int, qs [][]float64, keys, values []float64) int {
			_, tokens, _, err := TokenOracleDecodeRef(qs, keys, values, f.scale, f.fixed, p)
			require.NoError(t, err)
			return len(tokens)
		})
	}
}

// TestClusterOracleStepMatchesReference runs the cluster oracle over
// K-means clusters of the middle, the layer in cluster order, and checks
// each stage against float64.
func TestClusterOracleStepMatchesReference(t *testing.T) {
	f := newBaselineFixture(t, 3000)
	km, err := NewKMeans(f.dev, f.h.KV, f.h.Dim)
	require.NoError(t, err)
	defer km.Release()
	clusters, err := km.Cluster(f.layer, f.lo, f.hi-f.lo, KMeansOptions{Seed: 5})
	require.NoError(t, err)
	defer clusters.Release()
	require.NoError(t, f.layer.Reorder(clusters))
	index := hostIndex(t, clusters)
	for _, p := range []float64{0.5, 0.9, 1} {
		step, err := NewClusterOracleStep(f.dense, f.layer, clusters, p)
		require.NoError(t, err)
		checkOracleStep(t, f, step, p, fmt.Sprintf("cluster oracle p %v", p), func(g int, qs [][]float64, keys, values []float64) int {
			_, tokens, _, err := ClusterOracleDecodeRef(qs, keys, values, f.scale, index[g], f.fixed, p)
			require.NoError(t, err)
			return len(tokens)
		})
	}
}

// checkOracleStep runs an oracle step (its selection poisoned) and checks
// its selection against float64: every cluster's log mass
// (ClusterLogMassRef), each cluster's bin and each head's cut
// (BinnedTopPRef of the GPU's scores, up to the rounding of the
// fixed-point masses at the boundary); p = 1 attends every token. It logs
// the size of the exact oracle's union (exact) beside the GPU's, and
// releases the step. The output is the conformance suite's to check.
func checkOracleStep(t *testing.T, f *baselineFixture, step *Step, p float64, what string, exact func(g int, qs [][]float64, keys, values []float64) int) {
	t.Helper()
	h, d := f.h, f.h.Dim
	sel := step.Selector().(*OracleSelector)
	x := sel.clusters
	f.run(t, step, sel.score, sel.binOf, sel.cut)
	scores, err := sel.Scores()
	require.NoError(t, err)
	bins, err := sel.Bins()
	require.NoError(t, err)
	cuts, err := sel.Cuts()
	require.NoError(t, err)
	index := hostIndex(t, x)
	require.NoError(t, step.Release())
	t.Logf("%s: cuts %v (bins)", what, cuts)
	for g := 0; g < h.KV; g++ {
		keys, values := f.kv(g)
		qs := f.queryHeadsOf(g)
		var ranks [][]int
		var cs []int
		for j, q := range qs {
			hh := g*h.Group() + j
			ref, err := ClusterLogMassRef(q, keys, f.scale, index[g])
			require.NoError(t, err)
			row := scores[hh*x.C : (hh+1)*x.C]
			mine := make([]float64, len(row))
			for c, s := range row {
				mine[c] = float64(s)
				if math.IsInf(ref[c], -1) {
					require.True(t, math.IsInf(mine[c], -1), "%s head %d: empty cluster %d scores %v", what, hh, c, s)
					continue
				}
				require.InDelta(t, ref[c], mine[c], 1e-4*(1+math.Abs(ref[c])), "%s head %d: log mass of cluster %d", what, hh, c)
			}
			fixed, err := ClusterLogMassRef(q, keys, f.scale, &ClusterIndex{D: d, Members: [][]int32{f.fixed}})
			require.NoError(t, err)
			rank, cut := BinnedTopPRef(row, fixed[0], p)
			require.Equal(t, rank, bins[hh*x.C:(hh+1)*x.C], "%s head %d: bins", what, hh)
			requireBinnedCut(t, mine, rank, fixed[0], p, cuts[hh], cut, fmt.Sprintf("%s head %d", what, hh))
			ranks, cs = append(ranks, rank), append(cs, cuts[hh])
		}
		_, tokens, err := SelectionGroupRef(qs, keys, values, f.scale, index[g], f.fixed, ranks, cs)
		require.NoError(t, err)
		t.Logf("%s KV head %d: %d of %d tokens (the exact oracle %d)", what, g, len(tokens), f.n, exact(g, qs, keys, values))
		if p == 1 {
			require.Len(t, tokens, f.n, "p = 1 attends every token")
		}
	}
}

// requireBinnedCut checks the GPU's top-p cut against BinnedTopPRef's,
// want: equal, or, where the fixed-point masses round the other way, a
// cut whose defining mass lies within 1e-4 of the target.
func requireBinnedCut(t *testing.T, scores []float64, rank []int, fixed, p float64, got, want int, what string) {
	t.Helper()
	if got == want {
		return
	}
	best := math.Inf(-1)
	for _, x := range scores {
		best = max(best, x)
	}
	below := func(cut int) float64 {
		s := 0.0
		for c, x := range scores {
			if rank[c] < cut {
				s += math.Exp(x - best)
			}
		}
		return s
	}
	total, f := below(ScoreBins), math.Exp(fixed-best)
	target := BinnedTopPTarget(total, f, p)
	require.InDelta(t, target, below(min(got, want)), 1e-4*(total+f), "%s: GPU cut %d, float64 %d", what, got, want)
}
