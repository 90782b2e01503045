package sparse

import (
	"fmt"
	"math/rand"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/vk/vktest"
)

// BenchmarkClusterAttention times attention over clusters (Hq 32, Hkv 8,
// D 128, clusters of 16 random members) where every query head takes a
// random share of its KV head's clusters, with 4 sinks and an 8-token
// tail, next to dense attention over the same cache. It reports the GPU
// median (timestamp queries) and the union's share of the tokens: the
// cost of attention over clusters against the share it reads (union-GB/s:
// the K and V bytes of the union's tokens over the median), for the
// chosen clusters per chunk, window and tile and a few others. The layer
// is in cluster order, so that every cluster is a run of 16 slots.
func BenchmarkClusterAttention(b *testing.B) {
	dev := vktest.Open(b)
	h := Heads{32, 8, 128}
	rng := rand.New(rand.NewSource(1))
	for _, n := range []int{32768, 131072} {
		layer, _, _ := randomLayer(b, dev, rng, h, n, n, 1)
		const first, tail, size = 4, 8, 16
		count := n - first - tail
		c := count / size
		x, err := kvcache.NewClusters(dev, h.KV, h.Dim, c, first, count)
		require.NoError(b, err)
		defer x.Release()
		members := make([][][]int32, h.KV)
		for g := range members {
			perm := rng.Perm(count)
			for cl := 0; cl < c; cl++ {
				hi := (cl + 1) * size
				if cl == c-1 {
					hi = count
				}
				var m []int32
				for _, t := range perm[cl*size : hi] {
					m = append(m, int32(first+t))
				}
				members[g] = append(members[g], m)
			}
		}
		writeMembers(b, x, members)
		require.NoError(b, layer.Reorder(x))
		dense, err := NewDense(dev, h)
		require.NoError(b, err)
		defer dense.Release()
		full, err := dense.Plan([]*kvcache.Layer{layer})
		require.NoError(b, err)
		defer full.Release()
		require.NoError(b, full.SetQuery(randomQueries(rng, h.Query*h.Dim, 0.1)))
		// Bring the clocks up after the host-side setup before timing:
		// batches of dense runs for half a second.
		for start := time.Now(); time.Since(start) < 500*time.Millisecond; {
			_, err = full.Time(0, 100)
			require.NoError(b, err)
		}
		b.Run(fmt.Sprintf("N%d/dense", n), func(b *testing.B) { reportGPU(b, full.Time) })

		buf := func(words int) *vk.Buffer {
			r, err := dev.NewBuffer(uint64(words)*4, vk.DeviceLocal)
			require.NoError(b, err)
			return r
		}
		rankBuf, cutBuf := buf(h.Query*c), buf(h.Query)
		defer rankBuf.Release()
		defer cutBuf.Release()
		rank := make([]uint32, h.Query*c)
		for hh := 0; hh < h.Query; hh++ {
			for i, cl := range rng.Perm(c) {
				rank[hh*c+cl] = uint32(i)
			}
		}
		require.NoError(b, rankBuf.WriteUint32(0, rank))
		for _, share := range []float64{0, 0.02, 0.03, 0.05, 0.9} {
			cut := make([]uint32, h.Query)
			for hh := range cut {
				cut[hh] = uint32(share * float64(c))
			}
			require.NoError(b, cutBuf.WriteUint32(0, cut))
			union := 0
			for g := 0; g < h.KV; g++ {
				for cl := 0; cl < c; cl++ {
					for hh := g * h.Group(); hh < (g+1)*h.Group(); hh++ {
						if rank[hh*c+cl] < cut[hh] {
							union++
							break
						}
					}
				}
			}
			for _, o := range []DenseOptions{{}, {ClusterChunk: 256}, {Tile: 256}, {Tile: 128}, {Tile: 256, Unroll: 16}, {Tile: 128, ClusterChunk: 32}, {Tile: 256, ClusterChunk: 128}} {
				d := dense
				if o != (DenseOptions{}) {
					d, err = NewDenseWith(dev, h, o)
					require.NoError(b, err)
				}
				plan, err := d.PlanClusters(layer, x, rankBuf.All(), cutBuf.All())
				require.NoError(b, err)
				require.NoError(b, plan.SetQuery(randomQueries(rng, h.Query*h.Dim, 0.1)))
				b.Run(fmt.Sprintf("N%d/share%g/chunk%d/window%d/tile%d/unroll%d", n, share, plan.mode.(*clusterMode).clusterChunk, d.window, d.clusterTile, max(o.Unroll, 8)), func(b *testing.B) {
					b.ReportMetric(100*float64(union)/float64(h.KV*c), "union-%")
					us := reportGPU(b, plan.Time)
					b.ReportMetric(float64(union*size*h.Dim*2*2)/(us*1e3), "union-GB/s")
				})
				require.NoError(b, plan.Release())
				if d != dense {
					require.NoError(b, d.Release())
				}
			}
		}
	}
}

// reportGPU reports the median of 200 timed runs as gpu-µs, after a fifth
// of a second of untimed ones, so that the clocks are up whatever the
// host did before.
func reportGPU(b *testing.B, timed func(warmup, reps int) ([]time.Duration, error)) (us float64) {
	for start := time.Now(); time.Since(start) < 200*time.Millisecond; {
		_, err := timed(0, 50)
		require.NoError(b, err)
	}
	d, err := timed(20, 200)
	require.NoError(b, err)
	us = float64(d[len(d)/2].Nanoseconds()) / 1e3
	b.ReportMetric(us, "gpu-µs")
	return us
}
