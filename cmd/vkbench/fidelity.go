package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/vksparse/vksparse/evaluate"
	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/trace"
	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/workload"
)

// tacticResult is one row of `vkbench tactic`: the fidelity of Tactic's
// selection on one layer (generated or read from a trace) at one target
// mass, as evaluate.Tactic measures it, per query head included.
type tacticResult struct {
	// Source is "generator" (mixed kinds), "generator " and the -kinds
	// name, or the trace file's base name.
	Source  string `json:"source"`
	Seed    int64  `json:"seed,omitempty"` // generator seed
	Tokens  int    `json:"tokens"`
	QHeads  int    `json:"q_heads"`
	KVHeads int    `json:"kv_heads"`
	HeadDim int    `json:"head_dim"`
	Prefill int    `json:"prefill"`
	// Queries lists the evaluated query indices.
	Queries []int `json:"queries"`
	Sinks   int   `json:"sinks"`
	// Span is the K-means span of the prefill's clustering (tokens; 0:
	// the whole prefill).
	Span int              `json:"kmeans_span"`
	Fit  sparse.TacticFit `json:"fit"`
	evaluate.TacticResult
	// Bounds is the most a step can gain over dense attention, from
	// Traffic, for each batch size asked for.
	Bounds []stepBound `json:"bounds,omitempty"`
	// Timing is the GPU time of one decode step by stage; this CPU-only
	// mode leaves it out.
	Timing *tacticTiming `json:"timing,omitempty"`
}

// stepBound is the least time of a step over a batch (StepTraffic.BoundUs)
// and the most it can gain over dense attention of the same batch
// (StepTraffic.BoundSpeedup), at the bandwidth and dispatch floor given.
type stepBound struct {
	Batch      int     `json:"batch"`
	GBps       float64 `json:"bandwidth_gb_per_s"`
	FloorUs    float64 `json:"floor_us"`
	Dispatches int     `json:"dispatches"`
	StepUs     float64 `json:"step_us"`
	DenseUs    float64 `json:"dense_us"`
	Speedup    float64 `json:"speedup"`
}

// tacticTiming holds the GPU time of one Tactic decode step by stage (the
// breakdown of the paper's Fig. 10), in microseconds, with dense attention
// on the same cache for comparison.
type tacticTiming struct {
	ClusterSortUs float64 `json:"cluster_sort_us,omitempty"` // centroid scores and cluster order
	FitUs         float64 `json:"fit_us,omitempty"`          // exact part, windows, fit, budget
	UnionUs       float64 `json:"union_us,omitempty"`        // GQA union of the selections
	AttendUs      float64 `json:"attend_us,omitempty"`       // attention over the union
	TotalUs       float64 `json:"total_us,omitempty"`
	DenseUs       float64 `json:"dense_us,omitempty"`
}

// tacticSource is a layer to evaluate, made when its turn comes.
type tacticSource struct {
	name  string
	seed  int64
	units int // progress units: KV heads × (1 + queries)
	load  func() (*trace.Trace, error)
}

