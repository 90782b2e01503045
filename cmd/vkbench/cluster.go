package main

import (
	"flag"
	"fmt"
	"os"
	"sort"
	"time"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/workload"
)

// clusterResult is one row of `vkbench cluster`.
type clusterResult struct {
	Tokens     int     `json:"tokens"`
	KVHeads    int     `json:"kv_heads"`
	HeadDim    int     `json:"head_dim"`
	Clusters   int     `json:"clusters_per_head"`
	Iterations int     `json:"iterations"`
	Reps       int     `json:"reps"`
	MedianMs   float64 `json:"median_ms"` // wall time of one layer's clustering, host waits included
	MinMs      float64 `json:"min_ms"`
}

func cluster(args []string) error {
	fs := flag.NewFlagSet("cluster", flag.ExitOnError)
	ns := fs.String("n", "32768", "context lengths (comma-separated)")
	kvHeads := fs.Int("kv-heads", 8, "KV heads")
	dim := fs.Int("dim", 128, "head dimension")
	size := fs.Int("cluster-size", 16, "average tokens per cluster")
	iters := fs.Int("iters", 10, "at most this many K-means steps")
	reps := fs.Int("reps", 5, "timed clusterings per row")
	jsonPath := fs.String("json", "", "write results as JSON to this file")
	fs.Parse(args)
	nList, err := ints(*ns)
	if err != nil {
		return fmt.Errorf("-n: %v", err)
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
	prog := &progress{total: len(nList) * (*reps + 1)}
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
		r := clusterResult{Tokens: n, KVHeads: *kvHeads, HeadDim: *dim, Reps: *reps}
		var times []float64
		for i := 0; i <= *reps && err == nil; i++ {
			prog.step(fmt.Sprintf("cluster n=%d", n))
			if err = layer.Prefill(tr.K, tr.V, n); err != nil {
				break
			}
			start := time.Now()
			var x *kvcache.Clusters
			x, err = km.Cluster(layer, sparse.TacticDefaultSinks, n-sparse.TacticDefaultSinks, sparse.KMeansOptions{AvgClusterSize: *size, MaxIter: *iters, Seed: uint64(i + 1)})
			if err != nil {
				break
			}
			el := time.Since(start)
			r.Clusters, r.Iterations = x.C, x.Iterations
			x.Release()
			if i > 0 { // the first run warms up
				times = append(times, float64(el.Microseconds())/1e3)
			}
		}
		layer.Release()
		if err != nil {
			prog.finish()
			return err
		}
		sort.Float64s(times)
		r.MedianMs, r.MinMs = times[len(times)/2], times[0]
		results = append(results, r)
	}
	prog.finish()
	var rows [][]string
	for _, r := range results {
		rows = append(rows, []string{fmt.Sprint(r.Tokens), fmt.Sprint(r.KVHeads), fmt.Sprint(r.HeadDim), fmt.Sprint(r.Clusters), fmt.Sprint(r.Iterations), fmt.Sprintf("%.1f", r.MedianMs), fmt.Sprintf("%.1f", r.MinMs)})
	}
	table(os.Stdout, []string{"tokens", "kv heads", "dim", "clusters/head", "iterations", "median ms", "min ms"}, rows)
	if *jsonPath != "" {
		return writeJSON(*jsonPath, "cluster "+fmt.Sprint(args), info, results)
	}
	return nil
}
