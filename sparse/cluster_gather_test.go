package sparse

import (
	"fmt"
	"math"
	"math/rand"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/vk/vktest"
)

// TestClusterGatherMatchesReference attends, per KV head, the fixed tokens
// and the clusters its query heads take under random ranks and cuts, and
// compares every query head with AttendSubsetRef over that union.
func TestClusterGatherMatchesReference(t *testing.T) {
	dev := vktest.Open(t)
	rng := rand.New(rand.NewSource(rand.Int63()))
	for _, c := range []struct {
		heads       Heads
		n, capacity int
		first, tail int // sinks [0, first); the last tail tokens unclustered
		clusters    int
		big         int  // members of one oversized cluster (0: none)
		minChunk    int  // clusters per chunk (0: chosen)
		window      int  // clusters per window (0: chosen)
		none        bool // KV head 0 takes no cluster: only its fixed tokens
	}{
		{Heads{8, 2, 64}, 3000, 3200, 4, 196, 150, 1500, 0, 0, false},
		{Heads{16, 4, 128}, 5000, 5000, 0, 1, 400, 0, 0, 0, true},
		// Chunks of more clusters than a window holds: tiles filled
		// across windows.
		{Heads{4, 1, 128}, 4100, 4100, 1, 0, 700, 0, 600, 0, false},
		{Heads{8, 2, 128}, 7000, 7000, 3, 50, 900, 0, 300, 32, false},
		{Heads{32, 8, 16}, 9001, 9500, 4, 300, 900, 2000, 0, 0, false},
	} {
		name := fmt.Sprintf("Hq%d_Hkv%d_D%d_N%d_C%d", c.heads.Query, c.heads.KV, c.heads.Dim, c.n, c.clusters)
		t.Run(name, func(t *testing.T) {
			h := c.heads
			dense, err := NewDenseWith(dev, h, DenseOptions{ClusterChunk: c.minChunk, ClusterWindow: c.window})
			require.NoError(t, err)
			defer dense.Release()
			layer, k, v := randomLayer(t, dev, rng, h, c.n, c.capacity, 1)
			count := c.n - c.first - c.tail
			x, err := kvcache.NewClusters(dev, h.KV, h.Dim, c.clusters, c.first, count)
			require.NoError(t, err)
			defer x.Release()
			members := make([][][]int32, h.KV)
			for g := range members {
				members[g] = make([][]int32, c.clusters)
				for i, tok := range rng.Perm(count) {
					cl := rng.Intn(c.clusters)
					if i < c.big {
						cl = 0
					}
					members[g][cl] = append(members[g][cl], int32(c.first+tok))
				}
			}
			writeMembers(t, x, members)
			require.NoError(t, layer.Reorder(x))

			const ranks = 10
			rank := make([]uint32, h.Query*c.clusters)
			for i := range rank {
				rank[i] = uint32(rng.Intn(ranks))
			}
			cut := make([]uint32, h.Query)
			for i := range cut {
				cut[i] = uint32(rng.Intn(ranks/3) + 1)
				if c.none && i < h.Group() {
					cut[i] = 0
				}
			}
			rankBuf, err := dev.NewBuffer(uint64(len(rank))*4, vk.DeviceLocal)
			require.NoError(t, err)
			defer rankBuf.Release()
			cutBuf, err := dev.NewBuffer(uint64(len(cut))*4, vk.DeviceLocal)
			require.NoError(t, err)
			defer cutBuf.Release()
			require.NoError(t, rankBuf.WriteUint32(0, rank))
			require.NoError(t, cutBuf.WriteUint32(0, cut))

			plan, err := dense.PlanClusters(layer, x, rankBuf.All(), cutBuf.All())
			require.NoError(t, err)
			defer plan.Release()
			if c.minChunk > 0 {
				require.Greater(t, plan.clusterChunk, dense.window, "a chunk must span several windows")
			}
			q := randomQueries(rng, h.Query*h.Dim, 1.5)
			nan := math.Float32bits(float32(math.NaN()))
			require.NoError(t, dev.Run(func(cmd *vk.Commands) {
				cmd.Fill(plan.Output().All(), nan)
				cmd.Fill(plan.partO.All(), nan)
				cmd.Fill(plan.partML.All(), nan)
			}))
			got, err := plan.Attend(q)
			require.NoError(t, err)

			fixed, err := TacticFixedTokens(c.first, c.first+count, c.n-1)
			require.NoError(t, err)
			lists := make([][]int32, h.KV)
			for g := range lists {
				list := slices.Clone(fixed)
				for cl, m := range members[g] {
					for hh := g * h.Group(); hh < (g+1)*h.Group(); hh++ {
						if rank[hh*c.clusters+cl] < cut[hh] {
							list = append(list, m...)
							break
						}
					}
				}
				if c.none && g == 0 {
					require.Len(t, list, len(fixed))
				} else {
					require.Greater(t, len(list), len(fixed), "KV head %d takes some cluster", g)
				}
				lists[g] = list
			}
			requireClose(t, listsRef(t, h, q, k, v, c.n, lists), got, h.Dim, 1e-3, "over clusters")
		})
	}
}

// writeMembers stores members, each KV head's clusters' token lists
// ([KV][C][]), in the index x: starts, sizes and the flat member list.
func writeMembers(t testing.TB, x *kvcache.Clusters, members [][][]int32) {
	t.Helper()
	var starts, sizes, flat []uint32
	for _, head := range members {
		at := 0
		for _, m := range head {
			starts, sizes = append(starts, uint32(at)), append(sizes, uint32(len(m)))
			for _, tok := range m {
				flat = append(flat, uint32(tok))
			}
			at += len(m)
		}
	}
	require.NoError(t, x.Starts.WriteUint32(0, starts))
	require.NoError(t, x.Counts.WriteUint32(0, sizes))
	require.NoError(t, x.Members.WriteUint32(0, flat))
}

func TestClusterGatherRejectsBadIndex(t *testing.T) {
	dev := vktest.Open(t)
	rng := rand.New(rand.NewSource(1))
	h := Heads{4, 2, 64}
	dense, err := NewDense(dev, h)
	require.NoError(t, err)
	defer dense.Release()
	layer, _, _ := randomLayer(t, dev, rng, h, 100, 200, 1)
	x, err := kvcache.NewClusters(dev, h.KV, h.Dim, 10, 0, 100)
	require.NoError(t, err)
	defer x.Release()
	small, err := dev.NewBuffer(16, vk.DeviceLocal)
	require.NoError(t, err)
	defer small.Release()
	_, err = dense.PlanClusters(layer, x, small.All(), small.All())
	require.ErrorContains(t, err, "ranks")
	other, err := kvcache.NewClusters(dev, 1, h.Dim, 10, 0, 100)
	require.NoError(t, err)
	defer other.Release()
	_, err = dense.PlanClusters(layer, other, small.All(), small.All())
	require.ErrorContains(t, err, "index")
}
