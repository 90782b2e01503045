package evaluate

import (
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/sparse"
)

// TestKMeansSpanFidelityRealTraces compares Tactic's selection over
// K-means within spans of sparse.KMeansDefaultSpan tokens with
// whole-context K-means on the real traces (layers 1 and 4, the 32 tail
// queries, all query heads), by the float64 references. A run has 256 cases per P, so
// one clustering seed moves the success rate by about 1.5 points either
// way; the figures are therefore pooled over three seeds. At every P the
// spans' success rate must be at most 2 points below the whole context's,
// and their mean tokens selected within 5 % of it.
func TestKMeansSpanFidelityRealTraces(t *testing.T) {
	if testing.Short() {
		t.Skip("clusters two layers six times; skipped in -short mode")
	}
	const seeds = 3
	var table []string
	for _, name := range []string{"L1", "L4"} {
		tr := readRealTrace(t, name)
		// pooled[span index][P index]: success rate and tokens selected,
		// summed over the seeds.
		var pooled [2][]TacticStats
		for i, span := range []int{0, sparse.KMeansDefaultSpan} {
			for s := 0; s < seeds; s++ {
				opts := DefaultTacticOptions()
				opts.Prefill = traceClusteredEnd
				for qi := tr.Queries() - traceTailQueries; qi < tr.Queries(); qi++ {
					opts.Queries = append(opts.Queries, qi)
				}
				opts.KMeansSpan = span
				opts.Seed += uint64(1000 * s)
				ev, err := Tactic(tr, opts)
				require.NoError(t, err)
				if pooled[i] == nil {
					pooled[i] = make([]TacticStats, len(ev.Results))
				}
				for pi, r := range ev.Results {
					pooled[i][pi].SuccessRate += r.SuccessRate / seeds
					pooled[i][pi].Selected += r.Selected / seeds
				}
			}
		}
		for pi, p := range DefaultTacticOptions().P {
			whole, spans := pooled[0][pi], pooled[1][pi]
			table = append(table, fmt.Sprintf("%s P=%.1f  success %5.1f%% → %5.1f%% (%+.1f points)  selected %7.1f → %7.1f (%+.1f %%)",
				name, p, 100*whole.SuccessRate, 100*spans.SuccessRate, 100*(spans.SuccessRate-whole.SuccessRate),
				whole.Selected, spans.Selected, 100*(spans.Selected/whole.Selected-1)))
			assert.GreaterOrEqualf(t, spans.SuccessRate, whole.SuccessRate-0.02, "%s P=%.1f: success rate with spans", name, p)
			assert.InEpsilonf(t, whole.Selected, spans.Selected, 0.05, "%s P=%.1f: tokens selected with spans", name, p)
		}
	}
	t.Logf("whole context → spans of %d tokens, over %d seeds:\n%s", sparse.KMeansDefaultSpan, seeds, strings.Join(table, "\n"))
}
