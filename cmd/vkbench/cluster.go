package main

import (
	"flag"
	"fmt"
	"os"
	"sort"
	"time"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/trace"
	"github.com/vksparse/vksparse/workload"
)

// clusterResult is one row of `vkbench cluster`.
type clusterResult struct {
	Tokens  int `json:"tokens"`
	KVHeads int `json:"kv_heads"`
	HeadDim int `json:"head_dim"`
	// Span is the K-means span in tokens (0: the whole context), Spans
	// how many spans the clustered tokens make per head.
	Span       int     `json:"span"`
	Spans      int     `json:"spans"`
	Clusters   int     `json:"clusters_per_head"`
	Iterations int     `json:"iterations"`
	Reps       int     `json:"reps"`
	Assign     string  `json:"assign"`    // "tensor-nv" (cooperative matrices) or "float32"
	MedianMs   float64 `json:"median_ms"` // wall time of one layer's clustering, host waits included
	MinMs      float64 `json:"min_ms"`
	// GPUMedianMs is the median over the timed runs of the submission's
	// GPU time, first to last timestamp (every step, no host time).
	GPUMedianMs float64 `json:"gpu_median_ms"`
	// With -stages: per kind of step, the median over the timed runs of
	// its GPU time summed over the steps (ms); setup is host wall time.
	Stages map[string]float64 `json:"stages_ms,omitempty"`
}

var clusterStages = []string{"setup", "init", "assign", "scan", "scatter", "sort", "update", "gpu"}

func stageList(s *sparse.KMeansStages) []time.Duration {
	return []time.Duration{s.Setup, s.Init, s.Assign, s.Scan, s.Scatter, s.Sort, s.Update, s.GPU}
}

func cluster(args []string) error {
	fs := flag.NewFlagSet("cluster", flag.ExitOnError)
	ns := fs.String("n", "32768", "context lengths (comma-separated)")
	kvHeads := fs.Int("kv-heads", 8, "KV heads")
	dim := fs.Int("dim", 128, "head dimension")
	size := fs.Int("cluster-size", sparse.KMeansDefaultAvgClusterSize, "average tokens per cluster")
	iters := fs.Int("iters", 10, "at most this many K-means steps")
	reps := fs.Int("reps", 5, "timed clusterings per row")
	jsonPath := fs.String("json", "", "write results as JSON to this file")
	stages := fs.Bool("stages", false, "time each kind of step with timestamp queries")
	float32Only := fs.Bool("float32", false, "assign with the float32 kernel even where cooperative matrices exist")
	spanFlag := fs.String("span", fmt.Sprint(sparse.KMeansDefaultSpan), "cluster within spans of this many tokens, each separately (0: the whole context at once; comma-separated to compare)")
	fs.Parse(args)
	if err := checkOutputs(output{"json", *jsonPath}); err != nil {
		return err
	}
	if err := checkClusterSize(*size); err != nil {
		return err
	}
	nList, err := ints(*ns)
	if err != nil {
		return fmt.Errorf("-n: %v", err)
	}
	spanList, err := intsFrom(*spanFlag, 0)
	if err != nil {
		return fmt.Errorf("-span: %v", err)
	}
	dev, err := openDevice()
	if err != nil {
		return err
	}
	defer dev.Release()
	info := dev.Info()
	km, err := sparse.NewKMeans(dev, *kvHeads, *dim)
	if err != nil {
		return err
	}
	defer km.Release()
	if *float32Only {
		km.SetTensor(false)
	}
	path := "float32"
	if km.Tensor() {
		path = "tensor-nv"
	}
	prog := &progress{total: len(nList) * len(spanList) * (*reps + 1)}
	var results []clusterResult
	for _, n := range nList {
		cfg := workload.DefaultConfig(n)
		cfg.KVHeads, cfg.QHeads, cfg.HeadDim, cfg.Queries, cfg.Kinds = *kvHeads, *kvHeads, *dim, 1, nil
		tr, err := workload.Generate(cfg)
		if err != nil {
			return err
		}
		layer, err := kvcache.NewLayer(dev, *kvHeads, *dim, n)
		if err != nil {
			return err
		}
		rows, err := clusterRows(km, layer, tr, n, spanList, *size, *iters, *reps, *stages, path, prog)
		layer.Release()
		if err != nil {
			prog.finish()
			return err
		}
		results = append(results, rows...)
	}
	prog.finish()
	var rows [][]string
	head := []string{"tokens", "kv heads", "dim", "span", "spans", "clusters/head", "iterations", "assign", "median ms", "min ms", "gpu median ms"}
	if *stages {
		for _, name := range clusterStages {
			head = append(head, name+" ms")
		}
	}
	for _, r := range results {
		row := []string{fmt.Sprint(r.Tokens), fmt.Sprint(r.KVHeads), fmt.Sprint(r.HeadDim), fmt.Sprint(r.Span), fmt.Sprint(r.Spans), fmt.Sprint(r.Clusters), fmt.Sprint(r.Iterations), r.Assign,
			fmt.Sprintf("%.2f", r.MedianMs), fmt.Sprintf("%.2f", r.MinMs), fmt.Sprintf("%.2f", r.GPUMedianMs)}
		if *stages {
			for _, name := range clusterStages {
				row = append(row, fmt.Sprintf("%.2f", r.Stages[name]))
			}
		}
		rows = append(rows, row)
	}
	table(os.Stdout, head, rows)
	if *jsonPath != "" {
		return writeJSON(*jsonPath, "cluster "+fmt.Sprint(args), info, results)
	}
	return nil
}

