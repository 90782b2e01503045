package sparse

import (
	"math"
	"math/rand"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/vk/vktest"
	"github.com/vksparse/vksparse/workload"
)

// clusteredLayer loads a generated layer's keys into a cache and returns the
// decoded keys per head ([head][token*dim]).
func clusteredLayer(t *testing.T, dev *vk.Device, n, heads, dim int, seed int64) (*kvcache.Layer, [][]float64) {
	t.Helper()
	cfg := workload.DefaultConfig(n)
	cfg.KVHeads, cfg.QHeads, cfg.HeadDim, cfg.Queries, cfg.Seed = heads, heads, dim, 1, seed
	cfg.Kinds = nil
	tr, err := workload.Generate(cfg)
	require.NoError(t, err)
	layer, err := kvcache.NewLayer(dev, heads, dim, n)
	require.NoError(t, err)
	t.Cleanup(func() { layer.Release() })
	require.NoError(t, layer.Prefill(tr.K, tr.V, n))
	keys := make([][]float64, heads)
	for g := range keys {
		keys[g] = HalvesToFloat64(tr.K[g*n*dim : (g+1)*n*dim])
	}
	return layer, keys
}

// checkIndex verifies the structure of a head's index: members ascending,
// every token once, consistent with Assign, and centroids the float64 means
// of their members (empty clusters excepted) to float32 accuracy.
func checkIndex(t *testing.T, h *kvcache.HostClusters, keys []float64, dim, first, count int) {
	t.Helper()
	seen := make([]bool, count)
	for c, mem := range h.Members {
		mean := make([]float64, dim)
		for i, tok := range mem {
			r := int(tok) - first
			require.True(t, r >= 0 && r < count && !seen[r], "cluster %d lists token %d twice or outside the range", c, tok)
			seen[r] = true
			require.Equal(t, int32(c), h.Assign[r], "token %d listed in cluster %d but assigned to %d", tok, c, h.Assign[r])
			if i > 0 {
				require.Less(t, mem[i-1], tok, "cluster %d members not ascending", c)
			}
			for d := range mean {
				mean[d] += keys[int(tok)*dim+d] / float64(len(mem))
			}
		}
		if len(mem) == 0 {
			continue
		}
		for d := range mean {
			require.InDelta(t, mean[d], float64(h.Centroids[c*dim+d]), 1e-4*(1+math.Abs(mean[d])), "centroid %d dim %d (%d members %v)", c, d, len(mem), mem)
		}
	}
	for r, ok := range seen {
		require.True(t, ok, "token %d in no cluster", first+r)
	}
}

func sqDist64(a []float64, b []float32) float64 {
	s := 0.0
	for i := range a {
		d := a[i] - float64(b[i])
		s += d * d
	}
	return s
}

func TestKMeansFirstStepMatchesReference(t *testing.T) {
	dev := vktest.Open(t)
	for _, dim := range []int{64, 24} { // dimension steps of 16 and of 8
		kmeansFirstStep(t, dev, dim)
	}
}

func kmeansFirstStep(t *testing.T, dev *vk.Device, dim int) {
	const n, heads, first = 1500, 2, 4
	seed := uint64(rand.Int63())
	layer, keys := clusteredLayer(t, dev, n, heads, dim, int64(seed))
	km, err := NewKMeans(dev, heads, dim)
	require.NoError(t, err)
	defer km.Release()
	x, err := km.Cluster(layer, first, n-first, KMeansOptions{MaxIter: 1, Seed: seed})
	require.NoError(t, err)
	defer x.Release()
	count := n - first
	init, err := KMeansInit(count, x.C, seed)
	require.NoError(t, err)
	for g := 0; g < heads; g++ {
		got, err := x.Read(g)
		require.NoError(t, err)
		checkIndex(t, got, keys[g], dim, first, count)
		rows := keys[g][first*dim : n*dim]
		_, want, _, err := KMeansRef(rows, count, dim, init, 1)
		require.NoError(t, err)
		// A different choice is allowed only for a near tie between the two
		// initial centroids.
		ties := 0
		for r := range want {
			if got.Assign[r] == want[r] {
				continue
			}
			k := rows[r*dim : (r+1)*dim]
			a, b := init[got.Assign[r]], init[want[r]]
			da, db := 0.0, 0.0
			for d := range k {
				da += (k[d] - rows[a*dim+d]) * (k[d] - rows[a*dim+d])
				db += (k[d] - rows[b*dim+d]) * (k[d] - rows[b*dim+d])
			}
			require.InDelta(t, db, da, 1e-3*(1+db), "head %d token %d: GPU cluster %d (d² %g), reference %d (d² %g)", g, r, got.Assign[r], da, want[r], db)
			ties++
		}
		require.Less(t, ties, count/100, "too many near ties")
	}
}

