package sparse

import (
	"math"
	"math/rand"
	"sort"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/vk/vktest"
	"github.com/vksparse/vksparse/workload"
)

// TestTacticStepMatchesReference runs the GPU stages of a decode step on a
// generated layer: centroid scores against float64 products with the GPU's
// centroids, the token lists against the union of the clusters each head
// selects plus sinks and tail, and the output against AttendSubsetRef.
func TestTacticStepMatchesReference(t *testing.T) {
	dev := vktest.Open(t)
	const n, tail, sinks = 3000, 150, 4
	h := Heads{Query: 8, KV: 2, Dim: 64}
	cfg := workload.DefaultConfig(n)
	cfg.KVHeads, cfg.QHeads, cfg.HeadDim, cfg.Queries, cfg.Seed, cfg.Kinds = h.KV, h.Query, h.Dim, 2, rand.Int63(), nil
	tr, err := workload.Generate(cfg)
	require.NoError(t, err)
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
	step, err := NewTacticStep(dense, layer, clusters)
	require.NoError(t, err)
	defer step.Release()

	q := tr.Query(tr.Queries() - 1)
	d, scale := h.Dim, 1/math.Sqrt(float64(h.Dim))
	// Thresholds: each head keeps its 10 % best clusters by its own scores
	// (computed here from the GPU's centroids).
	index := make([]*kvcache.HostClusters, h.KV)
	for g := range index {
		index[g], err = clusters.Read(g)
		require.NoError(t, err)
	}
	want := make([][]float64, h.Query)
	th := make([]float32, h.Query)
	for hh := 0; hh < h.Query; hh++ {
		cent := index[hh/h.Group()].Centroids
		want[hh] = make([]float64, clusters.C)
		for c := range want[hh] {
			s := 0.0
			for i := 0; i < d; i++ {
				s += float64(q[hh*d+i]) * float64(cent[c*d+i])
			}
			want[hh][c] = scale * s
		}
		sorted := append([]float64(nil), want[hh]...)
		sort.Sort(sort.Reverse(sort.Float64Slice(sorted)))
		th[hh] = float32(sorted[clusters.C/10])
	}
	require.NoError(t, step.SetThresholds(th))
	require.NoError(t, dev.Run(func(c *vk.Commands) { c.Fill(step.plan.Output().All(), math.Float32bits(float32(math.NaN()))) }))
	got, err := step.Attend(q)
	require.NoError(t, err)

	scores, err := step.Scores()
	require.NoError(t, err)
	for hh := range want {
		for c, w := range want[hh] {
			require.InDelta(t, w, float64(scores[hh*clusters.C+c]), 1e-4*(1+math.Abs(w)), "score of head %d, cluster %d", hh, c)
		}
	}
	lists, err := step.Tokens()
	require.NoError(t, err)
	k, v := HalvesToFloat64(tr.K), HalvesToFloat64(tr.V)
	var ref []float64
	for g := 0; g < h.KV; g++ {
		var expect []int32
		for tok := 0; tok < sinks; tok++ {
			expect = append(expect, int32(tok))
		}
		for tok := n - tail; tok < n; tok++ {
			expect = append(expect, int32(tok))
		}
		for c, mem := range index[g].Members {
			for hh := g * h.Group(); hh < (g+1)*h.Group(); hh++ {
				if scores[hh*clusters.C+c] >= th[hh] {
					expect = append(expect, mem...)
					break
				}
			}
		}
		sort.Slice(expect, func(i, j int) bool { return expect[i] < expect[j] })
		have := append([]int32(nil), lists[g]...)
		sort.Slice(have, func(i, j int) bool { return have[i] < have[j] })
		require.Equal(t, expect, have, "token list of KV head %d", g)
		for hh := g * h.Group(); hh < (g+1)*h.Group(); hh++ {
			qh := make([]float64, d)
			for i := range qh {
				qh[i] = float64(q[hh*d+i])
			}
			o, err := AttendSubsetRef(qh, k[g*n*d:(g+1)*n*d], v[g*n*d:(g+1)*n*d], expect, scale)
			require.NoError(t, err)
			ref = append(ref, o...)
		}
	}
	requireClose(t, ref, got, d, 1e-3, "tactic step")
	require.Error(t, step.SetThresholds(th[:3]))
}
