package sparse

import (
	"fmt"
	"math/rand"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/vk/vktest"
)

// unitTake is how the query heads of a KV head take the tokens of a
// single-token index.
type unitTake int

const (
	unitDisjoint unitTake = iota // each token by one head at most
	unitOverlap                  // each head a random share; the group's last head none
	unitAll                      // the first head every token, the others random shares
	unitNone                     // no head any token
)

// unitRanks returns, for the query heads of one KV head over c tokens, the
// taken set of each (per take) as ranks (a permutation of 0 … c−1 per
// head, the taken tokens ranked first, [heads][c]) and cuts (the sizes of
// the taken sets).
func unitRanks(rng *rand.Rand, take unitTake, heads, c int) (rank []uint32, cut []uint32) {
	taken := make([][]bool, heads)
	for j := range taken {
		taken[j] = make([]bool, c)
	}
	for t := 0; t < c; t++ {
		switch take {
		case unitDisjoint:
			if j := rng.Intn(heads + 1); j < heads { // one in heads+1 taken by none
				taken[j][t] = true
			}
		case unitOverlap, unitAll:
			for j := range taken {
				taken[j][t] = rng.Intn(4) == 0
			}
			if take == unitOverlap {
				taken[heads-1][t] = false
			} else {
				taken[0][t] = true
			}
		}
	}
	for j := range taken {
		var first, rest []int
		for t, in := range taken[j] {
			if in {
				first = append(first, t)
			} else {
				rest = append(rest, t)
			}
		}
		rng.Shuffle(len(first), func(a, b int) { first[a], first[b] = first[b], first[a] })
		rng.Shuffle(len(rest), func(a, b int) { rest[a], rest[b] = rest[b], rest[a] })
		r := make([]uint32, c)
		for i, t := range append(first, rest...) {
			r[t] = uint32(i)
		}
		rank = append(rank, r...)
		cut = append(cut, uint32(len(first)))
	}
	return rank, cut
}

// TestUnitClustersMatchReference attends over single-token indexes
// (kvcache.NewPages of pages of one token) through attend_partial's
// single-token path, with groups whose heads take disjoint tokens,
// overlapping ones, every token or none, a head taking nothing, runs of
// several windows, windows of more tokens than a tile, two head blocks per
// KV head and groups of more than 8 heads, token counts that are multiples
// of neither window nor tile. Every output is compared with
// AttendSubsetRef over the KV head's fixed tokens and the union its heads
// take, the members each head block reports (Taken) with the union's size,
// and the output with that of the general path over the same index (the
// same tokens, summed in another order: the unit path's runs take blocks
// of consecutive tokens).
func TestUnitClustersMatchReference(t *testing.T) {
	dev := vktest.Open(t)
	rng := rand.New(rand.NewSource(rand.Int63()))
	for _, c := range []struct {
		heads       Heads
		n, capacity int
		first, tail int // the index is [first, n−tail)
		opts        DenseOptions
		takes       []unitTake // per KV head
	}{
		{heads: Heads{8, 2, 64}, n: 3001, capacity: 3100, first: 4, tail: 97, takes: []unitTake{unitDisjoint, unitOverlap}},
		// Runs of several windows of 32·4 tokens; tiles of 100 filled
		// within and across windows.
		{heads: Heads{4, 1, 128}, n: 5000, capacity: 5000, first: 1, tail: 3, opts: DenseOptions{ClusterChunk: 1500, ClusterWindow: 32, ClusterTile: 100}, takes: []unitTake{unitAll}},
		{heads: Heads{4, 1, 128}, n: 4999, capacity: 5003, first: 0, tail: 1, opts: DenseOptions{ClusterChunk: 700, ClusterWindow: 64, ClusterTile: 300}, takes: []unitTake{unitOverlap}},
		// Two head blocks per KV head, each attending the group's union.
		{heads: Heads{16, 4, 32}, n: 4099, capacity: 4099, first: 5, tail: 20, opts: DenseOptions{Group: 2, ClusterChunk: 700, ClusterWindow: 64, ClusterTile: 200}, takes: []unitTake{unitDisjoint, unitOverlap, unitAll, unitNone}},
		// Groups of 16 heads: their ranks load 8 heads at a time.
		{heads: Heads{32, 2, 16}, n: 2500, capacity: 2600, first: 2, tail: 30, opts: DenseOptions{Group: 8, ClusterChunk: 300}, takes: []unitTake{unitOverlap, unitDisjoint}},
	} {
		name := fmt.Sprintf("Hq%d_Hkv%d_D%d_N%d_%v", c.heads.Query, c.heads.KV, c.heads.Dim, c.n, c.takes)
		t.Run(name, func(t *testing.T) {
			h := c.heads
			dense, err := NewDenseWith(dev, h, c.opts)
			require.NoError(t, err)
			t.Cleanup(func() { dense.Release() })
			layer, k, v := randomLayer(t, dev, rng, h, c.n, c.capacity, 1)
			count := c.n - c.first - c.tail
			x, err := kvcache.NewPages(dev, h.KV, h.Dim, c.first, count, 1)
			require.NoError(t, err)
			t.Cleanup(func() { x.Release() })
			require.True(t, x.SingleTokens())

			var rank, cut []uint32
			for g := range h.KV {
				r, ct := unitRanks(rng, c.takes[g], h.Group(), count)
				rank, cut = append(rank, r...), append(cut, ct...)
			}
			rankBuf, cutBuf := uploadWords(t, dev, rank), uploadWords(t, dev, cut)
			plan, err := dense.PlanClusters(layer, x, rankBuf.All(), cutBuf.All())
			require.NoError(t, err)
			t.Cleanup(func() { plan.Release() })
			m := plan.mode.(*clusterMode)
			require.NotZero(t, m.spec(dense).Unit)
			unit, err := dense.variant(m.spec(dense))
			require.NoError(t, err)
			require.Same(t, unit, m.pipe, "the single-token kernel attends")

			fixed, err := TacticFixedTokens(c.first, c.first+count, c.n-1)
			require.NoError(t, err)
			lists := make([][]int32, h.KV)
			for g := range lists {
				lists[g] = slices.Clone(fixed)
				for tok := range count {
					for hh := g * h.Group(); hh < (g+1)*h.Group(); hh++ {
						if rank[hh*count+tok] < cut[hh] {
							lists[g] = append(lists[g], int32(c.first+tok))
							break
						}
					}
				}
			}
			q := randomQueries(rng, h.Query*h.Dim, 1.5)
			got := attendPoisoned(t, dev, plan, q)
			requireClose(t, listsRef(t, h, q, k, v, c.n, lists), got, h.Dim, 1e-3, "over single tokens")
			taken, err := plan.Taken()
			require.NoError(t, err)
			blocks := h.Group() / dense.group
			for i, members := range taken {
				require.Equal(t, len(lists[i/blocks])-len(fixed), int(members), "tokens taken by head block %d", i)
			}

			moved, err := plan.rebind(func() { m.unit, m.pipe = false, dense.clustered }, nil)
			require.NoError(t, err)
			require.True(t, moved)
			general := make([]float64, len(got))
			for i, x := range got {
				general[i] = float64(x)
			}
			// The paths sum the same tokens in another order.
			requireClose(t, general, attendPoisoned(t, dev, plan, q), h.Dim, 1e-5, "the general path over the same index")
		})
	}
}

