package sparse

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/kvcache"
)

// TestStreamingStepMatchesReference runs StreamingLLM steps, which have no
// selection stage, and checks the output against StreamingDecodeRef: with
// the dropped middle as one page never taken (NewStreamingStep) for
// budgets of none, some and all of the middle; over pages of 16 whose last page is short, with the
// budget the whole pages taken hold (the fewest most recent pages holding
// at least the budget); and that such a step can be timed.
func TestStreamingStepMatchesReference(t *testing.T) {
	f := newBaselineFixture(t, 3000)
	layout := DefaultBaselineLayout()
	check := func(step *Step, budget int, what string) {
		t.Helper()
		require.Empty(t, step.Selector().Stages())
		require.Equal(t, []string{"attend"}, step.Stages())
		got := f.run(t, step)
		var want []float64
		for g := 0; g < f.h.KV; g++ {
			keys, values := f.kv(g)
			outs, tokens, err := StreamingDecodeRef(f.queryHeadsOf(g), keys, values, f.scale, layout, budget)
			require.NoError(t, err)
			if g == 0 {
				t.Logf("%s: %d of %d tokens", what, len(tokens), f.n)
			}
			for _, o := range outs {
				want = append(want, o...)
			}
		}
		requireClose(t, want, got, f.h.Dim, 1e-3, what)
	}
	for _, budget := range []int{0, 100, 1000, f.hi - f.lo, 5000} {
		step, err := NewStreamingStep(f.dense, f.layer, budget)
		require.NoError(t, err)
		taken := 0 // the dropped tokens are one page, taken only when the budget covers the middle
		if budget >= f.hi-f.lo {
			taken = 1
		}
		require.Equal(t, taken, step.Selector().(*StreamingSelector).Pages())
		check(step, budget, fmt.Sprintf("budget %d", budget))
		require.NoError(t, step.Release())
	}
	pages, err := kvcache.NewPages(f.dev, f.h.KV, f.h.Dim, f.lo, f.hi-f.lo, QuestPageSize)
	require.NoError(t, err)
	defer pages.Release()
	short := (f.hi - f.lo) % QuestPageSize
	require.NotZero(t, short, "the fixture's last page is short")
	for _, c := range []struct{ budget, pages, held int }{{0, 0, 0}, {1, 1, short}, {short + 16, 2, short + 16}, {short + 17, 3, short + 32}} {
		sel, err := NewStreamingSelector(f.dense, pages, c.budget)
		require.NoError(t, err)
		require.Equal(t, c.pages, sel.Pages(), "budget %d", c.budget)
		step, err := NewStep(f.dense, f.layer, sel)
		require.NoError(t, err)
		check(step, c.held, fmt.Sprintf("pages of 16, budget %d (%d pages)", c.budget, c.pages))
		require.NoError(t, step.Release())
	}
	_, err = NewStreamingSelector(f.dense, pages, -1)
	require.Error(t, err)

	// Timing a step of attention alone.
	step, err := NewStreamingStep(f.dense, f.layer, 256)
	require.NoError(t, err)
	defer step.Release()
	require.NoError(t, step.SetQuery(f.q))
	stages, total, err := step.TimeStages(1, 2)
	require.NoError(t, err)
	require.Len(t, stages, 1)
	require.Greater(t, total, time.Duration(0))
}
