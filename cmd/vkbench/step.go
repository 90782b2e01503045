package main

import (
	"flag"
	"fmt"
	"os"
	"time"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/trace"
	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/workload"
)

// stepResult is one row of `vkbench tactic`: one context and target mass,
// over the decode steps of the trace's tail queries.
type stepResult struct {
	Source      string             `json:"source"`
	Tokens      int                `json:"tokens"`
	Prefill     int                `json:"prefill"`
	P           float64            `json:"p"`
	Steps       int                `json:"steps"`
	ClusterMs   float64            `json:"cluster_ms"`
	DenseUs     float64            `json:"dense_us"`
	TacticUs    float64            `json:"tactic_us"`
	StageUs     map[string]float64 `json:"stage_us"`
	Speedup     float64            `json:"speedup"`
	SelectedPct float64            `json:"selected_pct"` // a head's own selection, % of tokens
	UnionPct    float64            `json:"union_pct"`    // tokens its KV head read, % of tokens
	Mass        float64            `json:"mean_mass"`
	Success     float64            `json:"success_rate"` // share of (step, head) with mass ≥ P
	ClusterOpt  float64            `json:"mean_cluster_optimal"`
	GlobalOpt   float64            `json:"mean_global_optimal"`
	RatioToOpt  float64            `json:"selected_over_cluster_optimal"`
	RelErr      float64            `json:"mean_rel_err"`
}

func tactic(args []string) error {
	fs := flag.NewFlagSet("tactic", flag.ExitOnError)
	ns := fs.String("n", "32768", "context lengths of the generated workload (comma-separated)")
	ps := fs.String("p", "0.5,0.7,0.9", "target attention masses (comma-separated)")
	tracePath := fs.String("trace", "", "a trace file to run instead of the generated workload")
	qHeads := fs.Int("heads", 32, "query heads (generated workload)")
	kvHeads := fs.Int("kv-heads", 8, "KV heads (generated workload)")
	dim := fs.Int("dim", 128, "head dimension (generated workload)")
	reps := fs.Int("reps", 50, "timed runs per row")
	seed := fs.Int64("seed", 1, "workload and K-means seed")
	jsonPath := fs.String("json", "", "write results as JSON to this file")
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
			cfg := workload.DefaultConfig(n)
			cfg.QHeads, cfg.KVHeads, cfg.HeadDim, cfg.Seed, cfg.Kinds = *qHeads, *kvHeads, *dim, *seed, nil
			t, err := workload.Generate(cfg)
			if err != nil {
				return err
			}
			traces, names = append(traces, t), append(names, fmt.Sprintf("workload n=%d", n))
		}
	}
	dev, err := openDevice()
	if err != nil {
		return err
	}
	defer dev.Release()
	prog := &progress{total: len(traces) * len(pList)}
	var results []stepResult
	for i, t := range traces {
		rows, err := tacticRows(dev, t, names[i], pList, *reps, uint64(*seed), prog)
		if err != nil {
			prog.finish()
			return err
		}
		results = append(results, rows...)
	}
	prog.finish()
	var rows [][]string
	for _, r := range results {
		st := ""
		for _, s := range sparse.TacticStages {
			st += fmt.Sprintf("%s %.0f ", s, r.StageUs[s])
		}
		rows = append(rows, []string{r.Source, fmt.Sprint(r.P), fmt.Sprintf("%.1f", r.DenseUs), fmt.Sprintf("%.1f", r.TacticUs), fmt.Sprintf("%.2f×", r.Speedup),
			fmt.Sprintf("%.1f", r.SelectedPct), fmt.Sprintf("%.1f", r.UnionPct), fmt.Sprintf("%.3f", r.Mass), fmt.Sprintf("%.0f%%", 100*r.Success),
			fmt.Sprintf("%.2f", r.RatioToOpt), fmt.Sprintf("%.1e", r.RelErr), st})
	}
	table(os.Stdout, []string{"source", "P", "dense µs", "tactic µs", "speed-up", "selected %", "union %", "mass", "success", "sel/cluster-opt", "rel err", "stages µs"}, rows)
	for _, r := range results {
		fmt.Printf("clustering %s: %.1f ms (%d tokens)\n", r.Source, r.ClusterMs, r.Prefill)
		break
	}
	if *jsonPath != "" {
		return writeJSON(*jsonPath, "tactic "+fmt.Sprint(args), dev.Info(), results)
	}
	return nil
}

// tailStart returns the index of the first of the consecutive queries that
// end the trace.
func tailStart(t *trace.Trace) int {
	i := t.Queries() - 1
	for i > 0 && t.QPos[i-1] == t.QPos[i]-1 {
		i--
	}
	return i
}

