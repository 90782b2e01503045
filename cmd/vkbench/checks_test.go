package main

import (
	"flag"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/sparse"
)

func TestCheckOutputs(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "file")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	missing := filepath.Join(dir, "missing", "out.json")
	if err := checkOutputs(output{"json", ""}, output{"plot", filepath.Join(dir, "out.png")}, output{"json", "out.json"}); err != nil {
		t.Errorf("checkOutputs refused writable paths: %v", err)
	}
	err := checkOutputs(output{"json", filepath.Join(dir, "ok.json")}, output{"plot", missing})
	if err == nil || !strings.HasPrefix(err.Error(), "-plot "+missing+": ") || !strings.Contains(err.Error(), "does not exist") {
		t.Errorf("checkOutputs(-plot %s) = %v; want an error naming -plot and the missing folder", missing, err)
	}
	if err := checkOutputs(output{"json", filepath.Join(file, "out.json")}); err == nil || !strings.Contains(err.Error(), "not a folder") {
		t.Errorf("checkOutputs under a file = %v; want not a folder", err)
	}
}

// noDevice makes any device a command opens by mistake fail to open.
func noDevice(t *testing.T) {
	t.Setenv("VKSPARSE_DEVICE", "no device is named this")
}

// TestCommandsCheckOutputsFirst runs every command with a -json or -plot
// file in a missing folder: each must refuse it before any work.
func TestCommandsCheckOutputsFirst(t *testing.T) {
	noDevice(t)
	dir := t.TempDir()
	missing := filepath.Join(dir, "missing", "out")
	weights := filepath.Join(dir, "none.safetensors")
	for _, c := range []struct {
		name string
		run  func([]string) error
		args []string
		flag string
	}{
		{"devices", devices, nil, "json"},
		{"attn", attn, []string{"-n", "64", "-reps", "1", "-warmup", "0"}, "json"},
		{"probe", probe, []string{"-mib", "1", "-reps", "1"}, "json"},
		{"probe -chain", probe, []string{"-chain", "1", "-reps", "1"}, "json"},
		{"cluster", cluster, []string{"-n", "256", "-reps", "1"}, "json"},
		{"tactic", tactic, []string{"-n", "256", "-reps", "1"}, "json"},
		{"tactic", tactic, []string{"-n", "256", "-reps", "1"}, "plot"},
		{"fidelity", fidelity, []string{"-n", "256", "-queries", "1"}, "json"},
		{"fidelity", fidelity, []string{"-n", "256", "-queries", "1"}, "plot"},
		{"compare", compare, []string{"-n", "256", "-reps", "1"}, "json"},
		{"compare", compare, []string{"-n", "256", "-reps", "1"}, "plot"},
		{"kernels", kernels, nil, "json"},
		{"generate", generate, []string{"-weights", weights}, "json"},
		{"generate", generate, []string{"-weights", weights}, "plot"},
		{"generate -calibrate", generate, []string{"-weights", weights, "-calibrate", "64"}, "json"},
		{"stack", stack, []string{"-tokens", "1024", "-reps", "1"}, "json"},
	} {
		err := c.run(append(c.args, "-"+c.flag, missing))
		if err == nil || !strings.HasPrefix(err.Error(), "-"+c.flag+" "+missing+": ") {
			t.Errorf("%s -%s %s: %v; want the -%s error first", c.name, c.flag, missing, err, c.flag)
		}
	}
}

func TestCheckSelect(t *testing.T) {
	for _, share := range []float64{0.05, 0.5, 1} {
		if err := checkSelect(share, []int{1}); err != nil {
			t.Errorf("checkSelect(%v) = %v", share, err)
		}
	}
	for _, share := range []float64{math.NaN(), math.Inf(1), math.Inf(-1), 0, -0.1, 1.01} {
		err := checkSelect(share, []int{1})
		if err == nil || !strings.HasPrefix(err.Error(), "-select ") {
			t.Errorf("checkSelect(%v) = %v; want a -select error", share, err)
		}
	}
	if err := checkSelect(0.1, []int{1, 8}); err == nil || !strings.Contains(err.Error(), "-batch 1") {
		t.Errorf("checkSelect with batch 8 = %v; want a -batch error", err)
	}
}

// TestAttnRefusesBadSelect runs attn with shares it must refuse before
// opening a device.
func TestAttnRefusesBadSelect(t *testing.T) {
	noDevice(t)
	for _, v := range []string{"nan", "NaN", "inf", "-inf", "0", "-0.5", "1.5"} {
		err := attn([]string{"-n", "64", "-select", v})
		if err == nil || !strings.HasPrefix(err.Error(), "-select ") {
			t.Errorf("attn -select %s: %v; want a -select error", v, err)
		}
	}
	if err := attn([]string{"-n", "64", "-select", "0.1", "-batch", "1,2"}); err == nil || !strings.Contains(err.Error(), "-batch 1") {
		t.Errorf("attn -select 0.1 -batch 1,2: %v; want a -batch error", err)
	}
	if gatherShare != 0 {
		t.Errorf("a refused -select left gatherShare %v", gatherShare)
	}
}

