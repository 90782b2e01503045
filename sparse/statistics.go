package sparse

import (
	"fmt"

	"github.com/vksparse/vksparse/vk"
)

// KernelStatistics is what a driver's compiler reports for one kernel of
// a decode step (registers, shared and local memory and the like: the
// names and values are the driver's).
type KernelStatistics struct {
	Kernel     string         `json:"kernel"`
	Statistics []vk.Statistic `json:"statistics"`
}

// StepKernelStatistics compiles the kernels of the decode steps for
// dense's heads, as the steps build them (dense attention, attention over
// token lists, over clusters and over clusters with pseudo-tokens; the
// centroid scores of Tactic and of Double-P, Tactic's selection,
// Double-P's cuts and Quest's selection; attention with pseudo-tokens
// stays built in dense, as a Double-P plan leaves it), and returns their
// compiler statistics. The
// device must be opened with vk.Options.Statistics on a driver that
// reports them (vk.Info.ExecutableStatistics); elsewhere it returns
// vk.ErrUnsupported.
func StepKernelStatistics(dense *Dense) ([]KernelStatistics, error) {
	var approx *vk.Pipeline
	if dense.clustered != nil { // built only where attention over clusters is
		spec := dense.clusterSpec
		spec.Approx = 1
		var err error
		if approx, err = dense.variant(spec); err != nil {
			return nil, err
		}
	}
	tactic, err := newTacticKernels(dense)
	if err != nil {
		return nil, err
	}
	defer tactic.release()
	curve, err := tactic.selectionKernel(dense, false)
	if err != nil {
		return nil, err
	}
	moments, err := tactic.selectionKernel(dense, true)
	if err != nil {
		return nil, err
	}
	b := &builder{dev: dense.dev}
	doublePScore := centroidScores(b, dense, true).pipe
	cut := doublePCut(b)
	quest, _, _ := selectBinsKernel(b, dense.heads, scoreBounds, false)
	defer releaseAll(doublePScore, cut, quest)
	if b.err != nil {
		return nil, b.err
	}
	kernels := []struct {
		name string
		pipe *vk.Pipeline
	}{
		{"attend_partial (dense)", dense.partial},
		{"attend_partial (token lists)", dense.gather},
		{"attend_partial (clusters)", dense.clustered},
		{"attend_partial (clusters, pseudo-tokens)", approx},
		{"centroid_score (Tactic)", tactic.score.pipe},
		{"tactic_select (moment estimate)", moments},
		{"tactic_select (fitted curve)", curve},
		{"centroid_score (Double-P)", doublePScore},
		{"doublep_cut", cut},
		{"select_bins (Quest)", quest},
	}
	var out []KernelStatistics
	for _, k := range kernels {
		if k.pipe == nil {
			continue // not built on this device (shared memory)
		}
		st, err := k.pipe.Statistics()
		if err != nil {
			return nil, fmt.Errorf("sparse: %s: %w", k.name, err)
		}
		out = append(out, KernelStatistics{Kernel: k.name, Statistics: st})
	}
	return out, nil
}
