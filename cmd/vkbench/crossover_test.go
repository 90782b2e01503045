package main

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/vksparse/vksparse/vk"
)

func TestFirstTrue(t *testing.T) {
	for _, c := range []struct{ lo, hi, from, want int }{
		{10, 100, 37, 37}, {10, 100, 10, 10}, {10, 100, 3, 10}, {10, 100, 100, 100}, {10, 100, 101, -1},
	} {
		calls := 0
		got, err := firstTrue(c.lo, c.hi, func(n int) (bool, error) { calls++; return n >= c.from, nil })
		if err != nil || got != c.want {
			t.Errorf("firstTrue(%d, %d) with the switch at %d = %d, %v; want %d", c.lo, c.hi, c.from, got, err, c.want)
		}
		if calls > 10 {
			t.Errorf("%d calls for a range of %d: not a bisection", calls, c.hi-c.lo)
		}
	}
}

// TestCrossoverRun runs `vkbench crossover` at a small size under two
// given cost models, and checks its JSON: a row per policy, the layer
// never dearer than dense attention, a dearer floor moving every
// crossover of a policy with more dispatches than dense attention later,
// and a batch of 2, whose sequences share that floor, moving it no later.
func TestCrossoverRun(t *testing.T) {
	dir := t.TempDir()
	run := func(floor, batch string) crossoverReport {
		t.Helper()
		path := filepath.Join(dir, "crossover-"+floor+"-"+batch+".json")
		stdout := os.Stdout
		os.Stdout, _ = os.Open(os.DevNull)
		err := crossover([]string{"-n", "512", "-max", "1048576", "-budget", "64", "-floor-us", floor, "-gbps", "100", "-batch", batch, "-reps", "2", "-json", path})
		os.Stdout = stdout
		if err != nil {
			if os.Getenv("VKSPARSE_REQUIRE_DEVICE") == "" && (errors.Is(err, vk.ErrNoLoader) || errors.Is(err, vk.ErrNoDevice)) {
				t.Skipf("no Vulkan device to run crossover on (%v)", err)
			}
			t.Fatal(err)
		}
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		var rep struct{ Results crossoverReport }
		if err := json.Unmarshal(b, &rep); err != nil {
			t.Fatal(err)
		}
		return rep.Results
	}
	cheap, dear, shared := run("1", "1"), run("20", "1"), run("20", "2")
	if len(cheap.Rows) != 5 || len(dear.Rows) != 5 || len(shared.Rows) != 5 {
		t.Fatalf("%d, %d and %d rows, want one per policy (5)", len(cheap.Rows), len(dear.Rows), len(shared.Rows))
	}
	for i, r := range shared.Rows {
		d := dear.Rows[i]
		if r.Batch != 2 || d.Batch != 1 {
			t.Errorf("%s: batches %d and %d, want 2 and 1", r.Policy, r.Batch, d.Batch)
		}
		if d.PolicyCost.Dispatches > 1 && d.Crossover >= 0 && (r.Crossover < 0 || r.Crossover > d.Crossover) {
			t.Errorf("%s: crossover %d alone, %d in a batch of 2 under the same floor: want it no later", r.Policy, d.Crossover, r.Crossover)
		}
		if (r.Chosen == "dense") != (r.PolicyUs > r.DenseUs) {
			t.Errorf("%s, batch 2: chose %s at %.2f µs against dense %.2f µs", r.Policy, r.Chosen, r.PolicyUs, r.DenseUs)
		}
	}
	for i, r := range dear.Rows {
		c := cheap.Rows[i]
		if r.LayerOverDense > 1 || r.LayerOverDense <= 0 {
			t.Errorf("%s: the layer costs %.3f× dense attention", r.Policy, r.LayerOverDense)
		}
		if r.PolicyCost.Dispatches > 1 && r.Crossover >= 0 && c.Crossover >= r.Crossover {
			t.Errorf("%s: crossover %d under a floor of 1 µs, %d under 20 µs: want it later under the dearer floor", r.Policy, c.Crossover, r.Crossover)
		}
		if (r.Chosen == "dense") != (r.PolicyUs > r.DenseUs) {
			t.Errorf("%s: chose %s at %.2f µs against dense %.2f µs", r.Policy, r.Chosen, r.PolicyUs, r.DenseUs)
		}
	}
}
