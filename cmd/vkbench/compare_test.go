package main

import (
	"bytes"
	"cmp"
	"errors"
	"image/png"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/vksparse/vksparse/evaluate"
	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/trace"
	"github.com/vksparse/vksparse/vk"
)

// testComparison is a made-up comparison at two P, listed in an order
// where a policy's tokens do not grow with P, so that the curves must be
// sorted.
func testComparison() *evaluate.Comparison {
	pr := func(policy, from string, budget, frac, mass, covered float64) evaluate.PolicyResult {
		r := evaluate.PolicyResult{Policy: policy, BudgetFrom: from, Budget: budget}
		r.Attended, r.Union, r.UnionFrac = 1000, frac*1000, frac
		r.Mass, r.Covered, r.SuccessRate, r.RelErr, r.MaxRelErr = mass, covered, 0.5, 0.01, 0.02
		r.BoundApplies, r.BoundWorst = policy != evaluate.PolicyDoubleP, 0.25
		return r
	}
	return &evaluate.Comparison{Tokens: 1000, QHeads: 4, KVHeads: 1, HeadDim: 8,
		Options: evaluate.CompareOptions{Setup: evaluate.Setup{Prefill: 992, Queries: []int{6, 7}, KMeansSpan: 2048}, DoubleP2: 0.7},
		Results: []evaluate.CompareResult{
			{P: 0.9, Policies: []evaluate.PolicyResult{
				pr(evaluate.PolicyTactic, "", 0, 0.2, 0.91, 0.91),
				pr(evaluate.PolicyDoubleP, "", 0, 0.15, 0.85, 0.93),
				pr(evaluate.PolicyQuest, evaluate.PolicyTactic, 180, 0.3, 0.88, 0.88),
			}},
			{P: 0.5, Policies: []evaluate.PolicyResult{
				pr(evaluate.PolicyTactic, "", 0, 0.02, 0.55, 0.55),
				pr(evaluate.PolicyDoubleP, "", 0, 0.05, 0.6, 0.7),
				pr(evaluate.PolicyQuest, evaluate.PolicyTactic, 18, 0.08, 0.4, 0.4),
			}},
		}}
}

func TestFidelityCurvesSortedByTokens(t *testing.T) {
	curves := fidelityCurves(testComparison())
	var names []string
	for _, c := range curves {
		names = append(names, c.Name)
		if len(c.Points) != 2 {
			t.Fatalf("%s: %d points, want one per P", c.Name, len(c.Points))
		}
		if !slices.IsSortedFunc(c.Points, func(a, b fidelityPoint) int { return cmp.Compare(a.TokensPct, b.TokensPct) }) {
			t.Errorf("%s: points not in order of tokens: %+v", c.Name, c.Points)
		}
		if c.Points[0].P != 0.5 || c.Points[1].P != 0.9 {
			t.Errorf("%s: points carry P %v, %v; want 0.5, 0.9", c.Name, c.Points[0].P, c.Points[1].P)
		}
	}
	want := []string{"tactic", "doublep", "quest (tactic budget)"}
	if !slices.Equal(names, want) {
		t.Errorf("curves %q, want %q", names, want)
	}
	// Double-P's mass counts the clusters it approximates.
	if got := curves[1].Points[1]; got.Mass != 0.93 || got.TokensPct != 15 {
		t.Errorf("doublep at P 0.9: %+v, want 15 %% of N and covered mass 0.93", got)
	}
}

func TestPrintFidelity(t *testing.T) {
	var b bytes.Buffer
	printFidelity(&b, []compareFidelity{{Source: "layer", Comparison: testComparison()}})
	lines := strings.Split(strings.TrimRight(b.String(), "\n"), "\n")
	if len(lines) != 2+6 {
		t.Fatalf("%d lines, want a summary, a header and 6 rows:\n%s", len(lines), b.String())
	}
	if !strings.Contains(lines[0], "2 queries × 4 heads") {
		t.Errorf("summary %q does not give queries and heads", lines[0])
	}
	for _, h := range []string{"policy", "budget from", "% of N", "mass", "success", "rel err", "bound"} {
		if !strings.Contains(lines[1], h) {
			t.Errorf("header %q lacks %q", lines[1], h)
		}
	}
	// Aligned: every line of the table ends at the same column.
	width := len([]rune(lines[1]))
	for _, l := range lines[2:] {
		if len([]rune(l)) != width {
			t.Errorf("row %q is not aligned with the header (%d runes, want %d)", l, len([]rune(l)), width)
		}
	}
	for _, c := range []struct{ row, want string }{
		{lines[2], "20.00%"},
		{lines[3], "—"}, // no bound for Double-P
		{lines[4], "tactic 180"},
		{lines[2], "0.250"},
	} {
		if !strings.Contains(c.row, c.want) {
			t.Errorf("row %q lacks %q", c.row, c.want)
		}
	}
}