func TestCheckClusterSize(t *testing.T) {
	if err := checkClusterSize(1); err != nil {
		t.Errorf("checkClusterSize(1) = %v", err)
	}
	for _, n := range []int{0, -3} {
		err := checkClusterSize(n)
		want := "-cluster-size " + map[int]string{0: "0", -3: "-3"}[n] + ": tokens per cluster must be at least 1"
		if err == nil || err.Error() != want {
			t.Errorf("checkClusterSize(%d) = %v; want %q", n, err, want)
		}
	}
}

// TestCommandsRefuseClusterSize runs every command with -cluster-size
// below 1: each must refuse it in one line, before any work.
func TestCommandsRefuseClusterSize(t *testing.T) {
	noDevice(t)
	for _, c := range []struct {
		name string
		run  func([]string) error
		args []string
	}{
		{"cluster", cluster, []string{"-n", "256", "-reps", "1"}},
		{"tactic", tactic, []string{"-n", "256", "-reps", "1"}},
		{"fidelity", fidelity, []string{"-n", "256", "-queries", "1"}},
		{"compare", compare, []string{"-n", "256", "-reps", "1"}},
	} {
		for _, v := range []string{"0", "-3"} {
			err := c.run(append(c.args, "-cluster-size", v))
			want := "-cluster-size " + v + ": tokens per cluster must be at least 1"
			if err == nil || err.Error() != want {
				t.Errorf("%s -cluster-size %s: %v; want %q", c.name, v, err, want)
			}
		}
	}
}

func TestCheckFit(t *testing.T) {
	if err := checkFit(0.02, 0, 0, 64); err != nil {
		t.Errorf("checkFit(0.02, 0, 0, 64) = %v", err)
	}
	for _, c := range []struct {
		initial                       float64
		maxInitial, maxWindow, stride int
		flag                          string
	}{
		{math.NaN(), 0, 0, 0, "-initial"},
		{1.5, 0, 0, 0, "-initial"},
		{-0.1, 0, 0, 0, "-initial"},
		{0.02, -1, 0, 0, "-max-initial"},
		{0.02, 0, -1, 0, "-max-window"},
		{0.02, 0, 0, -1, "-window-stride"},
		{0.02, 0, 0, 65, "-window-stride"},
	} {
		err := checkFit(c.initial, c.maxInitial, c.maxWindow, c.stride)
		if err == nil || !strings.HasPrefix(err.Error(), c.flag+" ") || strings.Contains(err.Error(), "{") {
			t.Errorf("checkFit(%v, %d, %d, %d) = %v; want a one-line %s error", c.initial, c.maxInitial, c.maxWindow, c.stride, err, c.flag)
		}
	}
}

// TestFitFlags checks that -fit picks the moment estimate by default and
// the fitted curve on request, with the curve's flags applied, and refuses
// any other name.
func TestFitFlags(t *testing.T) {
	parse := func(args ...string) (sparse.TacticFit, error) {
		fs := flag.NewFlagSet("test", flag.ContinueOnError)
		f := addFitFlags(fs)
		require.NoError(t, fs.Parse(args))
		return f.fit()
	}
	fit, err := parse()
	require.NoError(t, err)
	require.Equal(t, sparse.DefaultTacticFit(), fit)
	require.True(t, fit.Moments)
	fit, err = parse("-fit", "curve", "-initial", "0.05", "-window-stride", "2")
	require.NoError(t, err)
	require.False(t, fit.Moments)
	require.Equal(t, 0.05, fit.InitialFrac)
	require.Equal(t, 2, fit.WindowStride)
	for _, bad := range [][]string{{"-fit", "moment"}, {"-fit", ""}, {"-fit", "curve", "-initial", "2"}} {
		_, err = parse(bad...)
		require.Error(t, err, bad)
		require.True(t, strings.HasPrefix(err.Error(), "-fit ") || strings.HasPrefix(err.Error(), "-initial "), err.Error())
	}
}

// TestCommandsRefuseFitFlags checks that tactic and fidelity refuse bad
// fit flags, and tactic a negative -span, without dumping option structs.
func TestCommandsRefuseFitFlags(t *testing.T) {
	noDevice(t)
	for _, c := range []struct {
		name string
		run  func([]string) error
	}{{"tactic", tactic}, {"fidelity", fidelity}} {
		for _, bad := range [][]string{{"-initial", "2"}, {"-max-window", "-1"}, {"-window-stride", "100"}} {
			err := c.run(append([]string{"-n", "256"}, bad...))
			if err == nil || !strings.HasPrefix(err.Error(), bad[0]+" ") || strings.Contains(err.Error(), "{") {
				t.Errorf("%s %s %s: %v; want a one-line %s error", c.name, bad[0], bad[1], err, bad[0])
			}
		}
	}
	if err := tactic([]string{"-n", "256", "-span", "-1"}); err == nil || !strings.HasPrefix(err.Error(), "-span ") {
		t.Errorf("tactic -span -1: %v; want a -span error", err)
	}
}

// TestFidelityPerHeadFlag checks fidelity's -per-head switch; before its
// rename from -heads the flag package exits on it.
func TestFidelityPerHeadFlag(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "missing", "out.json")
	err := fidelity([]string{"-per-head", "-n", "256", "-queries", "1", "-json", missing})
	if err == nil || !strings.HasPrefix(err.Error(), "-json ") {
		t.Errorf("fidelity -per-head: %v; want the -json error", err)
	}
}