func TestKMeansConvergesLikeReference(t *testing.T) {
	dev := vktest.Open(t)
	const n, heads, dim, first = 2000, 1, 32, 4
	seed := uint64(rand.Int63())
	layer, keys := clusteredLayer(t, dev, n, heads, dim, int64(seed))
	km, err := NewKMeans(dev, heads, dim)
	require.NoError(t, err)
	defer km.Release()
	count := n - first
	x, err := km.Cluster(layer, first, count, KMeansOptions{Seed: seed})
	require.NoError(t, err)
	defer x.Release()
	require.GreaterOrEqual(t, x.Iterations, 2)
	require.LessOrEqual(t, x.Iterations, KMeansDefaultIters)
	got, err := x.Read(0)
	require.NoError(t, err)
	checkIndex(t, got, keys[0], dim, first, count)

	rows := keys[0][first*dim : n*dim]
	init, _ := KMeansInit(count, x.C, seed)
	refCent, refAssign, _, err := KMeansRef(rows, count, dim, init, KMeansDefaultIters)
	require.NoError(t, err)
	wcss := func(assign []int32, cent func(c int) []float32) float64 {
		s := 0.0
		for r, c := range assign {
			s += sqDist64(rows[r*dim:(r+1)*dim], cent(int(c)))
		}
		return s
	}
	gpu := wcss(got.Assign, func(c int) []float32 { return got.Centroids[c*dim : (c+1)*dim] })
	ref32 := make([]float32, len(refCent))
	for i, v := range refCent {
		ref32[i] = float32(v)
	}
	ref := wcss(refAssign, func(c int) []float32 { return ref32[c*dim : (c+1)*dim] })
	require.InEpsilon(t, ref, gpu, 0.02, "within-cluster sum of squares: GPU %g, reference %g", gpu, ref)

	// Deterministic for a seed on a device.
	y, err := km.Cluster(layer, first, count, KMeansOptions{Seed: seed})
	require.NoError(t, err)
	defer y.Release()
	again, err := y.Read(0)
	require.NoError(t, err)
	require.Equal(t, got.Assign, again.Assign)
	require.Equal(t, got.Centroids, again.Centroids)
}

func TestKMeansRejectsBadInput(t *testing.T) {
	dev := vktest.Open(t)
	_, err := NewKMeans(dev, 2, 60)
	require.Error(t, err)
	km, err := NewKMeans(dev, 2, 64)
	require.NoError(t, err)
	defer km.Release()
	layer, err := kvcache.NewLayer(dev, 2, 64, 100)
	require.NoError(t, err)
	defer layer.Release()
	_, err = km.Cluster(layer, 0, 10, KMeansOptions{})
	require.ErrorContains(t, err, "cache of 0", "nothing stored yet")
	other, err := kvcache.NewLayer(dev, 1, 64, 100)
	require.NoError(t, err)
	defer other.Release()
	_, err = km.Cluster(other, 0, 10, KMeansOptions{})
	require.ErrorContains(t, err, "heads")
}

// TestKMeansOddDimension covers a head dimension that is not a multiple of
// 16 (dimension steps of 8).
func TestKMeansOddDimension(t *testing.T) {
	dev := vktest.Open(t)
	const n, heads, dim, first = 700, 1, 24, 0
	seed := uint64(rand.Int63())
	layer, keys := clusteredLayer(t, dev, n, heads, dim, int64(seed))
	km, err := NewKMeans(dev, heads, dim)
	require.NoError(t, err)
	defer km.Release()
	x, err := km.Cluster(layer, first, n, KMeansOptions{AvgClusterSize: 10, Seed: seed})
	require.NoError(t, err)
	defer x.Release()
	got, err := x.Read(0)
	require.NoError(t, err)
	checkIndex(t, got, keys[0], dim, first, n)
}