func fidelity(args []string) error {
	fs := flag.NewFlagSet("fidelity", flag.ExitOnError)
	ns := fs.String("n", "32768", "context lengths of the generated layers (comma-separated)")
	ps := fs.String("p", "0.5,0.7,0.9", "target attention masses P (comma-separated)")
	tracePath := fs.String("trace", "", "evaluate this trace file (see package trace) instead of generated layers (-n and -seed are then unused)")
	queries := fs.Int("queries", 0, "decode queries: the generator makes this many; of a trace, the last this many of its consecutive tail (0: 8, or the whole tail)")
	seed := fs.Int64("seed", 1, "seed of the generated layers")
	kindsName := fs.String("kinds", "mixed", kindsUsage)
	perHead := fs.Bool("per-head", false, "also print a table of every query head's figures")
	fitArgs := addFitFlags(fs)
	spans := fs.String("span", "0", fmt.Sprintf("K-means within spans of this many tokens (comma-separated to compare; 0: whole prefill, the paper's clustering; %d recommended)", sparse.KMeansDefaultSpan))
	bandwidth := fs.Float64("bandwidth", 2870, "GB/s that a step and dense attention read at, for the bound (the H100's dense attention: 2870)")
	floor := fs.Float64("floor", 3, "µs each dependent dispatch costs before any work, for the bound")
	dispatches := fs.Int("dispatches", 3, "dependent dispatches of a sparse step, for the bound")
	batchList := fs.String("batch", "1", "batch sizes to bound (comma-separated)")
	clusterSize := fs.Int("cluster-size", sparse.KMeansDefaultAvgClusterSize, "tokens per K-means cluster on average")
	jsonPath := fs.String("json", "", "write results as JSON to this file")
	plotPath := fs.String("plot", "", "draw tokens selected and mass reached against P (or against N) into this PNG file")
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), "usage: vkbench fidelity [flags]\n\nMeasures how well Tactic's selection (float64 reference, CPU) reaches\nthe target attention mass P, against exact attention, and what a step\nmust read (centroids, the fit's key rows, the union's key and value rows):\nMB/step, the bytes read before attention per byte of the unions\n(select/union), and the most a step can gain over dense attention when both read\nat -bandwidth and each dependent dispatch costs -floor.\n\n")
		fs.PrintDefaults()
	}
	fs.Parse(args)
	if fs.NArg() > 0 {
		return fmt.Errorf("fidelity: unexpected arguments %q", fs.Args())
	}
	if err := checkOutputs(output{"json", *jsonPath}, output{"plot", *plotPath}); err != nil {
		return err
	}
	if err := checkClusterSize(*clusterSize); err != nil {
		return err
	}
	fit, err := fitArgs.fit()
	if err != nil {
		return err
	}
	pList, err := floats(*ps)
	if err != nil {
		return fmt.Errorf("-p: %v", err)
	}
	if *queries < 0 {
		return fmt.Errorf("-queries: %d is negative", *queries)
	}
	spanList, err := intsFrom(*spans, 0)
	if err != nil {
		return fmt.Errorf("-span: %v", err)
	}
	batches, err := ints(*batchList)
	if err != nil {
		return fmt.Errorf("-batch: %v", err)
	}
	if *bandwidth <= 0 || *floor < 0 || *dispatches < 1 {
		return fmt.Errorf("-bandwidth %g, -floor %g and -dispatches %d: need a positive bandwidth, a floor of at least 0 and at least one dispatch", *bandwidth, *floor, *dispatches)
	}
	if *plotPath != "" && len(spanList) > 1 {
		return fmt.Errorf("-plot draws one span; -span lists %d", len(spanList))
	}
	opts := evaluate.DefaultTacticOptions()
	opts.P = pList
	opts.Fit = fit
	opts.AvgClusterSize = *clusterSize
	if err := opts.Validate(); err != nil {
		return err
	}

	sources, err := fidelitySources(*tracePath, *queries, *ns, *kindsName, *seed, &opts)
	if err != nil {
		return err
	}
	bound := boundSpec{gbps: *bandwidth, floorUs: *floor, dispatches: *dispatches, batches: batches}
	results, err := evaluateSources(sources, spanList, opts, bound)
	if err != nil {
		return err
	}

	printTactic(results, *perHead)
	for _, r := range results {
		if r.BoundWorst > 1 {
			fmt.Fprintf(os.Stderr, "vkbench: %s n=%d P=%g: output error exceeds the bound 2(1 − p(I))·max‖v‖ (worst ratio %.3g)\n", r.Source, r.Tokens, r.P, r.BoundWorst)
		}
	}
	if *plotPath != "" {
		if err := plotTactic(*plotPath, results); err != nil {
			return err
		}
	}
	if *jsonPath != "" {
		return writeJSON(*jsonPath, "fidelity "+strings.Join(args, " "), vk.Info{}, results)
	}
	return nil
}

// fidelitySources returns the layers to evaluate: the trace at tracePath
// (its last queries consecutive tail queries, set into opts.Queries), or
// else a generated layer of the named kinds for each length in ns.
func fidelitySources(tracePath string, queries int, ns, kindsName string, seed int64, opts *evaluate.TacticOptions) ([]tacticSource, error) {
	if tracePath != "" {
		tr, err := trace.Read(tracePath)
		if err != nil {
			return nil, err
		}
		tail := evaluate.TailQueries(tr)
		if queries > 0 {
			if queries > len(tail) {
				return nil, fmt.Errorf("-queries: %s has %d consecutive tail queries, not %d", tracePath, len(tail), queries)
			}
			tail = tail[len(tail)-queries:]
		}
		opts.Queries = tail
		return []tacticSource{{name: filepath.Base(tracePath), units: tr.KVHeads * (1 + len(tail)),
			load: func() (*trace.Trace, error) { return tr, nil }}}, nil
	}
	nList, err := ints(ns)
	if err != nil {
		return nil, fmt.Errorf("-n: %v", err)
	}
	var sources []tacticSource
	for _, n := range nList {
		d := workload.DefaultConfig(n)
		cfg, err := workload.NamedConfig(kindsName, n, d.QHeads, d.KVHeads, d.HeadDim)
		if err != nil {
			return nil, fmt.Errorf("-kinds: %v", err)
		}
		cfg.Seed = seed
		if queries > 0 {
			cfg.Queries = queries
		}
		name := "generator"
		if kindsName != "mixed" {
			name += " " + kindsName
		}
		sources = append(sources, tacticSource{name: name, seed: cfg.Seed, units: cfg.KVHeads * (1 + cfg.Queries),
			load: func() (*trace.Trace, error) { return workload.Generate(cfg) }})
	}
	return sources, nil
}

// boundSpec is how a step is bounded: read at gbps GB/s, each of its
// dispatches costing floorUs before any work, for each batch size.
type boundSpec struct {
	gbps, floorUs float64
	dispatches    int
	batches       []int
}

