package main

import (
	"flag"
	"fmt"
	"os"
	"slices"
	"strings"

	"github.com/vksparse/vksparse/evaluate"
	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/workload"
)

// tacticStepStages names the stages of a Tactic step, as the timings
// report them: the selection's, then attention.
var tacticStepStages = slices.Concat(sparse.TacticStages, []string{"attend"})

// stepRow is one row of `vkbench tactic`.
type stepRow struct {
	Source string `json:"source"`
	evaluate.TacticRun
}

// kindsUsage describes the -kinds flag of tactic and fidelity.
const kindsUsage = "the generated workload: mixed (every KV group holds every head kind), grouped (one kind per KV group), late (a sparse late layer: streaming heads, a topic head in every other group), llama or megabeam (layers calibrated to the sparsity Tactic finds in Llama-3.1-8B-Instruct and MegaBeam-Mistral-7B; see package workload)"

func tactic(args []string) error {
	fs := flag.NewFlagSet("tactic", flag.ExitOnError)
	ns := fs.String("n", "32768", "context lengths of the generated workload (comma-separated)")
	ps := fs.String("p", "0.5,0.7,0.9", "target attention masses (comma-separated)")
	tracePath := fs.String("trace", "", "a trace file to run instead of the generated workload")
	qHeads := fs.Int("heads", 32, "query heads (generated workload)")
	kvHeads := fs.Int("kv-heads", 8, "KV heads (generated workload)")
	dim := fs.Int("dim", 128, "head dimension (generated workload)")
	kindsName := fs.String("kinds", "mixed", kindsUsage)
	fitArgs := addFitFlags(fs)
	reps := fs.Int("reps", 50, "timed runs per row")
	batchList := fs.String("batch", "1", "batch sizes B (comma-separated): for each B > 1 a batched step over B sequences, each its own cache and index, is timed beside dense attention over B")
	seed := fs.Int64("seed", 1, "workload and K-means seed")
	clusterSize := fs.Int("cluster-size", sparse.KMeansDefaultAvgClusterSize, "tokens per K-means cluster on average")
	span := fs.Int("span", sparse.KMeansDefaultSpan, "K-means within spans of this many tokens (0: the whole prefill)")
	jsonPath := fs.String("json", "", "write results as JSON to this file")
	plotPath := fs.String("plot", "", "draw speed-up and tokens selected against N into this PNG file")
	skeletons := fs.Bool("skeleton", true, "time each step's skeleton in the same run: as many dependent dispatches streaming the bytes its stages read (counted from the step), printed as step / skeleton")
	fs.Parse(args)
	if err := checkOutputs(output{"json", *jsonPath}, output{"plot", *plotPath}); err != nil {
		return err
	}
	if err := checkClusterSize(*clusterSize); err != nil {
		return err
	}
	if *span < 0 {
		return fmt.Errorf("-span %d: must not be negative", *span)
	}
	fit, err := fitArgs.fit()
	if err != nil {
		return err
	}
	pList, err := floats(*ps)
	if err != nil {
		return fmt.Errorf("-p: %v", err)
	}
	for _, p := range pList {
		if !(p > 0 && p <= 1) {
			return fmt.Errorf("-p: %v is not in (0, 1]", p)
		}
	}
	batches, err := ints(*batchList)
	if err != nil {
		return fmt.Errorf("-batch: %v", err)
	}
	if _, err := workload.NamedConfig(*kindsName, 1, *qHeads, *kvHeads, *dim); err != nil {
		return fmt.Errorf("-kinds: %v", err)
	}
	traces, names, err := layers(*tracePath, *ns, *kindsName, *qHeads, *kvHeads, *dim, *seed)
	if err != nil {
		return err
	}
	dev, err := openDevice()
	if err != nil {
		return err
	}
	defer dev.Release()
	prog := &progress{total: len(traces) * len(pList)}
	var results []stepRow
	for i, t := range traces {
		runs, err := evaluate.TacticTrace(dev, t, pList, fit, sparse.KMeansOptions{AvgClusterSize: *clusterSize, Span: *span, Seed: uint64(*seed)}, *reps, batches, func(p float64) { prog.step(fmt.Sprintf("tactic %s P=%v", names[i], p)) })
		if err != nil {
			prog.finish()
			return err
		}
		for _, r := range runs {
			results = append(results, stepRow{Source: names[i], TacticRun: r})
		}
	}
	prog.finish()
	if err := timeTacticSkeletons(dev, results, *skeletons, *reps); err != nil {
		return err
	}
	var rows [][]string
	for _, r := range results {
		st := ""
		for _, s := range tacticStepStages {
			st += fmt.Sprintf("%s %.0f ", s, r.StageUs[s])
		}
		skUs, skMB, over := skeletonCells(r.Skeleton)
		rows = append(rows, []string{r.Source, fmt.Sprint(r.P), fmt.Sprintf("%.1f", r.DenseUs), fmt.Sprintf("%.1f", r.TacticUs), fmt.Sprintf("%.2f×", r.Speedup), skUs, over,
			fmt.Sprintf("%.1f", r.SelectedPct), fmt.Sprintf("%.1f", r.UnionPct), fmt.Sprintf("%.3f", r.Mass), fmt.Sprintf("%.0f%%", 100*r.Success),
			fmt.Sprintf("%.2f", r.RatioToOpt), fmt.Sprintf("%.1e", r.RelErr), st, skMB, fmt.Sprintf("%.0f", r.UnionGBps)})
	}
	table(os.Stdout, []string{"source", "P", "dense µs", "tactic µs", "speed-up", "skeleton µs", "step/skeleton", "selected %", "union %", "mass", "success", "sel/cluster-opt", "rel err", "stages µs", "stages MB", "attend GB/s"}, rows)
	var batchRows [][]string
	for _, r := range results {
		for _, b := range r.Batches {
			st := ""
			for _, s := range tacticStepStages {
				st += fmt.Sprintf("%s %.0f ", s, b.StageUs[s])
			}
			skUs, skMB, over := skeletonCells(b.Skeleton)
			batchRows = append(batchRows, []string{r.Source, fmt.Sprint(r.P), fmt.Sprint(b.Batch), fmt.Sprintf("%.1f", b.DenseUs), fmt.Sprintf("%.0f", b.DenseGBps),
				fmt.Sprintf("%.1f", b.TacticUs), fmt.Sprintf("%.2f×", b.Speedup), skUs, over, fmt.Sprintf("%.1f", b.UnionPct), st, skMB, fmt.Sprintf("%.0f", b.UnionGBps)})
		}
	}
	if len(batchRows) > 0 {
		fmt.Println()
		table(os.Stdout, []string{"source", "P", "batch", "dense µs", "dense GB/s", "tactic µs", "speed-up", "skeleton µs", "step/skeleton", "union %", "stages µs", "stages MB", "attend GB/s"}, batchRows)
	}
	for i, r := range results {
		if i == 0 || r.Source != results[i-1].Source {
			fmt.Printf("clustering %s (%d tokens): %.1f ms the first time, with storing in cluster order; again %.1f ms (GPU %.1f ms), storing %.1f ms\n", r.Source, r.Prefill, r.ClusterMs, r.ClusterWarmMs, r.ClusterGPUMs, r.ReorderMs)
			fmt.Printf("  clustering again, per kind of step (ms): %s\n", stageCells(r.ClusterStagesMs))
		}
	}
	if *plotPath != "" {
		if err := plotSteps(*plotPath, results); err != nil {
			return err
		}
	}
	if *jsonPath != "" {
		return writeJSON(*jsonPath, "tactic "+fmt.Sprint(args), dev.Info(), results)
	}
	return nil
}

