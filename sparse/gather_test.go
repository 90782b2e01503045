package sparse

import (
	"fmt"
	"math"
	"math/rand"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/vk/vktest"
)

// TestGatherMatchesReference attends random token subsets per KV head and
// compares every query head with AttendSubsetRef.
func TestGatherMatchesReference(t *testing.T) {
	dev := vktest.Open(t)
	rng := rand.New(rand.NewSource(rand.Int63()))
	for _, c := range []struct {
		heads  Heads
		n      int
		qStd   float64
		sizes  []int // list length per KV head
		stride int
	}{
		{Heads{8, 2, 64}, 3000, 1.5, []int{1, 2999}, 3000},
		{Heads{16, 4, 128}, 5000, 3, []int{700, 33, 4100, 1}, 4500},
		{Heads{4, 1, 128}, 2000, 40, []int{1500}, 2000}, // logits in the hundreds
		// Lists of very different lengths whose chunks grow past the
		// least chunk, to a size that divides none of them.
		{Heads{32, 8, 16}, 20011, 2, []int{20011, 19999, 17000, 1, 300, 16385, 9000, 257}, 20011},
	} {
		t.Run(fmt.Sprintf("Hq%d_Hkv%d_D%d_N%d", c.heads.Query, c.heads.KV, c.heads.Dim, c.n), func(t *testing.T) {
			dense, err := NewDense(dev, c.heads)
			require.NoError(t, err)
			defer dense.Release()
			layer, k, v := randomLayer(t, dev, rng, c.heads, c.n, c.n, 1)
			total := 0
			for _, size := range c.sizes {
				total += size
			}
			if c.n > 16384 {
				dense.gatherMin = 64 // so that the chunks grow past it
			}
			plan, err := dense.PlanGather(layer, c.stride)
			require.NoError(t, err)
			defer plan.Release()
			if c.n > 16384 {
				require.Greater(t, total, plan.GatherChunk()*plan.maxChunks, "the lists must need chunks above the least size")
			}
			lists := make([][]int32, c.heads.KV)
			for g, size := range c.sizes {
				for _, tok := range rng.Perm(c.n)[:size] {
					lists[g] = append(lists[g], int32(tok))
				}
			}
			require.NoError(t, plan.SetTokens(lists))
			q := randomQueries(rng, c.heads.Query*c.heads.Dim, c.qStd)
			require.NoError(t, dev.Run(func(cmd *vk.Commands) { cmd.Fill(plan.Output().All(), math.Float32bits(float32(math.NaN()))) }))
			got, err := plan.Attend(q)
			require.NoError(t, err)
			requireClose(t, listsRef(t, c.heads, q, k, v, c.n, lists), got, c.heads.Dim, 1e-3, "gathered")
		})
	}
}

func TestGatherRejectsBadLists(t *testing.T) {
	dev := vktest.Open(t)
	rng := rand.New(rand.NewSource(1))
	h := Heads{4, 2, 64}
	dense, err := NewDense(dev, h)
	require.NoError(t, err)
	defer dense.Release()
	layer, _, _ := randomLayer(t, dev, rng, h, 100, 200, 1)
	_, err = dense.PlanGather(layer, 0)
	require.Error(t, err)
	_, err = dense.PlanGather(layer, 201)
	require.Error(t, err)
	plan, err := dense.PlanGather(layer, 50)
	require.NoError(t, err)
	defer plan.Release()
	require.ErrorContains(t, plan.SetTokens([][]int32{{1}}), "lists")
	require.ErrorContains(t, plan.SetTokens([][]int32{{1}, {}}), "entries")
	require.ErrorContains(t, plan.SetTokens([][]int32{{1}, {100}}), "outside")
	long := make([]int32, 51)
	require.ErrorContains(t, plan.SetTokens([][]int32{{1}, long}), "entries")
}