// TestUnitClustersOnlyForSingleTokens checks which indexes take the
// single-token kernel: pages of one token do; pages of two, and a K-means
// index of as many clusters as tokens (its clusters may be empty or hold
// several), do not.
func TestUnitClustersOnlyForSingleTokens(t *testing.T) {
	dev := vktest.Open(t)
	rng := rand.New(rand.NewSource(rand.Int63()))
	h := Heads{8, 2, 64}
	dense, err := NewDense(dev, h)
	require.NoError(t, err)
	defer dense.Release()
	const n = 600
	layer, _, _ := randomLayer(t, dev, rng, h, n, n, 1)
	words := make([]uint32, h.Query*n)
	buf := uploadWords(t, dev, words)
	kmeans, err := kvcache.NewClusters(dev, h.KV, h.Dim, n, 0, n)
	require.NoError(t, err)
	defer kmeans.Release()
	kmeans.Contiguous = true
	for _, c := range []struct {
		pageSize int // 0: the K-means index
		unit     bool
	}{{1, true}, {2, false}, {0, false}} {
		x := kmeans
		if c.pageSize > 0 {
			x, err = kvcache.NewPages(dev, h.KV, h.Dim, 0, n, c.pageSize)
			require.NoError(t, err)
			defer x.Release()
		}
		require.Equal(t, c.unit, x.SingleTokens(), "pages of %d", c.pageSize)
		plan, err := dense.PlanClusters(layer, x, buf.All(), buf.All())
		require.NoError(t, err)
		want := dense.clustered
		if c.unit {
			spec := dense.clusterSpec
			spec.Unit = unitClusters
			want, err = dense.variant(spec)
			require.NoError(t, err)
		}
		require.Same(t, want, plan.mode.(*clusterMode).pipe, "pages of %d", c.pageSize)
		require.NoError(t, plan.Release())
	}
}

// uploadWords returns a device buffer holding words, released when the
// test ends.
func uploadWords(t *testing.T, dev *vk.Device, words []uint32) *vk.Buffer {
	t.Helper()
	b, err := dev.NewBuffer(uint64(len(words))*4, vk.DeviceLocal)
	require.NoError(t, err)
	t.Cleanup(func() { b.Release() })
	require.NoError(t, b.WriteUint32(0, words))
	return b
}
