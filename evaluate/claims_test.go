package evaluate

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// claimsP are the target masses of the claims: Tactic's evaluation points
// and Double-P's own P1 of 0.95.
var claimsP = []float64{0.5, 0.7, 0.9, 0.95}

// claimsTacticCurve are the target masses of Tactic's curve of output
// error against tokens attended, fine enough to interpolate at Double-P's
// token counts, up to beyond what Double-P attends at P1 = 0.95.
var claimsTacticCurve = []float64{0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.925, 0.95, 0.96, 0.97, 0.98, 0.99}

// claimsErrFrom is the least P1 at which claim 2 of
// TestClaimsMatchedBudgets is asserted: the Double-P paper's targets (0.95
// for Llama-3.1-8B, 0.99 for Qwen-3-8B) and 0.9; below, it is logged.
const claimsErrFrom = 0.9

// interpolateErr returns the relative error of a curve (in ascending
// order of union size) at union size x, linear between its points; below
// the first point it returns the first point's error (a larger selection,
// so an error no greater than the curve's at x), and ok = false above the
// last.
func interpolateErr(curve []PolicyResult, x float64) (err float64, ok bool) {
	if x <= curve[0].Union {
		return curve[0].RelErr, true
	}
	for i := 1; i < len(curve); i++ {
		a, b := curve[i-1], curve[i]
		if x <= b.Union {
			w := (x - a.Union) / (b.Union - a.Union)
			return a.RelErr + w*(b.RelErr-a.RelErr), true
		}
	}
	return 0, false
}

// TestClaimsMatchedBudgets checks, on the real traces (layers 1 and 4, the
// 32 tail queries, prefill 16 320, all 8 query heads), what the Tactic and
// Double-P papers claim at matched budgets, with the float64 references
// (Compare):
//
//  1. Attention mass. At P = 0.5, 0.7, 0.9 and 0.95, Tactic's union reaches
//     more mass than Quest, StreamingLLM and H2O given Tactic's mean own
//     selection (tokens per query head, the always-attended ones
//     included); and the tokens Double-P attends exactly (P1 = P, P2 =
//     0.7) reach more mass than the three given Double-P's mean own exact
//     selection. Means over the (query, query head) cases.
//  2. Output error. At each of those P, Double-P's mean relative output
//     error is below Tactic's at the same mean number of exactly attended
//     tokens (the union of a KV head's query heads; Double-P's
//     pseudo-tokens, one per approximated cluster, are not counted).
//     Tactic's error at that count is interpolated linearly between the
//     points of its curve (Tactic at P = 0.3 … 0.99, ordered by union
//     size); below the curve's first point, that point's error stands in
//     for it (Tactic then attends more tokens than Double-P). Linear
//     interpolation of a convex falling curve and leaving the
//     pseudo-tokens out both favour Double-P slightly.
//
// Claim 2 is asserted from P1 = 0.9 (claimsErrFrom) and logged below: on
// layer 4 at P1 = 0.5 and 0.7 Double-P's error is 4 % and 1 % above
// Tactic's at the same tokens (0.0407 against 0.0390 at 317 tokens, 0.0288
// against 0.0286 at 504). In that sharply peaked layer the 4 sinks and
// the 64 recent tokens hold about 91 % of the mass, and at these targets the
// clusters Double-P ranks by size-weighted logits attend no better than
// Tactic's; from P1 = 0.9 (its own setting is 0.95) its error is 15–17 %
// below Tactic's, and on layer 1 22–68 % below at every P.
func TestClaimsMatchedBudgets(t *testing.T) {
	if testing.Short() {
		t.Skip("compares every policy on two real layers (about 40 s on 2 cores); skipped in -short mode")
	}
	var table []string
	row := func(format string, args ...any) { table = append(table, fmt.Sprintf(format, args...)) }
	type failure struct{ layer, claim string }
	var failures []failure
	for _, name := range []string{"L1", "L4"} {
		tr := readRealTrace(t, name)
		var queries []int
		for qi := tr.Queries() - traceTailQueries; qi < tr.Queries(); qi++ {
			queries = append(queries, qi)
		}
		start := time.Now()
		opts := DefaultCompareOptions()
		opts.Prefill, opts.Queries, opts.P = traceClusteredEnd, queries, claimsP
		opts.Policies = []string{PolicyTactic, PolicyDoubleP, PolicyQuest, PolicyStreaming, PolicyH2O}
		cmp, err := Compare(tr, opts)
		require.NoError(t, err)
		opts.P, opts.Policies, opts.BudgetFrom = claimsTacticCurve, []string{PolicyTactic}, nil
		curveRun, err := Compare(tr, opts)
		require.NoError(t, err)
		curve := curveRun.Curve(PolicyTactic, "")
		t.Logf("%s compared in %v", name, time.Since(start).Round(time.Millisecond))

		for _, r := range cmp.Results {
			require.Equal(t, traceTailQueries*tr.QHeads, r.Policies[0].Cases)
			for _, from := range []string{PolicyTactic, PolicyDoubleP} {
				src := r.Policy(from, "")
				row("%s P=%.2f %-8s tokens/head %6.1f union %7.1f (%5.2f%%)  mass %.3f  covered %.3f  success %5.1f%%  relerr %.4f",
					name, r.P, from, src.Own, src.Union, 100*src.UnionFrac, src.Mass, src.Covered, 100*src.SuccessRate, src.RelErr)
				for _, p := range FixedBudgetPolicies() {
					b := r.Policy(p, from)
					row("%s P=%.2f   %-9s at %-7s budget: tokens/head %6.1f union %7.1f (%5.2f%%)  mass %.3f  success %5.1f%%  relerr %.4f",
						name, r.P, p, from, b.Own, b.Union, 100*b.UnionFrac, b.Mass, 100*b.SuccessRate, b.RelErr)
					if !(src.Mass > b.Mass) {
						failures = append(failures, failure{name, fmt.Sprintf("P=%.2f: %s mass %.4f ≤ %s's %.4f at its budget", r.P, from, src.Mass, p, b.Mass)})
					}
				}
			}
			dp := r.Policy(PolicyDoubleP, "")
			tacticErr, ok := interpolateErr(curve, dp.Union)
			if !ok {
				failures = append(failures, failure{name, fmt.Sprintf("P=%.2f: Double-P attends %.1f tokens, beyond Tactic's curve (%.1f at P=0.99)", r.P, dp.Union, curve[len(curve)-1].Union)})
				continue
			}
			row("%s P=%.2f doublep union %7.1f (+%.1f pseudo-tokens per head): relerr %.4f, Tactic at %.1f tokens %.4f (ratio %.2f)",
				name, r.P, dp.Union, dp.Approximated, dp.RelErr, dp.Union, tacticErr, dp.RelErr/tacticErr)
			switch {
			case dp.RelErr >= tacticErr && r.P < claimsErrFrom:
				row("%s P=%.2f   claim 2 does not hold below the papers' targets (logged)", name, r.P)
			case dp.RelErr >= tacticErr:
				failures = append(failures, failure{name, fmt.Sprintf("P=%.2f: Double-P relerr %.4f ≥ Tactic's %.4f at %.1f tokens", r.P, dp.RelErr, tacticErr, dp.Union)})
			}
		}
		for _, c := range curve {
			row("%s tactic curve: union %7.1f (%5.2f%%) relerr %.4f mass %.3f", name, c.Union, 100*c.UnionFrac, c.RelErr, c.Mass)
		}
	}
	t.Log("\n" + strings.Join(table, "\n"))
	for _, f := range failures {
		t.Errorf("%s: %s", f.layer, f.claim)
	}
}
