package vk

import (
	"math/rand"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestBlockRanges takes and gives back random ranges of one block: ranges
// handed out are aligned, inside the block and never overlap; the free
// list stays sorted with no two ranges adjacent; once everything is given
// back the block is one free range again.
func TestBlockRanges(t *testing.T) {
	rng := rand.New(rand.NewSource(5))
	const size = 1 << 16
	b := &block{free: []span{{0, size}}}
	held := map[uint64]uint64{} // offset → size
	check := func() {
		t.Helper()
		var sum uint64
		for i, s := range b.free {
			require.Positive(t, s.size)
			require.LessOrEqual(t, s.off+s.size, uint64(size))
			if i > 0 {
				require.Greater(t, s.off, b.free[i-1].off+b.free[i-1].size, "free ranges %v and %v touch or overlap", b.free[i-1], s)
			}
			sum += s.size
		}
		var used uint64
		for off, n := range held {
			used += n
			for _, s := range b.free {
				require.False(t, off < s.off+s.size && s.off < off+n, "[%d,%d) held and free", off, off+n)
			}
		}
		require.Equal(t, used, b.used)
		require.LessOrEqual(t, sum+used, uint64(size))
	}
	for range 3000 {
		if len(held) > 0 && rng.Intn(3) == 0 {
			for off, n := range held {
				b.give(off, n)
				delete(held, off)
				break
			}
		} else {
			n := uint64(1 + rng.Intn(3000))
			align := uint64(1) << rng.Intn(9)
			off, ok := b.take(n, align)
			if !ok {
				continue
			}
			require.Zero(t, off%align, "offset %d for alignment %d", off, align)
			for o, m := range held {
				require.False(t, off < o+m && o < off+n, "[%d,%d) overlaps [%d,%d)", off, off+n, o, o+m)
			}
			held[off] = n
		}
		check()
	}
	for off, n := range held {
		b.give(off, n)
	}
	require.Equal(t, []span{{0, size}}, b.free)
	require.Zero(t, b.used)
	_, ok := b.take(size+1, 1)
	require.False(t, ok, "a range larger than the block")
}
