package kvcache

import (
	"math/rand"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/vk/vktest"
)

// TestReorder puts a random partition of a middle range in cluster order
// and checks every slot of every head against the same permutation on the
// host: the range's slots hold the members' rows and positions, the slots
// outside it are untouched; a second Reorder of the range, and a Truncate
// inside it, are refused and change nothing.
func TestReorder(t *testing.T) {
	dev := vktest.Open(t)
	rng := rand.New(rand.NewSource(rand.Int63()))
	for _, tc := range []struct{ heads, dim, n, first, count, c int }{
		{3, 24, 101, 4, 77, 9},  // odd sizes, a tail after the range
		{2, 64, 300, 0, 300, 1}, // the whole cache, one cluster
		{1, 8, 17, 16, 1, 1},    // a single token
	} {
		l, err := NewLayer(dev, tc.heads, tc.dim, tc.n+5)
		require.NoError(t, err)
		k, v := randomHalves(rng, tc.heads*tc.n*tc.dim), randomHalves(rng, tc.heads*tc.n*tc.dim)
		require.NoError(t, l.Prefill(k, v, tc.n))
		require.Equal(t, l.CacheBytes(), l.Bytes(), "a layer never reordered keeps no positions")
		ident, err := l.ReadPositions()
		require.NoError(t, err)
		for i, p := range ident {
			require.Equal(t, int32(i%tc.n), p, "slot %d of head %d before the reorder", i%tc.n, i/tc.n)
		}
		x := randomClusters(t, dev, rng, tc.heads, tc.dim, tc.c, tc.first, tc.count)
		require.NoError(t, l.Reorder(x))
		require.True(t, x.Contiguous)
		require.Equal(t, l.CacheBytes()+uint64(tc.heads*(tc.n+5)*4), l.Bytes(), "positions kept from the first reorder on")

		gotK, gotV, err := l.Read()
		require.NoError(t, err)
		pos, err := l.ReadPositions()
		require.NoError(t, err)
		bad := 0
		for g := 0; g < tc.heads; g++ {
			hc, err := x.Read(g)
			require.NoError(t, err)
			want := make([]int32, tc.n) // position held by each slot
			for s := range want {
				want[s] = int32(s)
			}
			slot := tc.first
			for _, mem := range hc.Members {
				for _, tok := range mem {
					want[slot] = tok
					slot++
				}
			}
			for s, p := range want {
				row := (g*tc.n + s) * tc.dim
				src := (g*tc.n + int(p)) * tc.dim
				ok := pos[g*tc.n+s] == p
				for i := 0; i < tc.dim && ok; i++ {
					ok = gotK[row+i] == k[src+i] && gotV[row+i] == v[src+i]
				}
				if !ok {
					if bad < 5 {
						t.Errorf("%+v: head %d slot %d: position %d, want the row of %d", tc, g, s, pos[g*tc.n+s], p)
					}
					bad++
				}
			}
		}
		require.Zero(t, bad, "%+v: slots differing from the host's permutation", tc)

		x.Contiguous = false
		require.Error(t, l.Reorder(x), "a range already in cluster order")
		if tc.count > 1 {
			require.Error(t, l.Truncate(tc.first+1), "truncating inside the range")
		}
		require.Equal(t, tc.n, l.Len())
		again, _, err := l.Read()
		require.NoError(t, err)
		require.Equal(t, gotK, again, "refused calls change nothing")
		require.NoError(t, x.Release())
		require.NoError(t, l.Release())
	}
}

// TestPrepareReorder compiles the reorder kernel ahead: Reorder then uses
// the same device-owned kernel, and head sizes no kernel serves are
// refused.
func TestPrepareReorder(t *testing.T) {
	dev := vktest.Open(t)
	require.NoError(t, PrepareReorder(dev, 40))
	before, err := reorderKernel(dev, 40)
	require.NoError(t, err)
	require.NoError(t, PrepareReorder(dev, 40), "again")
	after, err := reorderKernel(dev, 40)
	require.NoError(t, err)
	require.Same(t, before, after, "one kernel per head size")
	for _, bad := range []int{0, -8, 12} {
		require.Error(t, PrepareReorder(dev, bad), "heads of %d", bad)
	}
}
