package main

import (
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/vksparse/vksparse/sparse"
)

// checkOutputDir refuses an output path whose folder does not exist, so
// that a long run does not end unable to write its results.
func checkOutputDir(path string) error {
	if path == "" {
		return nil
	}
	dir := filepath.Dir(path)
	fi, err := os.Stat(dir)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return fmt.Errorf("folder %s does not exist", dir)
	case err != nil:
		return err
	case !fi.IsDir():
		return fmt.Errorf("%s is not a folder", dir)
	}
	return nil
}

// output is a flag naming a file that a command writes at its end.
type output struct{ flag, path string }

// checkOutputs runs checkOutputDir on each output, naming its flag.
func checkOutputs(outs ...output) error {
	for _, o := range outs {
		if err := checkOutputDir(o.path); err != nil {
			return fmt.Errorf("-%s %s: %w", o.flag, o.path, err)
		}
	}
	return nil
}

// flagGiven reports whether the flag name was set on the command line.
func flagGiven(set *flag.FlagSet, name string) bool {
	given := false
	set.Visit(func(f *flag.Flag) { given = given || f.Name == name })
	return given
}

// checkSelect refuses an attn -select share outside (0, 1] and batches
// other than 1.
func checkSelect(share float64, batches []int) error {
	if !(share > 0 && share <= 1) {
		return fmt.Errorf("-select %v: want a share of the tokens in (0, 1]; leave -select out for dense attention", share)
	}
	for _, b := range batches {
		if b != 1 {
			return fmt.Errorf("-select needs -batch 1, not %d", b)
		}
	}
	return nil
}

// checkClusterSize refuses a -cluster-size below 1 (the library reads 0
// as its default; the flag's default is already explicit).
func checkClusterSize(n int) error {
	if n < 1 {
		return fmt.Errorf("-cluster-size %d: tokens per cluster must be at least 1", n)
	}
	return nil
}

// fitFlags are the flags of tactic and fidelity that set Tactic's
// distribution fit (sparse.TacticFit).
type fitFlags struct {
	kind                                *string
	initial                             *float64
	maxInitial, maxWindow, windowStride *int
}

// addFitFlags registers -fit, -initial, -max-initial, -max-window and
// -window-stride on fs, with sparse.DefaultTacticFit's values.
func addFitFlags(fs *flag.FlagSet) fitFlags {
	def := sparse.DefaultTacticFit()
	return fitFlags{
		kind:         fs.String("fit", "moments", "Tactic's estimate of each head's whole attention mass: moments (each cluster's mass from its centroid score and the spread of its keys; no key rows sampled) or curve (the paper's a/x + b fitted to an exact part and two sampled windows, set by the flags below)"),
		initial:      fs.Float64("initial", def.InitialFrac, "-fit curve: share of the clustered tokens whose scores the fit computes exactly (the paper's initial tokens: 1-2 %)"),
		maxInitial:   fs.Int("max-initial", def.MaxInitial, "-fit curve: the most tokens the fit computes exactly (0: no limit)"),
		maxWindow:    fs.Int("max-window", def.MaxWindow, "-fit curve: the most tokens of each sampling window (0: no limit)"),
		windowStride: fs.Int("window-stride", def.WindowStride, "-fit curve: sampling windows score only the clusters whose index is a multiple of this (0 or 1: every cluster)"),
	}
}

// fit returns the fit the flags set, or an error naming the first flag
// that sparse.TacticFit would refuse.
func (f fitFlags) fit() (sparse.TacticFit, error) {
	fit := sparse.DefaultTacticFit()
	switch *f.kind {
	case "moments":
	case "curve":
		fit.Moments = false
	default:
		return fit, fmt.Errorf("-fit %q: want moments or curve", *f.kind)
	}
	if err := checkFit(*f.initial, *f.maxInitial, *f.maxWindow, *f.windowStride); err != nil {
		return fit, err
	}
	fit.InitialFrac, fit.MaxInitial, fit.MaxWindow, fit.WindowStride = *f.initial, *f.maxInitial, *f.maxWindow, *f.windowStride
	return fit, nil
}

// checkFit refuses the fit flags of tactic and fidelity that
// sparse.TacticFit would refuse.
func checkFit(initial float64, maxInitial, maxWindow, windowStride int) error {
	switch {
	case !(initial >= 0 && initial <= 1):
		return fmt.Errorf("-initial %v: want a share in [0, 1]", initial)
	case maxInitial < 0:
		return fmt.Errorf("-max-initial %d: must not be negative", maxInitial)
	case maxWindow < 0:
		return fmt.Errorf("-max-window %d: must not be negative", maxWindow)
	case windowStride < 0 || windowStride > sparse.MaxWindowStride:
		return fmt.Errorf("-window-stride %d: want 0 to %d", windowStride, sparse.MaxWindowStride)
	}
	return nil
}
