package sparse

import (
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/vk/vktest"
)

// TestTacticBatch runs one batched step over five sequences of different
// lengths, each with its own generated layer and index, and checks every
// sequence's output against AttendSubsetRef over the tokens its step
// attended, and its cuts against the same sequence's step run alone.
func TestTacticBatch(t *testing.T) {
	dev := vktest.Open(t)
	h := Heads{Query: 8, KV: 2, Dim: 64}
	const tail, sinks, p = 120, 4, 0.9
	lengths := []int{2500, 3107, 1901, 1203, 1777}
	dense, err := NewDense(dev, h)
	require.NoError(t, err)
	defer dense.Release()
	km, err := NewKMeans(dev, h.KV, h.Dim)
	require.NoError(t, err)
	defer km.Release()
	var layers []*kvcache.Layer
	var indexes []*kvcache.Clusters
	var members [][][][]int32
	var keys, values [][]float64
	var q []float32
	for i, n := range lengths {
		tr := generated(t, h, n, 1)
		layer, err := kvcache.NewLayer(dev, h.KV, h.Dim, n+7)
		require.NoError(t, err)
		defer layer.Release()
		require.NoError(t, layer.Prefill(tr.K, tr.V, n))
		x, err := km.Cluster(layer, sinks, n-tail-sinks, KMeansOptions{Seed: uint64(i + 3)})
		require.NoError(t, err)
		defer x.Release()
		require.NoError(t, layer.Reorder(x))
		mem := make([][][]int32, h.KV)
		for g := range mem {
			hc, err := x.Read(g)
			require.NoError(t, err)
			mem[g] = hc.Members
		}
		layers, indexes, members = append(layers, layer), append(indexes, x), append(members, mem)
		keys, values = append(keys, HalvesToFloat64(tr.K)), append(values, HalvesToFloat64(tr.V))
		q = append(q, tr.Query(0)...)
	}

	batch, err := NewTacticBatch(dense, layers, indexes, p, DefaultTacticFit())
	require.NoError(t, err)
	defer batch.Release()
	require.Equal(t, len(lengths), batch.Len())
	nan := math.Float32bits(float32(math.NaN()))
	require.NoError(t, dev.Run(func(c *vk.Commands) {
		for i := range lengths {
			c.Fill(batch.Step(i).plan.Output().All(), nan)
		}
	}))
	got, err := batch.Attend(q)
	require.NoError(t, err)
	per := h.Query * h.Dim
	for i, n := range lengths {
		lists, err := batch.Step(i).Tokens(members[i])
		require.NoError(t, err)
		for g, l := range lists {
			require.Less(t, len(l), n, "sequence %d, KV head %d attends every token at P %v", i, g, p)
		}
		want := listsRef(t, h, q[i*per:(i+1)*per], keys[i], values[i], n, lists)
		requireClose(t, want, got[i*per:(i+1)*per], h.Dim, 1e-3, fmt.Sprintf("sequence %d of the batch", i))
		cuts, err := batch.Step(i).Cuts()
		require.NoError(t, err)

		alone, err := NewTacticStep(dense, layers[i], indexes[i], p, DefaultTacticFit())
		require.NoError(t, err)
		_, err = alone.Attend(q[i*per : (i+1)*per])
		require.NoError(t, err)
		aloneCuts, err := alone.Cuts()
		require.NoError(t, err)
		require.NoError(t, alone.Release())
		for hh := range cuts {
			require.InDelta(t, aloneCuts[hh], cuts[hh], 1, "sequence %d, head %d: cut in the batch and alone", i, hh)
		}
	}

	require.Error(t, batch.SetQuery(q[:per]), "queries of one sequence for three")
	_, err = NewTacticBatch(dense, []*kvcache.Layer{layers[0], layers[0]}, []*kvcache.Clusters{indexes[0], indexes[0]}, p, DefaultTacticFit())
	require.Error(t, err, "two sequences sharing a cache")
	_, err = NewTacticBatch(dense, layers, indexes[:1], p, DefaultTacticFit())
	require.Error(t, err, "indexes missing")
	times, err := batch.Time(1, 3)
	require.NoError(t, err)
	require.Len(t, times, 3)
	stages, total, err := batch.TimeStages(1, 3)
	require.NoError(t, err)
	require.Equal(t, append(TacticStages, "attend"), batch.Stages())
	require.Len(t, stages, len(batch.Stages()))
	for i, s := range stages {
		require.Greater(t, s, time.Duration(0), "stage %s", batch.Stages()[i])
	}
	require.Greater(t, total, time.Duration(0))
}
