package evaluate

import (
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/workload"
)

// TestTacticCalibratedWorkloads checks the statistics that package
// workload documents for its calibrated layers at 16 384 tokens (seed 1,
// eight decode queries, as vkbench fidelity measures them): the mean share
// of the tokens that Tactic's selection takes per query head must lie
// within 25 % of the Tactic paper's figure (Table 9 for LlamaConfig; for
// MegaBeamConfig Table 10's P = 0.9 figure, as its P = 0.75 figure
// exceeds it and so cannot be met by a selection that grows with P). 25 %
// is the calibration target; other seeds move these shares by about 15 %
// at P = 0.75 and 10 % at P = 0.9. Success rates must reach 85 % and the
// tokens selected stay within 1.25× the cluster-optimal count. Each layer
// takes about 35 s on two cores (K-means over its 8 KV heads), so the
// MegaBeam layer runs only with VKSPARSE_CALIBRATION set.
func TestTacticCalibratedWorkloads(t *testing.T) {
	if testing.Short() {
		t.Skip("clusters a 16 384-token layer; skipped in -short mode")
	}
	for _, c := range []struct {
		name  string
		cfg   workload.Config
		paper map[float64]float64 // P → share of the tokens, per cent
		long  bool
	}{
		{"llama", workload.LlamaConfig(16384), map[float64]float64{0.75: 1.78, 0.9: 8.21}, false},
		{"megabeam", workload.MegaBeamConfig(16384), map[float64]float64{0.9: 10.5}, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			if c.long && os.Getenv("VKSPARSE_CALIBRATION") == "" {
				t.Skip("set VKSPARSE_CALIBRATION to check this layer too")
			}
			tr, err := workload.Generate(c.cfg)
			require.NoError(t, err)
			opts := DefaultTacticOptions()
			opts.P = []float64{0.75, 0.9}
			ev, err := Tactic(tr, opts)
			require.NoError(t, err)
			for _, r := range ev.Results {
				share := 100 * r.Selected / r.Attended
				t.Logf("P=%.2f: selected %.2f%% of the tokens per head, GQA union %.2f%%, success %.1f%%, selected/cluster-optimal %.3f",
					r.P, share, 100*r.Union/r.Attended, 100*r.SuccessRate, r.SelectedOverClusterOptimal)
				if want, ok := c.paper[r.P]; ok {
					assert.InEpsilonf(t, want, share, 0.25, "P=%.2f: per-head share of the tokens selected", r.P)
				}
				assert.GreaterOrEqualf(t, r.SuccessRate, 0.85, "P=%.2f: success rate", r.P)
				assert.LessOrEqualf(t, r.SelectedOverClusterOptimal, 1.25, "P=%.2f: selected/cluster-optimal", r.P)
			}
			assert.Less(t, ev.Results[0].Selected, ev.Results[1].Selected, "a higher P selects more")
		})
	}
}