// tacticRows prefills a cache with the keys before the trace's decode
// tail (rounded down to 64), clusters them, then for each P appends the
// tail tokens one by one and runs a Tactic step for each tail query,
// measuring fidelity; the step and dense attention are timed at the end.
func tacticRows(dev *vk.Device, t *trace.Trace, name string, ps []float64, reps int, seed uint64, prog *progress) ([]stepResult, error) {
	heads := sparse.Heads{Query: t.QHeads, KV: t.KVHeads, Dim: t.HeadDim}
	first := tailStart(t)
	prefill := int(t.QPos[first]) / 64 * 64
	last := int(t.QPos[t.Queries()-1])
	d := t.HeadDim
	rows := func(from, to int) (k, v []uint16) { // tokens [from, to) of every KV head
		for g := 0; g < t.KVHeads; g++ {
			k = append(k, t.K[(g*t.Tokens+from)*d:(g*t.Tokens+to)*d]...)
			v = append(v, t.V[(g*t.Tokens+from)*d:(g*t.Tokens+to)*d]...)
		}
		return k, v
	}
	keys := make([][]float64, t.KVHeads)
	values := make([][]float64, t.KVHeads)
	for g := range keys {
		keys[g] = sparse.HalvesToFloat64(t.K[g*t.Tokens*d : (g+1)*t.Tokens*d])
		values[g] = sparse.HalvesToFloat64(t.V[g*t.Tokens*d : (g+1)*t.Tokens*d])
	}
	dense, err := sparse.NewDense(dev, heads)
	if err != nil {
		return nil, err
	}
	defer dense.Release()
	km, err := sparse.NewKMeans(dev, heads.KV, d)
	if err != nil {
		return nil, err
	}
	defer km.Release()

	var out []stepResult
	for _, p := range ps {
		prog.step(fmt.Sprintf("tactic %s P=%v", name, p))
		layer, err := kvcache.NewLayer(dev, heads.KV, d, last+1)
		if err != nil {
			return nil, err
		}
		r, err := tacticRow(dev, t, layer, dense, km, heads, prefill, first, p, reps, seed, rows, keys, values)
		layer.Release()
		if err != nil {
			return nil, err
		}
		r.Source, r.Tokens, r.Prefill, r.P = name, last+1, prefill, p
		out = append(out, r)
	}
	return out, nil
}

func tacticRow(dev *vk.Device, t *trace.Trace, layer *kvcache.Layer, dense *sparse.Dense, km *sparse.KMeans, heads sparse.Heads, prefill, first int, p float64, reps int, seed uint64,
	rows func(from, to int) ([]uint16, []uint16), keys, values [][]float64) (stepResult, error) {
	var r stepResult
	k, v := rows(0, prefill)
	if err := layer.Prefill(k, v, prefill); err != nil {
		return r, err
	}
	start := time.Now()
	clusters, err := km.Cluster(layer, sparse.TacticDefaultSinks, prefill-sparse.TacticDefaultSinks, sparse.KMeansOptions{Seed: seed})
	if err != nil {
		return r, err
	}
	defer clusters.Release()
	r.ClusterMs = float64(time.Since(start).Microseconds()) / 1e3
	index := make([]*kvcache.HostClusters, heads.KV)
	for g := range index {
		if index[g], err = clusters.Read(g); err != nil {
			return r, err
		}
	}
	step, err := sparse.NewTacticStep(dense, layer, clusters, p, sparse.DefaultTacticFit())
	if err != nil {
		return r, err
	}
	defer step.Release()
	d := heads.Dim
	var cases int
	for qi := first; qi < t.Queries(); qi++ {
		pos := int(t.QPos[qi])
		for layer.Len() <= pos { // decode: the tail grows one token at a time
			k, v := rows(layer.Len(), layer.Len()+1)
			if err := layer.Append(k, v); err != nil {
				return r, err
			}
		}
		q := t.Query(qi)
		o, err := step.Attend(q)
		if err != nil {
			return r, err
		}
		n := layer.Len()
		kk, vv := make([][]float64, heads.KV), make([][]float64, heads.KV)
		for g := range kk {
			kk[g], vv[g] = keys[g][:n*d], values[g][:n*d]
		}
		fid, err := step.Fidelity(q, o, kk, vv, index)
		if err != nil {
			return r, err
		}
		lists, err := step.Tokens()
		if err != nil {
			return r, err
		}
		for hh, f := range fid {
			g := hh / heads.Group()
			cases++
			r.Mass += f.Mass
			if f.Success(p) {
				r.Success++
			}
			r.SelectedPct += 100 * float64(f.Selected) / float64(n)
			r.UnionPct += 100 * float64(len(lists[g])) / float64(n)
			r.ClusterOpt += float64(f.ClusterOptimal)
			r.GlobalOpt += float64(f.GlobalOptimal)
			r.RatioToOpt += float64(f.Selected)
			r.RelErr += f.RelErr
		}
		r.Steps++
	}
	c := float64(cases)
	r.Mass, r.Success, r.SelectedPct, r.UnionPct, r.RelErr = r.Mass/c, r.Success/c, r.SelectedPct/c, r.UnionPct/c, r.RelErr/c
	r.RatioToOpt /= r.ClusterOpt
	r.ClusterOpt, r.GlobalOpt = r.ClusterOpt/c, r.GlobalOpt/c

	// Timing at the final length: the step's stages and dense attention,
	// after keeping the GPU busy a while so its clocks have risen.
	for spin := time.Now(); time.Since(spin) < 300*time.Millisecond; {
		if _, err := step.Time(0, 20); err != nil {
			return r, err
		}
	}
	stages, total, err := step.TimeStages(10, reps)
	if err != nil {
		return r, err
	}
	r.StageUs = map[string]float64{}
	for i, s := range sparse.TacticStages {
		r.StageUs[s] = float64(stages[i].Nanoseconds()) / 1e3
	}
	r.TacticUs = float64(total.Nanoseconds()) / 1e3
	plan, err := dense.Plan([]*kvcache.Layer{layer})
	if err != nil {
		return r, err
	}
	defer plan.Release()
	if err := plan.SetQuery(t.Query(t.Queries() - 1)); err != nil {
		return r, err
	}
	times, err := plan.Time(10, reps)
	if err != nil {
		return r, err
	}
	r.DenseUs = float64(times[len(times)/2].Nanoseconds()) / 1e3
	r.Speedup = r.DenseUs / r.TacticUs
	return r, nil
}