// timeTacticSkeletons times the skeleton of every step and batch of the
// results over reps runs where on is set, and drops the skeletons where it
// is not.
func timeTacticSkeletons(dev *vk.Device, results []stepRow, on bool, reps int) error {
	if !on {
		for i := range results {
			results[i].Skeleton = nil
			for j := range results[i].Batches {
				results[i].Batches[j].Skeleton = nil
			}
		}
		return nil
	}
	t, err := newSkeletonTimer(dev, reps)
	if err != nil {
		return err
	}
	defer t.release()
	for i := range results {
		r := &results[i]
		if err := t.time(fmt.Sprintf("%s P=%v", r.Source, r.P), r.Skeleton, r.TacticUs); err != nil {
			return err
		}
		for j := range r.Batches {
			b := &r.Batches[j]
			if err := t.time(fmt.Sprintf("%s P=%v batch %d", r.Source, r.P, b.Batch), b.Skeleton, b.TacticUs); err != nil {
				return err
			}
		}
	}
	return nil
}

// stageCells prints stage times, in the order of sparse.KMeansStages.
func stageCells(ms map[string]float64) string {
	var out []string
	for _, name := range clusterStages[:len(clusterStages)-1] {
		out = append(out, fmt.Sprintf("%s %.2f", name, ms[name]))
	}
	return strings.Join(out, ", ")
}
