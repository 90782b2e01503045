package sparse

import (
	"fmt"
	"math"
	"math/rand"
	"sort"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/trace"
	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/vk/vktest"
	"github.com/vksparse/vksparse/workload"
)

// TestTacticStepMatchesReference runs whole GPU decode steps on a
// generated layer and checks each stage: centroid scores against float64
// products with the GPU's centroids, each head's cut against
// TacticBinnedBudgetRef on those scores, the token lists against the union
// of the selected clusters with sinks and tail, and the output against
// AttendSubsetRef over that union.
// generated returns a fresh generated layer of n tokens for heads h with
// the given decode queries, one head kind throughout.
func generated(t *testing.T, h Heads, n, queries int) *trace.Trace {
	t.Helper()
	cfg := workload.DefaultConfig(n)
	cfg.KVHeads, cfg.QHeads, cfg.HeadDim, cfg.Queries, cfg.Seed, cfg.Kinds = h.KV, h.Query, h.Dim, queries, rand.Int63(), nil
	tr, err := workload.Generate(cfg)
	require.NoError(t, err)
	return tr
}

func TestTacticStepMatchesReference(t *testing.T) {
	dev := vktest.Open(t)
	const n, tail, sinks = 4000, 150, 4
	h := Heads{Query: 8, KV: 2, Dim: 64}
	tr := generated(t, h, n, 2)
	layer, err := kvcache.NewLayer(dev, h.KV, h.Dim, n)
	require.NoError(t, err)
	defer layer.Release()
	require.NoError(t, layer.Prefill(tr.K, tr.V, n))
	km, err := NewKMeans(dev, h.KV, h.Dim)
	require.NoError(t, err)
	defer km.Release()
	clusters, err := km.Cluster(layer, sinks, n-tail-sinks, KMeansOptions{Seed: 7})
	require.NoError(t, err)
	defer clusters.Release()
	dense, err := NewDense(dev, h)
	require.NoError(t, err)
	defer dense.Release()
	index := make([]*ClusterIndex, h.KV)
	for g := range index {
		hc, err := clusters.Read(g)
		require.NoError(t, err)
		cent := make([]float64, len(hc.Centroids))
		for i, x := range hc.Centroids {
			cent[i] = float64(x)
		}
		index[g] = &ClusterIndex{D: h.Dim, Centroids: cent, Members: hc.Members}
		for _, mem := range hc.Members {
			index[g].Sizes = append(index[g].Sizes, len(mem))
		}
	}
	fixed, err := TacticFixedTokens(sinks, n-tail, n-1)
	require.NoError(t, err)
	k, v := HalvesToFloat64(tr.K), HalvesToFloat64(tr.V)
	d, scale := h.Dim, 1/math.Sqrt(float64(h.Dim))
	q := tr.Query(tr.Queries() - 1)

	for _, p := range []float64{0.5, 0.9, 1} {
		step, err := NewTacticStep(dense, layer, clusters, p, DefaultTacticFit())
		require.NoError(t, err)
		require.NoError(t, dev.Run(func(c *vk.Commands) { c.Fill(step.plan.Output().All(), math.Float32bits(float32(math.NaN()))) }))
		got, err := step.Attend(q)
		require.NoError(t, err)
		scores, err := step.Scores()
		require.NoError(t, err)
		cuts, err := step.Cuts()
		require.NoError(t, err)
		lists, err := step.Tokens()
		require.NoError(t, err)
		require.NoError(t, step.Release())
		t.Logf("P %v: cuts %v, union sizes %d and %d of %d", p, cuts, len(lists[0]), len(lists[1]), n)

		var ref []float64
		for g := 0; g < h.KV; g++ {
			keys := k[g*n*d : (g+1)*n*d]
			set := map[int32]bool{}
			for _, tok := range fixed {
				set[tok] = true
			}
			for hh := g * h.Group(); hh < (g+1)*h.Group(); hh++ {
				qh := make([]float64, d)
				for i := range qh {
					qh[i] = float64(q[hh*d+i])
				}
				hs := scores[hh*clusters.C : (hh+1)*clusters.C]
				for c, w := range hs {
					s := 0.0
					for i := 0; i < d; i++ {
						s += qh[i] * index[g].Centroids[c*d+i]
					}
					require.InDelta(t, scale*s, float64(w), 1e-4*(1+math.Abs(scale*s)), "P %v: score of head %d, cluster %d", p, hh, c)
				}
				_, cut, err := TacticBinnedBudgetRef(qh, scale, keys, index[g], hs, fixed, p, DefaultTacticFit())
				require.NoError(t, err)
				require.InDelta(t, cut, cuts[hh], 1, "P %v: cut of head %d (GPU %d, reference %d)", p, hh, cuts[hh], cut)
				m, u := TacticBinScale(hs)
				for c, x := range hs {
					if TacticBin(m, u, x) < cuts[hh] {
						for _, tok := range index[g].Members[c] {
							set[tok] = true
						}
					}
				}
			}
			var expect []int32
			for tok := range set {
				expect = append(expect, tok)
			}
			sort.Slice(expect, func(i, j int) bool { return expect[i] < expect[j] })
			have := append([]int32(nil), lists[g]...)
			sort.Slice(have, func(i, j int) bool { return have[i] < have[j] })
			require.Equal(t, expect, have, "P %v: token list of KV head %d", p, g)
			if p == 1 {
				require.Len(t, have, n, "P = 1 attends every token")
			}
			for hh := g * h.Group(); hh < (g+1)*h.Group(); hh++ {
				qh := make([]float64, d)
				for i := range qh {
					qh[i] = float64(q[hh*d+i])
				}
				o, err := AttendSubsetRef(qh, keys, v[g*n*d:(g+1)*n*d], expect, scale)
				require.NoError(t, err)
				ref = append(ref, o...)
			}
		}
		requireClose(t, ref, got, d, 1e-3, fmt.Sprintf("tactic step at P %v", p))
	}
	_, err = NewTacticStep(dense, layer, clusters, 0, DefaultTacticFit())
	require.Error(t, err, "P = 0")

	step, err := NewTacticStep(dense, layer, clusters, 0.9, DefaultTacticFit())
	require.NoError(t, err)
	defer step.Release()
	require.NoError(t, step.SetQuery(q))
	stages, total, err := step.TimeStages(1, 3)
	require.NoError(t, err)
	require.Len(t, stages, len(TacticStages))
	for i, s := range stages {
		require.Greater(t, s, time.Duration(0), "stage %s", TacticStages[i])
	}
	require.Greater(t, total, time.Duration(0))
	t.Logf("stages %v, step %v", stages, total)
}
