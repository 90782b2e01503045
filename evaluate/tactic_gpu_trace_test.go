package evaluate

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/vk/vktest"
)

// TestTacticStepOnRealTraces runs the whole GPU decode step (clusters from
// the GPU's K-means, binned order, fit, union, gathered attention) over the
// real traces' 32 tail queries, as the incremental decoder would (the tail
// appended one token at a time), with the default fit (the moment
// estimate) and with the fitted curve, and asserts the targets: for layers 1 and
// 4 and P = 0.5, 0.7, 0.9, at least 85 % of (step, query head) cases reach
// mass P over the tokens they attend, and heads select at most 1.3 × the
// cluster-optimal count.
func TestTacticStepOnRealTraces(t *testing.T) {
	if testing.Short() {
		t.Skip("real-trace GPU steps skipped in -short mode")
	}
	dev := vktest.Open(t)
	for _, name := range []string{"L1", "L4"} {
		tr := readRealTrace(t, name)
		for _, fit := range []sparse.TacticFit{sparse.DefaultTacticFit(), sparse.TacticCurveFit()} {
			runs, err := TacticTrace(dev, tr, []float64{0.5, 0.7, 0.9}, fit, sparse.KMeansOptions{Seed: 1, Span: sparse.KMeansDefaultSpan}, 0, nil, nil)
			require.NoError(t, err)
			for _, r := range runs {
				t.Logf("%s moments=%v P %.1f: success %.1f %%, mass %.3f, selected %.1f %% (union %.1f %%), %.2f × cluster-optimal, rel. err %.3f",
					name, fit.Moments, r.P, 100*r.Success, r.Mass, r.SelectedPct, r.UnionPct, r.RatioToOpt, r.RelErr)
				require.GreaterOrEqual(t, r.Steps, 32, "the 32 consecutive tail queries")
				require.GreaterOrEqual(t, r.Success, 0.85, "%s moments=%v P %.1f: success rate", name, fit.Moments, r.P)
				require.LessOrEqual(t, r.RatioToOpt, 1.3, "%s moments=%v P %.1f: tokens selected over cluster-optimal", name, fit.Moments, r.P)
			}
		}
	}
}
