package sparse

import (
	"math"
	"math/rand"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/x448/float16"

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
			da, db := initDistances(rows, dim, r, int(init[got.Assign[r]]), int(init[want[r]]))
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

// TestKMeansTensorMatchesFloat32 compares, where the device has the
// cooperative-matrix assignment, its first step with the float32 path's:
// from the same initial centroids, a token may go elsewhere only in a near
// tie. Both must be deterministic.
func TestKMeansTensorMatchesFloat32(t *testing.T) {
	dev := vktest.Open(t)
	for _, dim := range []int{128, 64} {
		km, err := NewKMeans(dev, 2, dim)
		require.NoError(t, err)
		defer km.Release()
		if !km.Tensor() {
			t.Skip("no cooperative-matrix assignment on this device")
		}
		const n, heads, first = 3001, 2, 3
		seed := uint64(rand.Int63())
		layer, keys := clusteredLayer(t, dev, n, heads, dim, int64(seed))
		count := n - first
		run := func(tensor bool, iters int) []*kvcache.HostClusters {
			require.Equal(t, tensor, km.SetTensor(tensor))
			x, err := km.Cluster(layer, first, count, KMeansOptions{MaxIter: iters, Seed: seed})
			require.NoError(t, err)
			defer x.Release()
			var out []*kvcache.HostClusters
			for g := 0; g < heads; g++ {
				h, err := x.Read(g)
				require.NoError(t, err)
				checkIndex(t, h, keys[g], dim, first, count)
				out = append(out, h)
			}
			return out
		}
		tc, sc := run(true, 1), run(false, 1)
		init, err := KMeansInit(count, clusterCountOrDie(t, count), seed)
		require.NoError(t, err)
		for g := 0; g < heads; g++ {
			rows := keys[g][first*dim : n*dim]
			diff := 0
			for r := range tc[g].Assign {
				a, b := tc[g].Assign[r], sc[g].Assign[r]
				if a == b {
					continue
				}
				da, db := initDistances(rows, dim, r, int(init[a]), int(init[b]))
				require.InDelta(t, db, da, 1e-4*(1+db), "dim %d head %d token %d: tensor cluster %d (d² %g), float32 %d (d² %g)", dim, g, r, a, da, b, db)
				diff++
			}
			require.Less(t, diff, count/1000+2, "dim %d head %d: too many near ties", dim, g)
		}
		// Converged runs: deterministic, and as good as the float32 path.
		a, b := run(true, 0), run(true, 0)
		for g := range a {
			require.Equal(t, a[g].Assign, b[g].Assign)
			require.Equal(t, a[g].Centroids, b[g].Centroids)
		}
		km.SetTensor(true)
	}
}

func clusterCountOrDie(t *testing.T, n int) int {
	t.Helper()
	c, err := KMeansClusterCount(n, KMeansDefaultAvgClusterSize)
	require.NoError(t, err)
	return c
}

// TestKMeansLargeCluster gives 1900 tokens the same key, so that one
// cluster takes them all: its member list is longer than the sort ranks in
// shared memory and must still come out ascending, and the same in a
// second run.
func TestKMeansLargeCluster(t *testing.T) {
	dev := vktest.Open(t)
	const n, dim, same = 2600, 32, 1900
	rng := rand.New(rand.NewSource(int64(rand.Int63())))
	k := make([]uint16, n*dim)
	v := make([]uint16, n*dim)
	for i := range k {
		x := float32(0.5)
		if i >= same*dim {
			x = float32(rng.NormFloat64())
		}
		k[i] = float16.Fromfloat32(x).Bits()
	}
	layer, err := kvcache.NewLayer(dev, 1, dim, n)
	require.NoError(t, err)
	defer layer.Release()
	require.NoError(t, layer.Prefill(k, v, n))
	km, err := NewKMeans(dev, 1, dim)
	require.NoError(t, err)
	defer km.Release()
	for _, tensor := range []bool{false, true} {
		if km.SetTensor(tensor) != tensor {
			continue
		}
		var runs [2]*kvcache.HostClusters
		for r := range runs {
			x, err := km.Cluster(layer, 0, n, KMeansOptions{MaxIter: 3, Seed: 7})
			require.NoError(t, err)
			runs[r], err = x.Read(0)
			require.NoError(t, err)
			x.Release()
		}
		got := runs[0]
		checkIndex(t, got, HalvesToFloat64(k), dim, 0, n)
		longest := 0
		for _, m := range got.Members {
			longest = max(longest, len(m))
		}
		require.GreaterOrEqual(t, longest, same, "tensor %v", tensor)
		require.Equal(t, got, runs[1], "tensor %v: a second run differs", tensor)
	}
}

// TestKMeansLargeClustersHeads has clusters longer than the shared-memory
// sort in two heads, two of them in head 1 (alternate tokens share one of
// two keys), over a range that starts past token 0.
func TestKMeansLargeClustersHeads(t *testing.T) {
	dev := vktest.Open(t)
	const n, dim, heads, first = 2600, 32, 2, 5
	rng := rand.New(rand.NewSource(int64(rand.Int63())))
	k := make([]uint16, heads*n*dim)
	v := make([]uint16, heads*n*dim)
	for g := 0; g < heads; g++ {
		for tok := 0; tok < n; tok++ {
			for d := 0; d < dim; d++ {
				x := float32(rng.NormFloat64())
				switch {
				case g == 0 && tok < 1900:
					x = 0.5
				case g == 1 && tok < 2400:
					x = float32(1 - 2*(tok%2)) // 1 or -1
				}
				k[(g*n+tok)*dim+d] = float16.Fromfloat32(x).Bits()
			}
		}
	}
	layer, err := kvcache.NewLayer(dev, heads, dim, n)
	require.NoError(t, err)
	defer layer.Release()
	require.NoError(t, layer.Prefill(k, v, n))
	km, err := NewKMeans(dev, heads, dim)
	require.NoError(t, err)
	defer km.Release()
	for _, tensor := range []bool{false, true} {
		if km.SetTensor(tensor) != tensor {
			continue
		}
		var runs [2][]*kvcache.HostClusters
		for r := range runs {
			x, err := km.Cluster(layer, first, n-first, KMeansOptions{MaxIter: 3, Seed: 7})
			require.NoError(t, err)
			for g := 0; g < heads; g++ {
				got, err := x.Read(g)
				require.NoError(t, err)
				runs[r] = append(runs[r], got)
			}
			x.Release()
		}
		for g := 0; g < heads; g++ {
			got := runs[0][g]
			checkIndex(t, got, HalvesToFloat64(k[g*n*dim:(g+1)*n*dim]), dim, first, n-first)
			long := 0
			for _, m := range got.Members {
				if len(m) > 1024 {
					long++
				}
			}
			require.Equal(t, g+1, long, "tensor %v head %d: clusters of more than 1024 members", tensor, g)
			require.Equal(t, got, runs[1][g], "tensor %v head %d: a second run differs", tensor, g)
		}
	}
}

// initDistances returns the squared distances of row r of rows (of
// dimension dim) to rows a and b, the initial centroids a near tie is
// judged between.
func initDistances(rows []float64, dim, r, a, b int) (da, db float64) {
	k := rows[r*dim : (r+1)*dim]
	for d := range k {
		ea, eb := k[d]-rows[a*dim+d], k[d]-rows[b*dim+d]
		da, db = da+ea*ea, db+eb*eb
	}
	return da, db
}
