package main

import (
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/trace"
	"github.com/vksparse/vksparse/vk"
)

// deltaStage is one stage of a Δ-layer or of a layer reusing its pick,
// timed alone on one layer.
type deltaStage struct {
	Stage    string  `json:"stage"`
	MedianUs float64 `json:"median_us"`
	P10Us    float64 `json:"p10_us"`
	P90Us    float64 `json:"p90_us"`
}

// deltaStages times, on one layer of the trace's tokens, each stage of
// DELTA apart: dense attention, dense attention that writes its logits,
// the page scores, the pick, a layer reusing the pick, and dense attention
// over as many tokens as the reuse attends (its floor).
func deltaStages(dev *vk.Device, heads sparse.Heads, tr *trace.Trace, d sparse.Delta, warmup, reps int) (out []deltaStage, err error) {
	dense, err := sparse.NewDense(dev, heads)
	if err != nil {
		return nil, err
	}
	var owned []interface{ Release() error }
	defer func() {
		for i := len(owned) - 1; i >= 0; i-- {
			err = errors.Join(err, owned[i].Release())
		}
		err = errors.Join(err, dense.Release())
	}()
	layer, err := kvcache.NewLayer(dev, heads.KV, heads.Dim, tr.Tokens)
	if err != nil {
		return nil, err
	}
	owned = append(owned, layer)
	if err := layer.Prefill(tr.K, tr.V, tr.Tokens); err != nil {
		return nil, err
	}
	q := tr.Query(tr.Queries() - 1)
	add := func(name string, times []time.Duration) {
		m, p10, p90 := quantilesUs(times)
		out = append(out, deltaStage{Stage: name, MedianUs: m, P10Us: p10, P90Us: p90})
	}
	plan, err := dense.Plan([]*kvcache.Layer{layer})
	if err != nil {
		return nil, err
	}
	owned = append(owned, plan)
	if _, err := plan.Attend(q); err != nil {
		return nil, err
	}
	times, err := plan.Time(warmup, reps)
	if err != nil {
		return nil, err
	}
	add("dense attention", times)
	withLogits, err := dense.PlanLogits(layer)
	if err != nil {
		return nil, err
	}
	owned = append(owned, withLogits)
	if _, err := withLogits.Attend(q); err != nil {
		return nil, err
	}
	if times, err = withLogits.Time(warmup, reps); err != nil {
		return nil, err
	}
	add("dense attention writing its logits", times)
	scores, err := sparse.NewDeltaPages(withLogits, d.PageSize)
	if err != nil {
		return nil, err
	}
	owned = append(owned, scores)
	if times, err = timeCommands(dev, warmup, reps, scores.Record); err != nil {
		return nil, err
	}
	add("page scores", times)
	pages := (tr.Tokens - 1) / d.PageSize
	pick, err := sparse.NewDeltaSelect(dense, scores.Pages().All(), pages, d.Pages, d.Recent, d.PageSize)
	if err != nil {
		return nil, err
	}
	owned = append(owned, pick)
	if times, err = timeCommands(dev, warmup, reps, pick.Record); err != nil {
		return nil, err
	}
	add("pick", times)
	for _, run := range []int{4, 6, 8, 10, 12, 16} {
		reuse, err := sparse.NewDeltaReuseStepRuns(dense, layer, pick, run)
		if err != nil {
			return nil, err
		}
		owned = append(owned, reuse)
		if _, err := reuse.Attend(q); err != nil {
			return nil, err
		}
		if times, err = reuse.Time(warmup, reps); err != nil {
			return nil, err
		}
		add(fmt.Sprintf("a layer reusing the pick, %d pages a workgroup", run), times)
	}
	// The floor of the reuse: dense attention over as many tokens.
	n := min(d.Pages, pages)*d.PageSize + tr.Tokens - pages*d.PageSize
	small, err := kvcache.NewLayer(dev, heads.KV, heads.Dim, n)
	if err != nil {
		return nil, err
	}
	owned = append(owned, small)
	k, v := make([]uint16, 0, heads.KV*n*heads.Dim), make([]uint16, 0, heads.KV*n*heads.Dim)
	for g := 0; g < heads.KV; g++ {
		k = append(k, tr.K[g*tr.Tokens*heads.Dim:(g*tr.Tokens+n)*heads.Dim]...)
		v = append(v, tr.V[g*tr.Tokens*heads.Dim:(g*tr.Tokens+n)*heads.Dim]...)
	}
	if err := small.Prefill(k, v, n); err != nil {
		return nil, err
	}
	smallPlan, err := dense.Plan([]*kvcache.Layer{small})
	if err != nil {
		return nil, err
	}
	owned = append(owned, smallPlan)
	if _, err := smallPlan.Attend(q); err != nil {
		return nil, err
	}
	if times, err = smallPlan.Time(warmup, reps); err != nil {
		return nil, err
	}
	add(fmt.Sprintf("dense attention over %d tokens", n), times)
	return out, nil
}

// timeCommands records record warmup+reps times in one submission, a
// compute barrier before each and a timestamp after, and returns the timed
// runs' GPU times, sorted.
func timeCommands(dev *vk.Device, warmup, reps int, record func(*vk.Commands) error) ([]time.Duration, error) {
	c, err := dev.NewCommands()
	if err != nil {
		return nil, err
	}
	defer c.Release()
	return dev.TimeRuns(c, warmup, reps, func(c *vk.Commands) error {
		c.ComputeBarrier()
		return record(c)
	})
}

// printDeltaStages prints the stages' medians.
func printDeltaStages(stages []deltaStage) {
	rows := [][]string{}
	for _, s := range stages {
		rows = append(rows, []string{s.Stage, fmt.Sprintf("%.1f", s.MedianUs), fmt.Sprintf("%.1f", s.P10Us), fmt.Sprintf("%.1f", s.P90Us)})
	}
	fmt.Println("DELTA's stages alone, on one layer:")
	table(os.Stdout, []string{"stage", "median µs", "p10 µs", "p90 µs"}, rows)
}