// bounds returns the step's bound for each batch size.
func (b boundSpec) bounds(t evaluate.StepTraffic) []stepBound {
	bw := b.gbps * 1e3 // bytes per µs
	var out []stepBound
	for _, n := range b.batches {
		out = append(out, stepBound{Batch: n, GBps: b.gbps, FloorUs: b.floorUs, Dispatches: b.dispatches,
			StepUs: t.BoundUs(bw, b.floorUs, b.dispatches, n), DenseUs: t.DenseBoundUs(bw, b.floorUs, n),
			Speedup: t.BoundSpeedup(bw, b.floorUs, b.dispatches, n)})
	}
	return out
}

// evaluateSources evaluates Tactic on every source with every K-means
// span, one row per (source, span, P), with its bounds.
func evaluateSources(sources []tacticSource, spanList []int, opts evaluate.TacticOptions, bound boundSpec) ([]tacticResult, error) {
	prog := &progress{}
	defer prog.finish()
	for _, s := range sources {
		prog.total += s.units * len(spanList)
	}
	var results []tacticResult
	for _, s := range sources {
		tr, err := s.load()
		if err != nil {
			return nil, err
		}
		for _, span := range spanList {
			what := fmt.Sprintf("tactic %s n=%d span=%d", s.name, tr.Tokens, span)
			opts.Progress = func(int, int) { prog.step(what) }
			opts.KMeansSpan = span
			ev, err := evaluate.Tactic(tr, opts)
			if err != nil {
				return nil, err
			}
			for _, r := range ev.Results {
				results = append(results, tacticResult{Source: s.name, Seed: s.seed, Tokens: ev.Tokens, QHeads: ev.QHeads, KVHeads: ev.KVHeads, HeadDim: ev.HeadDim,
					Prefill: ev.Options.Prefill, Queries: ev.Options.Queries, Sinks: ev.Options.Sinks, Span: span, Fit: ev.Options.Fit, TacticResult: r,
					Bounds: bound.bounds(r.Traffic)})
			}
		}
	}
	return results, nil
}

// printTactic prints one row per (layer, P) and, with perHead, a table of
// the query heads of each.
func printTactic(results []tacticResult, perHead bool) {
	pct := func(x, n float64) string { return fmt.Sprintf("%.2f%%", 100*x/n) }
	var rows [][]string
	for _, r := range results {
		rows = append(rows, []string{r.Source, fmt.Sprint(r.Tokens), fmt.Sprint(r.Span), fmt.Sprintf("%d×%d", len(r.Queries), r.QHeads), fmt.Sprint(r.P),
			fmt.Sprintf("%.1f", r.Selected), pct(r.Selected, r.Attended), pct(r.Union, r.Attended), fmt.Sprintf("%.3f", r.Mass), fmt.Sprintf("%.3f", r.MinMass),
			fmt.Sprintf("%.1f%%", 100*r.SuccessRate), fmt.Sprintf("%.3f", r.SelectedOverClusterOptimal), pct(r.ClusterOptimal, r.Attended), pct(r.GlobalOptimal, r.Attended),
			fmt.Sprintf("%.4f", r.RelErr), fmt.Sprintf("%.3f", r.BoundWorst), fmt.Sprintf("%.1f", r.Traffic.Total()/1e6),
			fmt.Sprintf("%.2f", r.Traffic.SelectionShare())})
		for _, b := range r.Bounds {
			rows[len(rows)-1] = append(rows[len(rows)-1], fmt.Sprintf("%.2f×", b.Speedup))
		}
	}
	header := []string{"source", "tokens", "span", "queries", "P", "selected", "sel/N", "union/N", "mass", "min mass", "success", "sel/c-opt", "c-opt/N", "g-opt/N", "rel err", "bound", "MB/step", "select/union"}
	if len(results) > 0 {
		for _, b := range results[0].Bounds {
			header = append(header, fmt.Sprintf("most × B=%d", b.Batch))
		}
	}
	table(os.Stdout, header, rows)
	if !perHead {
		return
	}
	for _, r := range results {
		fmt.Printf("\n%s n=%d span=%d P=%g, per query head:\n", r.Source, r.Tokens, r.Span, r.P)
		var hr [][]string
		for _, h := range r.Heads {
			hr = append(hr, []string{fmt.Sprint(h.Head), fmt.Sprint(h.KVHead), h.Kind, fmt.Sprintf("%.1f", h.Selected), pct(h.Selected, h.Attended), fmt.Sprintf("%.3f", h.Mass),
				fmt.Sprintf("%.3f", h.OwnMass), fmt.Sprintf("%.1f%%", 100*h.SuccessRate), fmt.Sprintf("%.3f", h.SelectedOverClusterOptimal), pct(h.GlobalOptimal, h.Attended), fmt.Sprintf("%.4f", h.RelErr)})
		}
		table(os.Stdout, []string{"head", "kv", "kind", "selected", "sel/N", "mass", "own mass", "success", "sel/c-opt", "g-opt/N", "rel err"}, hr)
	}
}