// clusterRows times the clustering of layer (n tokens of tr, sinks left
// out) at each span: a warm-up run, then reps timed ones.
func clusterRows(km *sparse.KMeans, layer *kvcache.Layer, tr *trace.Trace, n int, spanList []int, size, iters, reps int, stages bool, path string, prog *progress) ([]clusterResult, error) {
	var out []clusterResult
	for _, span := range spanList {
		count := n - sparse.TacticDefaultSinks
		spans, err := sparse.KMeansSpans(count, span, size)
		if err != nil {
			return nil, err
		}
		r := clusterResult{Tokens: n, KVHeads: layer.KVHeads(), HeadDim: layer.HeadDim(), Span: span, Spans: len(spans), Reps: reps, Assign: path}
		var times, gpuTimes []float64
		stageTimes := make([][]float64, len(clusterStages))
		for i := 0; i <= reps; i++ {
			prog.step(fmt.Sprintf("cluster n=%d span=%d", n, span))
			if err := layer.Prefill(tr.K, tr.V, n); err != nil {
				return nil, err
			}
			start := time.Now()
			// Timestamps around every dispatch: GPU time always, per step
			// with -stages.
			var st sparse.KMeansStages
			opts := sparse.KMeansOptions{AvgClusterSize: size, MaxIter: iters, Seed: uint64(i + 1), Span: span, Stages: &st}
			x, err := km.Cluster(layer, sparse.TacticDefaultSinks, count, opts)
			if err != nil {
				return nil, err
			}
			el := time.Since(start)
			r.Clusters, r.Iterations = x.C, x.Iterations
			x.Release()
			if i > 0 { // the first run warms up
				times = append(times, float64(el.Microseconds())/1e3)
				gpuTimes = append(gpuTimes, float64(st.GPU.Microseconds())/1e3)
				for j, d := range stageList(&st) {
					stageTimes[j] = append(stageTimes[j], float64(d.Microseconds())/1e3)
				}
			}
		}
		sort.Float64s(times)
		sort.Float64s(gpuTimes)
		r.MedianMs, r.MinMs, r.GPUMedianMs = times[len(times)/2], times[0], gpuTimes[len(gpuTimes)/2]
		if stages {
			r.Stages = map[string]float64{}
			for j, name := range clusterStages {
				sort.Float64s(stageTimes[j])
				r.Stages[name] = stageTimes[j][len(stageTimes[j])/2]
			}
		}
		out = append(out, r)
	}
	return out, nil
}