func TestPlotCompareWritesPNG(t *testing.T) {
	path := filepath.Join(t.TempDir(), "compare.png")
	fids := []compareFidelity{{Source: "a", Comparison: testComparison()}, {Source: "b", Comparison: testComparison()}}
	if err := plotCompare(path, fids); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	img, err := png.Decode(f)
	if err != nil {
		t.Fatalf("not a PNG: %v", err)
	}
	if b := img.Bounds(); b.Dx() <= b.Dy() {
		t.Errorf("two panels and a legend drawn %d×%d, want wider than high", b.Dx(), b.Dy())
	}
	if err := plotCompare(path, nil); err == nil {
		t.Error("plotCompare drew nothing without an error")
	}
}

func TestFidelityFlag(t *testing.T) {
	var b autoBool
	if b.String() != "auto" || !b.on(true, 1<<20) || !b.on(false, fidelityAutoTokens) || b.on(false, fidelityAutoTokens+1) {
		t.Error("unset -fidelity: want auto, on for traces and for generated layers up to fidelityAutoTokens")
	}
	if err := b.Set("false"); err != nil || b.on(true, 10) {
		t.Errorf("-fidelity=false: %v, still on", err)
	}
	if err := b.Set("true"); err != nil || !b.on(false, 1<<30) {
		t.Errorf("-fidelity: %v, still off", err)
	}
	if err := b.Set("maybe"); err == nil {
		t.Error("-fidelity=maybe accepted")
	}
}

func TestLastQueries(t *testing.T) {
	// Queries at 3 and 10, then a tail at 20, 21, 22.
	tr := &trace.Trace{QPos: []int32{3, 10, 20, 21, 22}}
	for _, c := range []struct {
		k    int
		want []int
	}{{0, []int{2, 3, 4}}, {2, []int{3, 4}}, {3, []int{2, 3, 4}}, {8, []int{2, 3, 4}}} {
		if got := lastQueries(tr, c.k); !slices.Equal(got, c.want) {
			t.Errorf("lastQueries(%d) = %v, want %v", c.k, got, c.want)
		}
	}
}

func TestLogTicks125(t *testing.T) {
	var labels []string
	for _, tk := range logTicks125(0.3, 60) {
		if tk.Label != "" {
			labels = append(labels, tk.Label)
		}
	}
	if want := []string{"0.5", "1", "2", "5", "10", "20", "50"}; !slices.Equal(labels, want) {
		t.Errorf("labels %q, want %q", labels, want)
	}
}

// plotSteps shares savePanels with plotCompare.
func TestPlotStepsWritesPNG(t *testing.T) {
	var rows []stepRow
	for _, n := range []int{4096, 32768} {
		for _, p := range []float64{0.5, 0.9} {
			rows = append(rows, stepRow{Source: "w", TacticRun: evaluate.TacticRun{Tokens: n, P: p, Speedup: float64(n) / 4096, SelectedPct: 100 * p / 4}})
		}
	}
	path := filepath.Join(t.TempDir(), "steps.png")
	if err := plotSteps(path, rows); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := png.Decode(f); err != nil {
		t.Fatalf("not a PNG: %v", err)
	}
}

// TestCompareRunPrintsOneTable runs `vkbench compare` at a small size and
// checks that its table of steps is printed once, with a row per policy.
func TestCompareRunPrintsOneTable(t *testing.T) {
	out := filepath.Join(t.TempDir(), "stdout")
	f, err := os.Create(out)
	if err != nil {
		t.Fatal(err)
	}
	stdout := os.Stdout
	os.Stdout = f
	err = compare([]string{"-n", "1024", "-heads", "8", "-kv-heads", "2", "-dim", "64", "-fidelity=false", "-reps", "2", "-kinds", "mixed"})
	os.Stdout = stdout
	f.Close()
	if err != nil {
		if os.Getenv("VKSPARSE_REQUIRE_DEVICE") == "" && (errors.Is(err, vk.ErrNoLoader) || errors.Is(err, vk.ErrNoDevice)) {
			t.Skipf("no Vulkan device to run compare on (%v)", err)
		}
		t.Fatal(err)
	}
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	text := string(b)
	if n := strings.Count(text, "speed-up"); n != 1 {
		t.Fatalf("the table's header appears %d times, want once:\n%s", n, text)
	}
	if n := strings.Count(text, " tactic P=0.9 "); n != 1 {
		t.Fatalf("Tactic's row appears %d times, want once:\n%s", n, text)
	}
}

// TestCompareFallbacks checks that every policy compare runs that falls
// back to dense attention maps to a decode policy that does, with its
// budget, and that no other policy maps.
func TestCompareFallbacks(t *testing.T) {
	ps := []float64{0.8, 0.95}
	policies := compareFallbacks(ps, sparse.TacticDecoderOptions{Sinks: 4})
	for _, p := range evaluate.DefaultPolicies(ps) {
		d, ok := policies(p.Name, 321)
		if ok != p.FallsBack {
			t.Errorf("%s: mapped %v, falls back %v", p.Name, ok, p.FallsBack)
		}
		if !ok {
			continue
		}
		if !d.FallsBack() {
			t.Errorf("%s: maps to %s, which never falls back", p.Name, d)
		}
		if !d.Clustered() && !strings.Contains(d.String(), "321") {
			t.Errorf("%s: maps to %s, without its budget", p.Name, d)
		}
	}
}
