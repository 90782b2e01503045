package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"image/png"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/vksparse/vksparse/evaluate"
	"github.com/vksparse/vksparse/vk"
)

// runCaptured runs a vkbench command with its stdout in a file and
// returns what it printed; it skips the test where no device is present
// and none is required.
func runCaptured(t *testing.T, cmd func([]string) error, args ...string) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), "stdout")
	f, err := os.Create(out)
	if err != nil {
		t.Fatal(err)
	}
	stdout := os.Stdout
	os.Stdout = f
	err = cmd(args)
	os.Stdout = stdout
	f.Close()
	if err != nil {
		if os.Getenv("VKSPARSE_REQUIRE_DEVICE") == "" && (errors.Is(err, vk.ErrNoLoader) || errors.Is(err, vk.ErrNoDevice)) {
			t.Skipf("no Vulkan device (%v)", err)
		}
		t.Fatal(err)
	}
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// readResults decodes the results of a file writeJSON wrote into v.
func readResults(t *testing.T, path string, v any) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		Results json.RawMessage `json:"results"`
	}
	if err := json.Unmarshal(b, &doc); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(doc.Results, v); err != nil {
		t.Fatal(err)
	}
}

// checkSkeleton fails unless sk has a positive byte count for each of the
// step's stages, positive times and the step's median over them.
func checkSkeleton(t *testing.T, name string, sk *evaluate.Skeleton, stages int, stepUs float64) {
	t.Helper()
	if sk == nil {
		t.Errorf("%s: no skeleton", name)
		return
	}
	if len(sk.Stages) != stages || len(sk.Bytes) != stages || len(sk.StageUs) != stages {
		t.Errorf("%s: skeleton of %d stages, %d byte counts and %d times for a step of %d dispatches", name, len(sk.Stages), len(sk.Bytes), len(sk.StageUs), stages)
	}
	for i, b := range sk.Bytes {
		if !(b > 0) {
			t.Errorf("%s: stage %d reads %v bytes", name, i, b)
		}
	}
	if !(sk.Us > 0) || !(sk.StepOver > 0) {
		t.Errorf("%s: skeleton %v µs, step over skeleton %v", name, sk.Us, sk.StepOver)
	}
	if d := sk.StepOver*sk.Us - stepUs; d*d > 1e-6*stepUs*stepUs {
		t.Errorf("%s: step / skeleton %v × %v µs is not the step's %v µs", name, sk.StepOver, sk.Us, stepUs)
	}
}

