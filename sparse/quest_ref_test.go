package sparse

import (
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestQuestBoundsAreUpperBounds checks on fresh random keys (odd head
// dimensions, odd page sizes and spans, a short last page) that every
// page's bound is at least the largest q·k over its keys, that it is
// attained exactly on pages of one token, and that the page metadata is the
// channel-wise min and max.
func TestQuestBoundsAreUpperBounds(t *testing.T) {
	r := baselineRand(t)
	for trial := 0; trial < 40; trial++ {
		d := 1 + r.IntN(13)
		n := 1 + r.IntN(300)
		start := r.IntN(n + 1)
		end := start + r.IntN(n-start+1)
		size := 1 + r.IntN(20)
		keys := randMatrix(r, n, d)
		pages, err := QuestPagesRef(keys, d, start, end, size)
		require.NoError(t, err)
		require.Equal(t, (end-start+size-1)/size, pages.Pages())
		for rep := 0; rep < 5; rep++ {
			q := randMatrix(r, 1, d)
			u, err := pages.BoundsRef(q)
			require.NoError(t, err)
			covered := start
			for j := range u {
				lo, hi := pages.Page(j)
				require.Equal(t, covered, lo)
				require.True(t, hi > lo && hi-lo <= size)
				covered = hi
				best := math.Inf(-1)
				for tok := lo; tok < hi; tok++ {
					best = math.Max(best, dot(q, keys[tok*d:(tok+1)*d]))
					for i := 0; i < d; i++ {
						x := keys[tok*d+i]
						require.True(t, pages.Min[j*d+i] <= x && x <= pages.Max[j*d+i])
					}
				}
				require.GreaterOrEqualf(t, u[j], best-1e-12*(1+math.Abs(best)), "page %d of [%d, %d)", j, start, end)
				if hi-lo == 1 {
					require.InDelta(t, best, u[j], 1e-12*(1+math.Abs(best)))
				}
			}
			require.Equal(t, end, covered)
		}
	}
}

// TestQuestSelectTopPages checks the pages Quest selects: k = ⌊budget/16⌋ of
// them (all when the budget covers the middle), every selected page's bound
// above every other's or equal with a lower index. Pages are duplicated so
// that ties occur.
func TestQuestSelectTopPages(t *testing.T) {
	r := baselineRand(t)
	for trial := 0; trial < 30; trial++ {
		d := 1 + 2*r.IntN(6)
		n := 1 + r.IntN(400)
		keys := randMatrix(r, n, d)
		start := r.IntN(min(n, 9))
		// Copy page 0 over a few other pages to create equal bounds.
		for j := 1; j < 4 && start+(j+1)*QuestPageSize <= n; j++ {
			if r.IntN(2) == 0 {
				copy(keys[(start+j*QuestPageSize)*d:(start+(j+1)*QuestPageSize)*d], keys[start*d:(start+QuestPageSize)*d])
			}
		}
		pages, err := QuestPagesRef(keys, d, start, n, QuestPageSize)
		require.NoError(t, err)
		q := randMatrix(r, 1, d)
		u, err := pages.BoundsRef(q)
		require.NoError(t, err)
		for _, b := range baselineBudgets(r, n-start) {
			got, err := QuestSelectRef(q, pages, b)
			require.NoError(t, err)
			in := map[int32]bool{}
			for i, x := range got {
				in[x] = true
				if i > 0 {
					require.Less(t, got[i-1], x)
				}
			}
			chosen := map[int]bool{}
			for j := 0; j < pages.Pages(); j++ {
				lo, hi := pages.Page(j)
				c := 0
				for tok := lo; tok < hi; tok++ {
					if in[int32(tok)] {
						c++
					}
				}
				require.Truef(t, c == 0 || c == hi-lo, "page %d partly selected", j)
				chosen[j] = c > 0
			}
			k := 0
			for _, c := range chosen {
				if c {
					k++
				}
			}
			want := min(b/QuestPageSize, pages.Pages())
			if b >= n-start {
				want = pages.Pages()
			}
			require.Equalf(t, want, k, "budget %d", b)
			for a := range u {
				for c := range u {
					if chosen[a] && !chosen[c] {
						require.Truef(t, u[a] > u[c] || (u[a] == u[c] && a < c), "page %d (%v) chosen over %d (%v)", a, u[a], c, u[c])
					}
				}
			}
		}
	}
}

func TestQuestDecodeRef(t *testing.T) {
	r := baselineRand(t)
	const d = 9
	l := DefaultBaselineLayout()
	for _, n := range []int{1, 4, 60, 68, 69, 85, 333 + r.IntN(200)} {
		keys, values := randMatrix(r, n, d), randMatrix(r, n, d)
		qs := [][]float64{randMatrix(r, 1, d), randMatrix(r, 1, d), randMatrix(r, 1, d), randMatrix(r, 1, d)}
		lo, hi := l.Middle(n)
		pages, err := QuestPagesRef(keys, d, lo, hi, QuestPageSize)
		require.NoError(t, err)
		for _, b := range baselineBudgets(r, hi-lo) {
			outs, tokens, own, err := QuestDecodeRef(qs, keys, values, 0.4, l, b)
			require.NoError(t, err)
			for j, q := range qs {
				mid, err := QuestSelectRef(q, pages, b)
				require.NoError(t, err)
				require.Equal(t, UnionTokens(l.Fixed(n), mid), own[j])
			}
			require.Equal(t, UnionTokens(own...), tokens)
			if b == 0 {
				require.Equal(t, l.Fixed(n), tokens)
			}
			for j, q := range qs {
				want, err := AttendSubsetRef(q, keys, values, tokens, 0.4)
				require.NoError(t, err)
				require.Equal(t, want, outs[j])
				if b >= hi-lo {
					require.Len(t, tokens, n)
					dense, err := AttendRef(q, keys, values, 0.4)
					require.NoError(t, err)
					require.InDeltaSlice(t, dense, outs[j], 1e-12)
				}
			}
		}
	}
	keys := randMatrix(r, 100, d)
	qs := [][]float64{randMatrix(r, 1, d)}
	pages, err := QuestPagesRef(keys, d, 4, 36, QuestPageSize)
	require.NoError(t, err)
	for name, f := range map[string]func() error{
		"budget":   func() error { _, _, _, err := QuestDecodeRef(qs, keys, keys, 1, l, -1); return err },
		"scale":    func() error { _, _, _, err := QuestDecodeRef(qs, keys, keys, -1, l, 1); return err },
		"scaleNaN": func() error { _, _, _, err := QuestDecodeRef(qs, keys, keys, math.NaN(), l, 1); return err },
		"layout": func() error {
			_, _, _, err := QuestDecodeRef(qs, keys, keys, 1, BaselineLayout{Window: -2}, 1)
			return err
		},
		"heads":     func() error { _, _, _, err := QuestDecodeRef(nil, keys, keys, 1, l, 1); return err },
		"values":    func() error { _, _, _, err := QuestDecodeRef(qs, keys, keys[:d], 1, l, 1); return err },
		"pages":     func() error { _, err := QuestPagesRef(keys, d, 4, 101, 16); return err },
		"pageSize":  func() error { _, err := QuestPagesRef(keys, d, 4, 36, 0); return err },
		"reversed":  func() error { _, err := QuestPagesRef(keys, d, 36, 4, 16); return err },
		"dim":       func() error { _, err := pages.BoundsRef([]float64{1}); return err },
		"selectNil": func() error { _, err := QuestSelectRef(qs[0], nil, 1); return err },
		"selectNeg": func() error { _, err := QuestSelectRef(qs[0], pages, -1); return err },
	} {
		assert.Error(t, f(), name)
	}
}
