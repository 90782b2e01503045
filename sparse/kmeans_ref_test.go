package sparse

import (
	"math"
	"math/rand/v2"
	"runtime"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func randMatrix(r *rand.Rand, n, d int) []float64 {
	m := make([]float64, n*d)
	for i := range m {
		m[i] = r.NormFloat64()
	}
	return m
}

// blobs returns n rows around c random centres (so K-means has structure).
func blobs(r *rand.Rand, n, d, c int) []float64 {
	centres := randMatrix(r, c, d)
	m := make([]float64, n*d)
	for i := 0; i < n; i++ {
		j := r.IntN(c)
		for k := 0; k < d; k++ {
			m[i*d+k] = 4*centres[j*d+k] + r.NormFloat64()
		}
	}
	return m
}

func plainSqDist(x, y []float64) float64 {
	s := 0.0
	for k := range x {
		s += (x[k] - y[k]) * (x[k] - y[k])
	}
	return s
}

// requireNearest checks that every row's cluster is a nearest centroid,
// with ties resolved to the lowest index (up to a relative 1e-12, since the
// reference sums in a different order).
func requireNearest(t *testing.T, keys []float64, n, d int, centroids []float64, assign []int32) {
	t.Helper()
	c := len(centroids) / d
	for r := 0; r < n; r++ {
		x := keys[r*d : (r+1)*d]
		best, bestD := 0, math.Inf(1)
		for j := 0; j < c; j++ {
			if dj := plainSqDist(x, centroids[j*d:(j+1)*d]); dj < bestD {
				best, bestD = j, dj
			}
		}
		got := plainSqDist(x, centroids[int(assign[r])*d:int(assign[r]+1)*d])
		require.LessOrEqualf(t, got, bestD*(1+1e-12), "row %d: cluster %d at %v, cluster %d at %v", r, assign[r], got, best, bestD)
	}
}

// requireMeans checks that every non-empty centroid is the mean of its
// members and returns the member counts.
func requireMeans(t *testing.T, keys []float64, n, d int, centroids []float64, assign []int32) []int {
	t.Helper()
	c := len(centroids) / d
	sums := make([]float64, c*d)
	counts := make([]int, c)
	for r := 0; r < n; r++ {
		counts[assign[r]]++
		for k := 0; k < d; k++ {
			sums[int(assign[r])*d+k] += keys[r*d+k]
		}
	}
	for j := 0; j < c; j++ {
		if counts[j] == 0 {
			continue
		}
		for k := 0; k < d; k++ {
			require.InDeltaf(t, sums[j*d+k]/float64(counts[j]), centroids[j*d+k], 1e-12, "cluster %d dim %d", j, k)
		}
	}
	return counts
}

func TestSplitMix64KnownValues(t *testing.T) {
	// Reference outputs of splitmix64 seeded with 0 and 1234567.
	s := SplitMix64{}
	assert.Equal(t, uint64(0xe220a8397b1dcdaf), s.Next())
	assert.Equal(t, uint64(0x6e789e6aa1b965f4), s.Next())
	s = SplitMix64{State: 1234567}
	assert.Equal(t, uint64(6457827717110365317), s.Next())
	assert.Equal(t, uint64(3203168211198807973), s.Next())
}

func TestKMeansInit(t *testing.T) {
	init, err := KMeansInit(1000, 63, 42)
	require.NoError(t, err)
	require.Len(t, init, 63)
	seen := map[int]bool{}
	for _, r := range init {
		require.True(t, r >= 0 && r < 1000)
		require.False(t, seen[r], "repeated index %d", r)
		seen[r] = true
	}
	again, err := KMeansInit(1000, 63, 42)
	require.NoError(t, err)
	assert.Equal(t, init, again)
	other, err := KMeansInit(1000, 63, 43)
	require.NoError(t, err)
	assert.NotEqual(t, init, other)

	// The definition step by step for n = 5, clusters = 2.
	rng := SplitMix64{State: 7}
	perm := []int{0, 1, 2, 3, 4}
	for i := 0; i < 2; i++ {
		j := i + int(rng.Next()%uint64(5-i))
		perm[i], perm[j] = perm[j], perm[i]
	}
	got, err := KMeansInit(5, 2, 7)
	require.NoError(t, err)
	assert.Equal(t, perm[:2], got)

	all, err := KMeansInit(10, 10, 1)
	require.NoError(t, err)
	assert.ElementsMatch(t, []int{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, all)

	_, err = KMeansInit(3, 4, 1)
	assert.Error(t, err)
	_, err = KMeansInit(-1, 0, 1)
	assert.Error(t, err)
}

func TestKMeansClusterCount(t *testing.T) {
	for _, c := range []struct{ n, size, want int }{{16320, 16, 1020}, {16316, 16, 1020}, {17, 16, 2}, {16, 16, 1}, {0, 16, 0}} {
		got, err := KMeansClusterCount(c.n, c.size)
		require.NoError(t, err)
		assert.Equal(t, c.want, got, "n=%d size=%d", c.n, c.size)
	}
	_, err := KMeansClusterCount(10, 0)
	assert.Error(t, err)
}

func TestKMeansRefConvergedMatchesBruteForce(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	const n, d, c = 400, 6, 12
	keys := blobs(r, n, d, 8)
	init, err := KMeansInit(n, c, 99)
	require.NoError(t, err)
	cent, assign, iters, err := KMeansRef(keys, n, d, init, 1000)
	require.NoError(t, err)
	require.Less(t, iters, 1000, "did not converge")
	require.Len(t, cent, c*d)
	require.Len(t, assign, n)
	requireNearest(t, keys, n, d, cent, assign)
	requireMeans(t, keys, n, d, cent, assign)
}

func TestKMeansRefUnconverged(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	const n, d, c = 500, 5, 40
	keys := randMatrix(r, n, d)
	init, err := KMeansInit(n, c, 5)
	require.NoError(t, err)
	prev, _, it1, err := KMeansRef(keys, n, d, init, 2)
	require.NoError(t, err)
	require.Equal(t, 2, it1)
	cent, assign, it2, err := KMeansRef(keys, n, d, init, 3)
	require.NoError(t, err)
	require.Equal(t, 3, it2)
	// The final assignment is nearest to the centroids before the last
	// update, and the final centroids are the means of the final members.
	requireNearest(t, keys, n, d, prev, assign)
	requireMeans(t, keys, n, d, cent, assign)
}

func TestKMeansRefEmptyClusterKeepsCentroid(t *testing.T) {
	// Clusters 0 and 2 both start at row 2; cluster 2 loses every tie, stays
	// empty and keeps its initial centroid.
	keys := []float64{0, 0, 1, 0, 10, 10}
	cent, assign, iters, err := KMeansRef(keys, 3, 2, []int{2, 0, 2}, 10)
	require.NoError(t, err)
	assert.Equal(t, []int32{1, 1, 0}, assign)
	assert.Equal(t, []float64{10, 10, 0.5, 0, 10, 10}, cent)
	assert.Equal(t, 2, iters)
}

func TestKMeansRefTiesGoToLowestIndex(t *testing.T) {
	// Row 2 is equidistant from rows 0 and 1; with maxIter 1 the centroids
	// stay at the initial rows, so the tie is visible.
	keys := []float64{-1, 0, 1, 0, 0, 3}
	_, assign, _, err := KMeansRef(keys, 3, 2, []int{1, 0}, 1)
	require.NoError(t, err)
	assert.Equal(t, []int32{1, 0, 0}, assign)
}

func TestKMeansRefDeterministic(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	const n, d, c = 3000, 8, 190
	keys := blobs(r, n, d, 50)
	init, err := KMeansInit(n, c, 11)
	require.NoError(t, err)
	c1, a1, i1, err := KMeansRef(keys, n, d, init, 10)
	require.NoError(t, err)
	old := runtime.GOMAXPROCS(1)
	c2, a2, i2, err := KMeansRef(keys, n, d, init, 10)
	runtime.GOMAXPROCS(old)
	require.NoError(t, err)
	assert.Equal(t, c1, c2)
	assert.Equal(t, a1, a2)
	assert.Equal(t, i1, i2)
}

// TestKMeansAssignPruningIsExact compares the pruned assignment with the
// definition computed without pruning: every distance in the documented
// summation order, the least one taken, ties to the lowest cluster. Rows
// and centroids lie on an integer grid, so distances are exact and ties
// are common; the previous clusters (the search's starting points) are
// random.
func TestKMeansAssignPruningIsExact(t *testing.T) {
	r := rand.New(rand.NewPCG(13, 14))
	for _, d := range []int{3, 13, 16, 40, 128} {
		const n, c = 700, 45
		keys := blobs(r, n, d, 9)
		for i := range keys {
			keys[i] = math.Round(keys[i] / 2)
		}
		centroids := make([]float64, 0, c*d)
		for j := 0; j < c; j++ {
			row := r.IntN(n)
			centroids = append(centroids, keys[row*d:(row+1)*d]...)
		}
		prev := make([]int32, n)
		for i := range prev {
			prev[i] = int32(r.IntN(c+1) - 1)
		}
		perm := kmeansPruneOrder(keys, n, d)
		got := make([]int32, n)
		kmeansAssign(keys, permuteRows(keys, d, perm), n, d, centroids, permuteRows(centroids, d, perm), prev, got)
		ties := 0
		for row := 0; row < n; row++ {
			x := keys[row*d : (row+1)*d]
			want, wantD := 0, math.Inf(1)
			for j := 0; j < c; j++ {
				dj := sqDist(x, centroids[j*d:(j+1)*d], -1)
				if dj == wantD {
					ties++
				}
				if dj < wantD {
					want, wantD = j, dj
				}
			}
			require.Equalf(t, int32(want), got[row], "d=%d row %d", d, row)
		}
		if d <= 16 {
			require.Greater(t, ties, 0, "d=%d: no ties tested", d)
		}
	}
}

func TestKMeansRefErrors(t *testing.T) {
	keys := []float64{1, 2, 3, 4}
	for name, f := range map[string]func() error{
		"shape":   func() error { _, _, _, err := KMeansRef(keys, 3, 2, []int{0}, 1); return err },
		"noinit":  func() error { _, _, _, err := KMeansRef(keys, 2, 2, nil, 1); return err },
		"badinit": func() error { _, _, _, err := KMeansRef(keys, 2, 2, []int{2}, 1); return err },
		"iters":   func() error { _, _, _, err := KMeansRef(keys, 2, 2, []int{0}, 0); return err },
	} {
		assert.Error(t, f(), name)
	}
}

func TestNewClusterIndex(t *testing.T) {
	cent := []float64{1, 1, 2, 2, 3, 3}
	x, err := NewClusterIndex(cent, 2, []int32{2, 0, 2, 0, 0}, 10)
	require.NoError(t, err)
	assert.Equal(t, 3, x.Clusters())
	assert.Equal(t, 5, x.Tokens())
	assert.Equal(t, []int{3, 0, 2}, x.Sizes)
	assert.Equal(t, [][]int32{{11, 13, 14}, {}, {10, 12}}, x.Members)
	assert.Equal(t, cent, x.Centroids)

	_, err = NewClusterIndex(cent, 2, []int32{3}, 0)
	assert.Error(t, err)
	_, err = NewClusterIndex(cent, 4, []int32{0}, 0)
	assert.Error(t, err)
	_, err = NewClusterIndex(cent, 2, []int32{0}, -1)
	assert.Error(t, err)
}

func TestBuildClusterIndexRef(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 8))
	const d = 4
	keys := blobs(r, 200, d, 5)
	x, err := BuildClusterIndexRef(keys, d, 3, 150, 16, 10, 1)
	require.NoError(t, err)
	assert.Equal(t, 10, x.Clusters())
	assert.Equal(t, 150, x.Tokens())
	seen := map[int32]bool{}
	for _, m := range x.Members {
		for _, tok := range m {
			require.True(t, tok >= 3 && tok < 153)
			require.False(t, seen[tok])
			seen[tok] = true
		}
	}
	_, err = BuildClusterIndexRef(keys, d, 100, 101, 16, 10, 1)
	assert.Error(t, err)
}
