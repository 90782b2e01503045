package main

import (
	"flag"
	"fmt"
	"os"
	"sort"
	"strings"

	"github.com/vksparse/vksparse/evaluate"
	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/trace"
	"github.com/vksparse/vksparse/workload"
)

// compareRow is one row of `vkbench compare`'s GPU table.
type compareRow struct {
	Source string `json:"source"`
	evaluate.StepRun
}

func compare(args []string) error {
	fs := flag.NewFlagSet("compare", flag.ExitOnError)
	ns := fs.String("n", "32768", "context lengths of the generated workload (comma-separated)")
	ps := fs.String("p", "0.9", "Tactic's target masses (comma-separated)")
	tracePath := fs.String("trace", "", "a trace file to run instead of the generated workload")
	qHeads := fs.Int("heads", 32, "query heads (generated workload)")
	kvHeads := fs.Int("kv-heads", 8, "KV heads (generated workload)")
	dim := fs.Int("dim", 128, "head dimension (generated workload)")
	kindsName := fs.String("kinds", "llama", kindsUsage)
	sinks := fs.Int("sinks", 4, "tokens at the start attended by every policy")
	recent := fs.Int("recent", 64, "most recent tokens attended by every policy")
	reps := fs.Int("reps", 100, "timed runs per policy")
	seed := fs.Int64("seed", 1, "workload and K-means seed")
	jsonPath := fs.String("json", "", "write results as JSON to this file")
	chunk := fs.Int("cluster-chunk", 0, "clusters per workgroup of attention over clusters (0: chosen from the sizes)")
	variants := fs.String("double-p", "", "Double-P at other targets beside the default, as p1/p2 pairs (comma-separated)")
	fs.Parse(args)
	pList, err := floats(*ps)
	if err != nil {
		return fmt.Errorf("-p: %v", err)
	}
	var traces []*trace.Trace
	var names []string
	if *tracePath != "" {
		t, err := trace.Read(*tracePath)
		if err != nil {
			return err
		}
		traces, names = append(traces, t), append(names, *tracePath)
	} else {
		nList, err := ints(*ns)
		if err != nil {
			return fmt.Errorf("-n: %v", err)
		}
		for _, n := range nList {
			cfg, err := workload.NamedConfig(*kindsName, n, *qHeads, *kvHeads, *dim)
			if err != nil {
				return fmt.Errorf("-kinds: %v", err)
			}
			cfg.Seed = *seed
			t, err := workload.Generate(cfg)
			if err != nil {
				return err
			}
			traces, names = append(traces, t), append(names, fmt.Sprintf("workload n=%d %s", n, *kindsName))
		}
	}
	dev, err := openDevice()
	if err != nil {
		return err
	}
	defer dev.Release()
	policies := evaluate.DefaultPolicies(pList)
	if *variants != "" {
		var targets []sparse.DoubleP
		for _, v := range strings.Split(*variants, ",") {
			var o sparse.DoubleP
			if _, err := fmt.Sscanf(v, "%g/%g", &o.P1, &o.P2); err != nil {
				return fmt.Errorf("-double-p: %q is not p1/p2", v)
			}
			targets = append(targets, o)
		}
		policies = append(policies, evaluate.DoublePVariants(targets)...)
	}
	prog := &progress{total: len(traces) * len(policies)}
	var rows []compareRow
	for i, t := range traces {
		runs, err := evaluate.Steps(dev, t, sparse.DenseOptions{ClusterChunk: *chunk}, policies, *sinks, *recent, *reps, uint64(*seed), func(name string) { prog.step(fmt.Sprintf("%s: %s", names[i], name)) })
		if err != nil {
			prog.finish()
			return err
		}
		for _, r := range runs {
			rows = append(rows, compareRow{Source: names[i], StepRun: r})
		}
	}
	prog.finish()
	var cells [][]string
	for _, r := range rows {
		var stages []string
		for s := range r.StageUs {
			stages = append(stages, s)
		}
		sort.Strings(stages)
		st := ""
		for _, s := range stages {
			st += fmt.Sprintf("%s %.1f ", s, r.StageUs[s])
		}
		cells = append(cells, []string{r.Source, r.Policy, fmt.Sprintf("%.1f", r.DenseUs), fmt.Sprintf("%.0f", r.DenseGBps), fmt.Sprintf("%.1f", r.StepUs), fmt.Sprintf("%.2f×", r.Speedup),
			fmt.Sprint(r.Dispatches), fmt.Sprintf("%.1f", r.ExactPct), fmt.Sprintf("%.1e", r.RelErr), st})
	}
	table(os.Stdout, []string{"source", "policy", "dense µs", "dense GB/s", "step µs", "speed-up", "dispatches", "exact %", "rel err", "stages µs"}, cells)
	if *jsonPath != "" {
		return writeJSON(*jsonPath, "compare "+fmt.Sprint(args), dev.Info(), rows)
	}
	return nil
}
