package sparse

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestKMeansSpans(t *testing.T) {
	got, err := KMeansSpans(5000, 2048, 16)
	require.NoError(t, err)
	assert.Equal(t, []KMeansSpan{{0, 2048, 0, 128}, {2048, 2048, 128, 128}, {4096, 904, 256, 57}}, got)
	got, err = KMeansSpans(1003, 500, 16)
	require.NoError(t, err)
	assert.Equal(t, []KMeansSpan{{0, 500, 0, 32}, {500, 500, 32, 32}, {1000, 3, 64, 1}}, got)
	for _, span := range []int{0, 700, 701, 1 << 20} {
		got, err = KMeansSpans(700, span, 16)
		require.NoError(t, err)
		assert.Equal(t, []KMeansSpan{{0, 700, 0, 44}}, got, "span %d", span)
	}
	for _, bad := range [][3]int{{0, 10, 16}, {10, -1, 16}, {10, 5, 0}} {
		_, err = KMeansSpans(bad[0], bad[1], bad[2])
		assert.Error(t, err, "%v", bad)
	}
}

// TestKMeansSpanRefOneSpanIsWhole: one span (span 0 or ≥ n) is
// whole-context K-means, bit for bit.
func TestKMeansSpanRefOneSpanIsWhole(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 8))
	const n, d = 700, 5
	keys := blobs(r, n, d, 20)
	c, err := KMeansClusterCount(n, 16)
	require.NoError(t, err)
	init, err := KMeansInit(n, c, 31)
	require.NoError(t, err)
	cent, assign, iters, err := KMeansRef(keys, n, d, init, 10)
	require.NoError(t, err)
	for _, span := range []int{0, n, n + 1} {
		spans, err := KMeansSpans(n, span, 16)
		require.NoError(t, err)
		sinit, err := KMeansSpanInit(spans, 31)
		require.NoError(t, err)
		require.Equal(t, init, sinit)
		scent, sassign, siters, err := KMeansSpanRef(keys, n, d, spans, sinit, 10)
		require.NoError(t, err)
		require.Equal(t, cent, scent)
		require.Equal(t, assign, sassign)
		require.Equal(t, iters, siters)
	}
	whole, err := BuildClusterIndexRef(keys, d, 0, n, 16, 10, 31)
	require.NoError(t, err)
	spanned, err := BuildSpanClusterIndexRef(keys, d, 0, n, 0, 16, 10, 31)
	require.NoError(t, err)
	require.Equal(t, whole, spanned)
}

// TestKMeansSpanRefIsPerSpanKMeans checks the definition: each span is
// KMeansRef over its own rows from KMeansInit with its own seed, its
// clusters numbered after the previous span's.
func TestKMeansSpanRefIsPerSpanKMeans(t *testing.T) {
	r := rand.New(rand.NewPCG(9, 10))
	const n, d, span, seed = 1000, 6, 300, 77
	keys := blobs(r, n, d, 40)
	spans, err := KMeansSpans(n, span, 16)
	require.NoError(t, err)
	require.Len(t, spans, 4)
	init, err := KMeansSpanInit(spans, seed)
	require.NoError(t, err)
	cent, assign, iters, err := KMeansSpanRef(keys, n, d, spans, init, 10)
	require.NoError(t, err)
	require.Len(t, cent, (spans[3].FirstCluster+spans[3].Clusters)*d)
	most := 0
	for s, sp := range spans {
		own, err := KMeansInit(sp.Count, sp.Clusters, KMeansSpanSeed(seed, s))
		require.NoError(t, err)
		for i, row := range own {
			require.Equal(t, sp.First+row, init[sp.FirstCluster+i], "span %d initial row %d", s, i)
		}
		c, a, it, err := KMeansRef(keys[sp.First*d:(sp.First+sp.Count)*d], sp.Count, d, own, 10)
		require.NoError(t, err)
		most = max(most, it)
		require.Equal(t, c, cent[sp.FirstCluster*d:(sp.FirstCluster+sp.Clusters)*d], "span %d centroids", s)
		for i, j := range a {
			require.Equal(t, j+int32(sp.FirstCluster), assign[sp.First+i], "span %d row %d", s, i)
		}
	}
	require.Equal(t, most, iters)
	require.Equal(t, KMeansSpanSeed(seed, 0), uint64(seed))

	idx, err := BuildSpanClusterIndexRef(keys, d, 0, n, span, 16, 10, seed)
	require.NoError(t, err)
	for s, sp := range spans {
		for c := sp.FirstCluster; c < sp.FirstCluster+sp.Clusters; c++ {
			for _, tok := range idx.Members[c] {
				require.True(t, int(tok) >= sp.First && int(tok) < sp.First+sp.Count, "span %d cluster %d lists token %d", s, c, tok)
			}
		}
	}

	bad := append([]int(nil), init...)
	bad[0] = spans[1].First // span 0's first cluster starting in span 1
	_, _, _, err = KMeansSpanRef(keys, n, d, spans, bad, 10)
	require.ErrorContains(t, err, "outside")
	_, _, _, err = KMeansSpanRef(keys, n, d, spans[:3], init[:spans[3].FirstCluster], 10)
	require.Error(t, err, "spans that miss rows")
}