// TestCompareTimesEverySkeleton runs `vkbench compare` at a small size,
// batches of 1 and 2, and checks that every policy's step (at batch 2
// every one that batches: all but LuKA's) is printed and written with its
// skeleton: a byte count per stage, counted from the step, and a positive
// step over skeleton; attention reads no more than dense attention would,
// and a batch of 2 scores twice the centroids of one sequence.
func TestCompareTimesEverySkeleton(t *testing.T) {
	dir := t.TempDir()
	jsonPath, plotPath := filepath.Join(dir, "steps.json"), filepath.Join(dir, "steps.png")
	const n, kv, dim = 512, 2, 64
	text := runCaptured(t, compare, "-n", "512", "-heads", "8", "-kv-heads", "2", "-dim", "64", "-fidelity=false", "-reps", "3", "-kinds", "llama", "-p", "0.9", "-batch", "1,2", "-json", jsonPath, "-plot", plotPath)
	for _, h := range []string{"step/skeleton", "skeleton µs", "stages MB", "dense fallback"} {
		if !strings.Contains(text, h) {
			t.Errorf("the table has no column %q:\n%s", h, text)
		}
	}
	var report compareReport
	readResults(t, jsonPath, &report)
	got := map[int]map[string]*evaluate.StepRun{1: {}, 2: {}}
	for i, r := range report.Steps {
		if got[r.Batch] == nil {
			t.Fatalf("%s: batch %d", r.Policy, r.Batch)
		}
		got[r.Batch][r.Policy] = &report.Steps[i].StepRun
		name := fmt.Sprintf("%s, batch %d", r.Policy, r.Batch)
		checkSkeleton(t, name, r.Skeleton, r.Dispatches, r.StepUs)
		if r.Skeleton == nil || len(r.Skeleton.Bytes) == 0 {
			continue
		}
		dense := float64(r.Batch * 2 * n * kv * dim * 2)
		if a := r.Skeleton.Bytes[len(r.Skeleton.Bytes)-1]; a > dense*1.05 {
			t.Errorf("%s: attention reads %v bytes, dense attention %v", name, a, dense)
		}
	}
	for _, r := range report.Steps {
		falls := r.Policy == "double-p" || r.Policy == "quest" || r.Policy == "streaming" || r.Policy == "h2o" || strings.HasPrefix(r.Policy, "tactic")
		switch {
		case falls && !(r.DenseChoice == "dense" || r.DenseChoice == "policy" || strings.HasPrefix(r.DenseChoice, "dense ")):
			t.Errorf("%s, batch %d: dense fallback %q, want the cost model's choice", r.Policy, r.Batch, r.DenseChoice)
		case !falls && r.DenseChoice != "-":
			t.Errorf("%s never falls back, yet its choice is %q", r.Policy, r.DenseChoice)
		case falls && len(r.Costs) != r.Batch:
			t.Errorf("%s, batch %d: %d costs", r.Policy, r.Batch, len(r.Costs))
		case falls && (len(r.StepModelUs) != r.Batch || r.DenseModelUs <= 0):
			t.Errorf("%s, batch %d: priced steps %v against dense %v, want one a sequence", r.Policy, r.Batch, r.StepModelUs, r.DenseModelUs)
		case falls:
			dense := 0
			for _, us := range r.StepModelUs {
				if us > r.DenseModelUs {
					dense++
				}
			}
			if want := map[int]string{0: "policy", r.Batch: "dense"}[dense]; want != "" && r.DenseChoice != want {
				t.Errorf("%s, batch %d: chose %q with steps priced %v against dense %v", r.Policy, r.Batch, r.DenseChoice, r.StepModelUs, r.DenseModelUs)
			}
		}
	}
	if report.CostModel == nil || report.CostModel.Validate() != nil {
		t.Errorf("cost model %+v", report.CostModel)
	}
	for _, p := range evaluate.DefaultPolicies([]float64{0.9}) {
		if !strings.Contains(text, " "+p.Name+" ") {
			t.Errorf("policy %q is not in the table:\n%s", p.Name, text)
		}
		one, two := got[1][p.Name], got[2][p.Name]
		if one == nil {
			t.Errorf("policy %q is not in the JSON", p.Name)
		}
		if strings.HasPrefix(p.Name, "luka") {
			if two != nil {
				t.Errorf("LuKA's step does not batch, yet %q has a row at batch 2", p.Name)
			}
			continue
		}
		if two == nil {
			t.Errorf("policy %q has no row at batch 2", p.Name)
			continue
		}
		if one != nil && one.Skeleton != nil && two.Skeleton != nil && (p.Name == "double-p" || strings.HasPrefix(p.Name, "tactic")) {
			if two.Skeleton.Bytes[0] != 2*one.Skeleton.Bytes[0] {
				t.Errorf("%s: a batch of 2 scores %v bytes of centroids, one sequence %v", p.Name, two.Skeleton.Bytes[0], one.Skeleton.Bytes[0])
			}
		}
	}
	f, err := os.Open(plotPath)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := png.Decode(f); err != nil {
		t.Fatalf("the plot is not a PNG: %v", err)
	}
}

// TestTacticTimesSkeletons runs `vkbench tactic` with a batch and checks
// the skeletons of the step and of the batch, the batch's bytes those of
// its sequences together.
func TestTacticTimesSkeletons(t *testing.T) {
	jsonPath := filepath.Join(t.TempDir(), "tactic.json")
	text := runCaptured(t, tactic, "-n", "512", "-heads", "8", "-kv-heads", "2", "-dim", "64", "-reps", "3", "-kinds", "llama", "-p", "0.9", "-batch", "1,2", "-json", jsonPath)
	if n := strings.Count(text, "step/skeleton"); n != 2 {
		t.Errorf("step/skeleton in %d tables, want 2:\n%s", n, text)
	}
	var rows []stepRow
	readResults(t, jsonPath, &rows)
	if len(rows) != 1 || len(rows[0].Batches) != 1 {
		t.Fatalf("%d rows, want one with one batch", len(rows))
	}
	r := rows[0]
	stages := len(tacticStepStages)
	checkSkeleton(t, "step", r.Skeleton, stages, r.TacticUs)
	b := r.Batches[0]
	checkSkeleton(t, "batch", b.Skeleton, stages, b.TacticUs)
	if r.Skeleton == nil || b.Skeleton == nil {
		return
	}
	// The centroids are the same size in every sequence's index.
	if r.Skeleton.Bytes[0]*2 != b.Skeleton.Bytes[0] {
		t.Errorf("a batch of 2 scores %v bytes of centroids, one sequence %v", b.Skeleton.Bytes[0], r.Skeleton.Bytes[0])
	}
	// The fit reads at least every head's fixed tokens.
	const hq, rowBytes, prefillTail = 8, 2 * 64, 1
	if r.Skeleton.Bytes[1] < hq*rowBytes*prefillTail {
		t.Errorf("the fit reads %v bytes", r.Skeleton.Bytes[1])
	}
}
