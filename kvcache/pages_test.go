package kvcache

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/vk/vktest"
)

// TestNewPages checks a page index read back: pages of 16 over a range
// whose last page is short, and single-token pages, every head the same,
// centroids zero, single tokens reported only for pages of one; and that
// bad shapes are refused.
func TestNewPages(t *testing.T) {
	dev := vktest.Open(t)
	for _, tc := range []struct{ first, count, size int }{{4, 100, 16}, {0, 64, 16}, {3, 7, 1}, {5, 9, 32}} {
		x, err := NewPages(dev, 2, 8, tc.first, tc.count, tc.size)
		require.NoError(t, err)
		c := (tc.count + tc.size - 1) / tc.size
		require.Equal(t, c, x.C)
		require.True(t, x.Contiguous)
		require.Equal(t, tc.size, x.PageSize)
		require.Equal(t, tc.size == 1, x.SingleTokens(), "every page one token")
		require.Equal(t, tc.first, x.First)
		require.Equal(t, tc.count, x.Count)
		for g := 0; g < 2; g++ {
			h, err := x.Read(g)
			require.NoError(t, err)
			for j, mem := range h.Members {
				lo := tc.first + j*tc.size
				hi := min(lo+tc.size, tc.first+tc.count)
				require.Len(t, mem, hi-lo, "head %d page %d", g, j)
				for i, tok := range mem {
					require.Equal(t, int32(lo+i), tok)
				}
			}
			for r, a := range h.Assign {
				require.Equal(t, int32(r/tc.size), a)
			}
			for _, v := range h.Centroids {
				require.Zero(t, v)
			}
		}
		require.NoError(t, x.Release())
	}
	for _, bad := range [][3]int{{0, 0, 16}, {-1, 10, 16}, {0, 10, 0}} {
		_, err := NewPages(dev, 2, 8, bad[0], bad[1], bad[2])
		require.Error(t, err, "%v", bad)
	}
}
