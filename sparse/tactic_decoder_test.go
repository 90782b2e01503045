package sparse

import (
	"errors"
	"fmt"
	"math/rand"
	"sort"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/trace"
	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/vk/vktest"
)

// TestTacticDecoderReclustersTheTail appends tokens past the prefill and
// checks that every Recluster of them join the index (each stored token
// past the sinks in exactly one cluster, members ascending) and that the
// step still attends every token at P = 1, with the fitted curve and with
// the moment estimate (whose spreads each joined index needs anew).
func TestTacticDecoderReclustersTheTail(t *testing.T) {
	for _, fit := range []TacticFit{TacticCurveFit(), DefaultTacticFit()} {
		t.Run(fmt.Sprintf("moments=%v", fit.Moments), func(t *testing.T) { testTacticDecoderRecluster(t, fit) })
	}
}

func testTacticDecoderRecluster(t *testing.T, fit TacticFit) {
	const n, prefill, recluster, sinks = 1500, 900, 256, 4
	h := Heads{Query: 8, KV: 2, Dim: 64}
	tr, layer, dense, km, rows := decoderFixture(t, h, n, prefill)
	dec, err := NewTacticDecoder(dense, km, layer, 1, TacticDecoderOptions{Sinks: sinks, Recluster: recluster, KMeans: KMeansOptions{Seed: 3}, Fit: fit})
	require.NoError(t, err)
	defer dec.Release()
	c0 := dec.Clusters().C

	rng := rand.New(rand.NewSource(rand.Int63()))
	for tok := prefill; tok < n; tok++ {
		k, v := rows(tok, tok+1)
		require.NoError(t, dec.Append(k, v))
		require.Less(t, dec.Tail(), recluster, "after token %d", tok)
	}
	joins := (n - prefill) / recluster
	x := dec.Clusters()
	require.Equal(t, []int{sinks, prefill - sinks + joins*recluster, n - prefill - joins*recluster},
		[]int{x.First, x.Count, dec.Tail()}, "clustered range and tail")
	require.Greater(t, x.C, c0, "the tails' clusters joined the index")
	for g := 0; g < h.KV; g++ {
		hc, err := x.Read(g)
		require.NoError(t, err)
		var all []int
		for c, mem := range hc.Members {
			require.True(t, sort.SliceIsSorted(mem, func(i, j int) bool { return mem[i] < mem[j] }), "head %d cluster %d members ascending", g, c)
			for _, m := range mem {
				all = append(all, int(m))
				require.Equal(t, int32(c), hc.Assign[int(m)-x.First], "head %d token %d assignment", g, m)
			}
		}
		sort.Ints(all)
		for i, m := range all {
			require.Equal(t, x.First+i, m, "head %d: every clustered token once", g)
		}
	}

	// At P = 1 the step over the joined index is dense attention.
	keys, values := make([]float64, 0, h.KV*n*h.Dim), make([]float64, 0, h.KV*n*h.Dim)
	keys, values = append(keys, HalvesToFloat64(tr.K)...), append(values, HalvesToFloat64(tr.V)...)
	q := randomQueries(rng, h.Query*h.Dim, 1.5)
	got, err := dec.Attend(q)
	require.NoError(t, err)
	requireDense(t, h, q, keys, values, n, got, "P = 1 after reclustering")

	// A refused append leaves the cache and the index as they were.
	before := layer.Len()
	require.Error(t, dec.Append(make([]uint16, 3), make([]uint16, 3)))
	require.Equal(t, before, layer.Len())
	require.Same(t, x, dec.Clusters())
}

// TestTacticDecoderJoinFailure makes the join of a clustered tail fail
// once and checks that the token stays stored, the step still attends
// every token (dense at P = 1), the next Append joins the waiting tail,
// and appends go on; it failed before the decoder kept the tail waiting
// (its undo truncated inside the reordered range, and every later append
// failed).
func TestTacticDecoderJoinFailure(t *testing.T) {
	const n, prefill, recluster, sinks = 700, 400, 128, 4
	h := Heads{Query: 8, KV: 2, Dim: 64}
	tr, layer, dense, km, rows := decoderFixture(t, h, n, prefill)
	dec, err := NewTacticDecoder(dense, km, layer, 1, TacticDecoderOptions{Sinks: sinks, Recluster: recluster, KMeans: KMeansOptions{Seed: 5}})
	require.NoError(t, err)
	defer dec.Release()

	real := joinClusters
	defer func() { joinClusters = real }()
	failed := false
	joinClusters = func(x *kvcache.Clusters, d *vk.Device, next *kvcache.Clusters) (*kvcache.Clusters, error) {
		if !failed {
			failed = true
			return nil, errors.New("injected")
		}
		return real(x, d, next)
	}
	keys, values := HalvesToFloat64(tr.K), HalvesToFloat64(tr.V)
	rng := rand.New(rand.NewSource(9))
	for tok := prefill; tok < n; tok++ {
		k, v := rows(tok, tok+1)
		err := dec.Append(k, v)
		if tok == prefill+recluster-1 {
			require.ErrorContains(t, err, "injected", "the first join fails")
			require.Equal(t, tok+1, layer.Len(), "the token stays stored")
			q := randomQueries(rng, h.Query*h.Dim, 1.5)
			got, err := dec.Attend(q)
			require.NoError(t, err)
			m := layer.Len()
			var km64, vm64 []float64 // the first m tokens of every KV head
			for g := 0; g < h.KV; g++ {
				km64 = append(km64, keys[g*n*h.Dim:(g*n+m)*h.Dim]...)
				vm64 = append(vm64, values[g*n*h.Dim:(g*n+m)*h.Dim]...)
			}
			requireDense(t, h, q, km64, vm64, m, got, "P = 1 with the tail waiting")
			continue
		}
		require.NoError(t, err, "token %d", tok)
	}
	require.True(t, failed)
	require.Equal(t, n, layer.Len())
	require.Less(t, dec.Tail(), recluster, "the waiting tail joined")
	q := randomQueries(rng, h.Query*h.Dim, 1.5)
	got, err := dec.Attend(q)
	require.NoError(t, err)
	requireDense(t, h, q, keys, values, n, got, "P = 1 after the join")
}

// decoderFixture generates n tokens, prefills the first prefill of them
// into a layer of capacity n, and returns the trace, the layer, the dense
// kernels, K-means and rows(from, to), the tokens [from, to) of every KV
// head as fp16 keys and values; all released when the test ends.
func decoderFixture(t *testing.T, h Heads, n, prefill int) (*trace.Trace, *kvcache.Layer, *Dense, *KMeans, func(from, to int) (k, v []uint16)) {
	dev := vktest.Open(t)
	tr := generated(t, h, n, 1)
	layer, err := kvcache.NewLayer(dev, h.KV, h.Dim, n)
	require.NoError(t, err)
	rows := func(from, to int) (k, v []uint16) {
		for g := 0; g < h.KV; g++ {
			k = append(k, tr.K[(g*n+from)*h.Dim:(g*n+to)*h.Dim]...)
			v = append(v, tr.V[(g*n+from)*h.Dim:(g*n+to)*h.Dim]...)
		}
		return k, v
	}
	k, v := rows(0, prefill)
	require.NoError(t, layer.Prefill(k, v, prefill))
	dense, err := NewDense(dev, h)
	require.NoError(t, err)
	km, err := NewKMeans(dev, h.KV, h.Dim)
	require.NoError(t, err)
	t.Cleanup(func() {
		km.Release()
		dense.Release()
		layer.Release()
	})
	return tr, layer, dense, km, rows
}
