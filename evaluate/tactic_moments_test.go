package evaluate

import (
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/trace"
	"github.com/vksparse/vksparse/workload"
)

// TestTacticMomentsFidelity compares Tactic's moment estimate
// (sparse.TacticFit.Moments: no key rows sampled) with the fitted curve on
// the real traces and the generator's layer at 32 768 tokens, at P = 0.5,
// 0.7 and 0.9: the moment estimate's success rate (the union reaching P)
// must stay within a point of the fit's, its own selections within 5 % of
// the fit's tokens or fewer, and its selection must read less (the fixed tokens' rows, no others).
func TestTacticMomentsFidelity(t *testing.T) {
	type source struct {
		name string
		tr   *trace.Trace
		opts TacticOptions
	}
	var sources []source
	for _, name := range []string{"L1", "L4"} {
		opts := DefaultTacticOptions()
		opts.Prefill = traceClusteredEnd
		tr := readRealTrace(t, name)
		for qi := tr.Queries() - traceTailQueries; qi < tr.Queries(); qi++ {
			opts.Queries = append(opts.Queries, qi)
		}
		sources = append(sources, source{name, tr, opts})
	}
	if !testing.Short() {
		tr, err := workload.Generate(workload.DefaultConfig(32768))
		require.NoError(t, err)
		sources = append(sources, source{"gen-32768", tr, DefaultTacticOptions()})
	}
	var table []string
	for _, s := range sources {
		fitted, err := Tactic(s.tr, s.opts)
		require.NoError(t, err)
		opts := s.opts
		opts.Fit.Moments = true
		moments, err := Tactic(s.tr, opts)
		require.NoError(t, err)
		requireBound(t, s.name+" moments", moments)
		for i, m := range moments.Results {
			f := fitted.Results[i]
			table = append(table, fmt.Sprintf("%-9s P=%.1f  success %5.1f%% / fit %5.1f%%  selected %8.1f / fit %8.1f (%.3f)  union %8.1f / %8.1f  selection share %.3f / %.3f",
				s.name, m.P, 100*m.SuccessRate, 100*f.SuccessRate, m.Selected, f.Selected, m.Selected/f.Selected,
				m.Union, f.Union, m.Traffic.SelectionShare(), f.Traffic.SelectionShare()))
		}
		for i, m := range moments.Results {
			f := fitted.Results[i]
			require.GreaterOrEqualf(t, m.SuccessRate, f.SuccessRate-0.01, "%s P=%.1f: success rate", s.name, m.P)
			require.LessOrEqualf(t, m.Selected, 1.05*f.Selected, "%s P=%.1f: tokens selected", s.name, m.P)
			require.Lessf(t, m.Traffic.Sampled, f.Traffic.Sampled, "%s P=%.1f: the moment estimate reads only the fixed tokens' rows", s.name, m.P)
			require.Lessf(t, m.Traffic.Selection(), f.Traffic.Selection(), "%s P=%.1f: selection bytes", s.name, m.P)
		}
	}
	t.Log("\n" + strings.Join(table, "\n"))
}
