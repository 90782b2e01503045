package evaluate

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/trace"
	"github.com/vksparse/vksparse/workload"
)

// Evaluation setup on the real traces (see testdata/traces/README.md at
// the repository root).
const (
	traceClusteredEnd = 16320 // keys [0, 16320) are the prefill
	traceTailQueries  = 32    // the last 32 queries are decode steps
)

// tracesDir returns $VKSPARSE_TRACES or the repository's testdata/traces
// (tests run in the package's folder).
func tracesDir() string {
	if d := os.Getenv("VKSPARSE_TRACES"); d != "" {
		return d
	}
	return filepath.Join("..", "testdata", "traces")
}

// readRealTrace reads the real trace of layer name ("L1", "L4"), skipping
// the test when it is missing unless VKSPARSE_REQUIRE_TRACES is set.
func readRealTrace(t *testing.T, name string) *trace.Trace {
	path := filepath.Join(tracesDir(), "trace-shared_http_serve_test-"+name+".safetensors")
	if _, err := os.Stat(path); err != nil {
		if os.Getenv("VKSPARSE_REQUIRE_TRACES") != "" {
			t.Fatalf("real trace %s missing but VKSPARSE_REQUIRE_TRACES is set: %v", path, err)
		}
		t.Skipf("real trace %s not available (it lives in testdata/traces; VKSPARSE_TRACES names another folder): %v", path, err)
	}
	tr, err := trace.Read(path)
	require.NoError(t, err)
	return tr
}

// evalRow formats the overall figures of one (source, P): success and mass
// of the attended union (own selection in brackets), own selection size,
// cluster-optimal, their ratio, global-optimal, union size, the relative
// output error of union attention and the worst case of the error bound.
func evalRow(name string, r TacticResult) string {
	return fmt.Sprintf("%s P=%.1f  success %5.1f%% (own %5.1f%%)  mass %.3f (own %.3f, min %.3f)  selected %7.1f  cluster-opt %7.1f  ratio %.3f  global-opt %7.1f  union %7.1f  relerr %.4f  bound %.3f",
		name, r.P, 100*r.SuccessRate, 100*r.OwnSuccessRate, r.Mass, r.OwnMass, r.MinMass,
		r.Selected, r.ClusterOptimal, r.SelectedOverClusterOptimal, r.GlobalOptimal, r.Union, r.RelErr, r.BoundWorst)
}

// requireBound checks ‖o − ô‖ ≤ 2(1 − p(I))·max‖v_i‖ on every case.
func requireBound(t *testing.T, name string, ev *TacticEvaluation) {
	for _, r := range ev.Results {
		require.LessOrEqualf(t, r.BoundWorst, 1.0, "%s P=%.1f: ‖o − ô‖ exceeds 2(1 − p(I))·max‖v‖", name, r.P)
	}
}

// TestTacticRealTraces is the fidelity evaluation on the real traces: for
// layers 1 and 4 and P = 0.5, 0.7, 0.9, each query head attends the union of
// the selections of its GQA group (plus sinks and tail). Across the (tail
// query, query head) pairs the attended mass must reach P at least 85 % of
// the time, and the mean of each head's own selection (before the union,
// sinks and tail included) must stay within 1.3× the mean cluster-optimal
// count (ClusterTopPCount with the sinks and tail forced).
func TestTacticRealTraces(t *testing.T) {
	var table []string
	var evs []*TacticEvaluation
	names := []string{"L1", "L4"}
	for _, name := range names {
		tr := readRealTrace(t, name)
		opts := DefaultTacticOptions()
		opts.Prefill = traceClusteredEnd
		for qi := tr.Queries() - traceTailQueries; qi < tr.Queries(); qi++ {
			opts.Queries = append(opts.Queries, qi)
		}
		start := time.Now()
		ev, err := Tactic(tr, opts)
		require.NoError(t, err)
		t.Logf("%s evaluated in %v", name, time.Since(start).Round(time.Millisecond))
		for _, r := range ev.Results {
			require.Equal(t, traceTailQueries*tr.QHeads, r.Cases)
			table = append(table, evalRow(name, r))
		}
		evs = append(evs, ev)
	}
	t.Log("\n" + strings.Join(table, "\n"))
	for i, ev := range evs {
		requireBound(t, names[i], ev)
		for _, r := range ev.Results {
			require.GreaterOrEqualf(t, r.SuccessRate, 0.85, "%s P=%.1f success rate", names[i], r.P)
			require.LessOrEqualf(t, r.SelectedOverClusterOptimal, 1.3, "%s P=%.1f tokens selected / cluster-optimal", names[i], r.P)
		}
	}
}

// TestTacticGeneratedWorkload evaluates Tactic on the generator's layer at
// 32768 tokens (all 32 query heads, its 8 decode queries): for P = 0.5,
// 0.7, 0.9 the union must reach P in at least 85 % of the cases, the mean
// union mass must reach P, and the mean own selection must stay within
// 1.25× the mean cluster-optimal count.
func TestTacticGeneratedWorkload(t *testing.T) {
	if testing.Short() {
		t.Skip("clusters 8 KV heads of 32768 tokens; skipped in -short mode")
	}
	tr, err := workload.Generate(workload.DefaultConfig(32768))
	require.NoError(t, err)
	start := time.Now()
	ev, err := Tactic(tr, DefaultTacticOptions())
	require.NoError(t, err)
	t.Logf("evaluated in %v", time.Since(start).Round(time.Millisecond))
	var table []string
	for _, r := range ev.Results {
		require.Equal(t, tr.Queries()*tr.QHeads, r.Cases)
		table = append(table, evalRow("gen-32768", r))
		byKind := map[string][]TacticHead{}
		for _, h := range r.Heads {
			byKind[h.Kind] = append(byKind[h.Kind], h)
		}
		for _, kind := range []string{"streaming", "retrieval", "topic"} {
			var sel, opt, succ, mass float64
			for _, h := range byKind[kind] {
				sel += h.Selected
				opt += h.ClusterOptimal
				succ += h.SuccessRate
				mass += h.Mass
			}
			n := float64(len(byKind[kind]))
			table = append(table, fmt.Sprintf("    %-9s success %5.1f%%  mass %.3f  selected %7.1f  cluster-opt %7.1f  ratio %.3f",
				kind, 100*succ/n, mass/n, sel/n, opt/n, sel/opt))
		}
	}
	t.Log("\n" + strings.Join(table, "\n"))
	requireBound(t, "gen-32768", ev)
	for _, r := range ev.Results {
		require.GreaterOrEqualf(t, r.SuccessRate, 0.85, "P=%.1f success rate", r.P)
		require.GreaterOrEqualf(t, r.Mass, r.P, "P=%.1f mean union mass", r.P)
		require.LessOrEqualf(t, r.SelectedOverClusterOptimal, 1.25, "P=%.1f tokens selected / cluster-optimal", r.P)
	}
}
