package evaluate

import (
	"fmt"
	"slices"
	"time"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/trace"
	"github.com/vksparse/vksparse/vk"
)

// TacticRun is the outcome of Tactic decode steps over a trace at one
// target mass: fidelity over every (tail query, query head), and GPU times
// at the final length.
type TacticRun struct {
	Source  string  `json:"source"`
	Tokens  int     `json:"tokens"`
	Prefill int     `json:"prefill"`
	P       float64 `json:"p"`
	Steps   int     `json:"steps"`
	// ClusterMs is the wall time of clustering the prefill and storing it
	// in cluster order, the first clustering of the run (its kernels'
	// first use, their scratch reserved as decode.Model does when made;
	// after a second of GPU load, sparse.WarmUp, as a model's prefill
	// would leave the clocks); ClusterWarmMs the wall time of clustering it again with
	// the same kernels and ReorderMs of storing it, ClusterGPUMs the GPU
	// time of that clustering (first to last timestamp).
	ClusterMs     float64 `json:"cluster_ms"`
	ClusterWarmMs float64 `json:"cluster_warm_ms"`
	ClusterGPUMs  float64 `json:"cluster_gpu_ms"`
	ReorderMs     float64 `json:"reorder_ms"`
	// ClusterStagesMs is the warm clustering's time per kind of step
	// (sparse.KMeansStages: setup is host wall time, the others GPU time).
	ClusterStagesMs map[string]float64 `json:"cluster_stages_ms"`
	DenseUs         float64            `json:"dense_us"`
	TacticUs        float64            `json:"tactic_us"` // median step, timed whole
	StageUs         map[string]float64 `json:"stage_us"`  // medians, a timestamp after every stage
	Speedup         float64            `json:"speedup"`
	SelectedPct     float64            `json:"selected_pct"` // a head's own selection, % of tokens
	UnionPct        float64            `json:"union_pct"`    // tokens its KV head read, % of tokens
	// UnionGBps is the K and V bytes of the unions (UnionPct of the tokens
	// of every KV head) over the attention stage's median time.
	UnionGBps  float64 `json:"attend_union_gb_per_s"`
	Mass       float64 `json:"mean_mass"`
	Success    float64 `json:"success_rate"` // share of (step, head) with mass ≥ P
	ClusterOpt float64 `json:"mean_cluster_optimal"`
	GlobalOpt  float64 `json:"mean_global_optimal"`
	RatioToOpt float64 `json:"selected_over_cluster_optimal"`
	RelErr     float64 `json:"mean_rel_err"`
	// Batches holds the batched steps timed beside it (B > 1).
	Batches []BatchRun `json:"batches,omitempty"`
	// Skeleton holds the bytes each stage of the timed step read
	// (TacticReads); vkbench times it.
	Skeleton *Skeleton `json:"skeleton,omitempty"`
}

// BatchRun is a batched Tactic step (sparse.TacticBatch) and dense
// attention over B sequences of a trace's final length, each its own cache
// and index (the trace clustered with its own seed for each of the others),
// every sequence given the last tail query: medians of GPU times.
type BatchRun struct {
	Batch    int     `json:"batch"`
	TacticUs float64 `json:"tactic_us"`
	DenseUs  float64 `json:"dense_us"`
	Speedup  float64 `json:"speedup"`
	UnionPct float64 `json:"union_pct"` // mean over the batch's KV heads
	// StageUs holds the median of each stage, every sequence's dispatches
	// of a stage before one timestamp; UnionGBps the unions' K and V bytes
	// over the attention stage's.
	StageUs   map[string]float64 `json:"stage_us"`
	UnionGBps float64            `json:"attend_union_gb_per_s"`
	KVBytes   float64            `json:"kv_bytes"` // K+V bytes dense attention reads
	DenseGBps float64            `json:"dense_gb_per_s"`
	// Skeleton holds the bytes each stage of the batch read, every
	// sequence's (TacticReads).
	Skeleton *Skeleton `json:"skeleton,omitempty"`
}

// TacticTrace runs Tactic over a trace on the GPU: it prefills a cache with
// the keys before the trace's decode tail (TailQueries, prefill
// DefaultPrefill), clusters them (sinks excluded) with clustering (its
// AvgClusterSize and Span; 0 takes the defaults, and Span
// sparse.KMeansDefaultSpan is what the library recommends), then for each
// P appends the tail tokens one at a time and runs a step with the fit's parameters for each tail
// query, measuring fidelity in float64 (sparse.TacticStep.Fidelity). With
// reps > 0 it also times the step and dense attention at the final length,
// and for each batch size B > 1 in batches a sparse.TacticBatch of B
// sequences beside dense attention over as many (each clustered with seed
// clustering.Seed+1, +2, …). progress, if not nil, is told each P before
// it runs.
func TacticTrace(dev *vk.Device, t *trace.Trace, ps []float64, fit sparse.TacticFit, clustering sparse.KMeansOptions, reps int, batches []int, progress func(p float64)) ([]TacticRun, error) {
	heads := sparse.Heads{Query: t.QHeads, KV: t.KVHeads, Dim: t.HeadDim}
	tail := TailQueries(t)
	if len(tail) == 0 {
		return nil, fmt.Errorf("evaluate: TacticTrace: the trace has no decode queries")
	}
	first := tail[0]
	prefill := DefaultPrefill(t, tail)
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

	layer, err := kvcache.NewLayer(dev, heads.KV, d, last+1)
	if err != nil {
		return nil, err
	}
	defer layer.Release()
	k, v := rows(0, prefill)
	if err := layer.Prefill(k, v, prefill); err != nil {
		return nil, err
	}
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1e3 }
	// The clustering's scratch is allocated before, as decode.Model does
	// when it is made.
	if err := km.Reserve(prefill-sparse.TacticDefaultSinks, clustering); err != nil {
		return nil, err
	}
	// Clocks up first, as a model's prefill leaves them before clustering.
	if err := sparse.WarmUp(dev, time.Second); err != nil {
		return nil, err
	}
	start := time.Now()
	clusters, err := km.Cluster(layer, sparse.TacticDefaultSinks, prefill-sparse.TacticDefaultSinks, clustering)
	if err != nil {
		return nil, err
	}
	defer clusters.Release()
	clusterCold := time.Since(start)
	// Again, warm: what each further layer of a model costs.
	var stages sparse.KMeansStages
	warm := clustering
	warm.Stages = &stages
	start = time.Now()
	again, err := km.Cluster(layer, sparse.TacticDefaultSinks, prefill-sparse.TacticDefaultSinks, warm)
	if err != nil {
		return nil, err
	}
	clusterWarm := time.Since(start)
	if err := again.Release(); err != nil {
		return nil, err
	}
	start = time.Now()
	if err := layer.Reorder(clusters); err != nil {
		return nil, err
	}
	reorder := time.Since(start)
	clusterMs := ms(clusterCold + reorder)
	index := make([]*kvcache.HostClusters, heads.KV)
	for g := range index {
		if index[g], err = clusters.Read(g); err != nil {
			return nil, err
		}
	}

	var out []TacticRun
	var others *peers
	for _, p := range ps {
		if progress != nil {
			progress(p)
		}
		// Back to the prefill (kept in cluster order): the decode tail is
		// appended again for each P.
		if err := layer.Truncate(prefill); err != nil {
			return nil, err
		}
		r, err := tacticRow(t, layer, clusters, index, dense, heads, first, p, fit, reps, rows, keys, values)
		if err != nil {
			return nil, err
		}
		r.Tokens, r.Prefill, r.P, r.ClusterMs = last+1, prefill, p, clusterMs
		r.ClusterWarmMs, r.ClusterGPUMs, r.ReorderMs = ms(clusterWarm), ms(stages.GPU), ms(reorder)
		r.ClusterStagesMs = map[string]float64{"setup": ms(stages.Setup), "init": ms(stages.Init), "assign": ms(stages.Assign), "scan": ms(stages.Scan),
			"scatter": ms(stages.Scatter), "sort": ms(stages.Sort), "update": ms(stages.Update)}
		for _, b := range batches {
			if reps == 0 || b <= 1 {
				continue
			}
			if others == nil {
				if others, err = batchPeers(dev, km, heads, slices.Max(batches)-1, prefill, last+1, rows, clustering); err != nil {
					return nil, err
				}
				defer others.release()
			}
			br, err := timeBatch(dense, layer, clusters, others.first(b-1), p, fit, reps, t.Query(max(0, t.Queries()-2)), t.Query(t.Queries()-1))
			if err != nil {
				return nil, err
			}
			r.Batches = append(r.Batches, br)
		}
		out = append(out, r)
	}
	return out, nil
}

// tacticRow runs the decode steps of the tail queries at mass p.
func tacticRow(t *trace.Trace, layer *kvcache.Layer, clusters *kvcache.Clusters, index []*kvcache.HostClusters, dense *sparse.Dense, heads sparse.Heads, first int, p float64, fit sparse.TacticFit, reps int,
	rows func(from, to int) ([]uint16, []uint16), keys, values [][]float64) (TacticRun, error) {
	var r TacticRun
	step, err := sparse.NewTacticStep(dense, layer, clusters, p, fit)
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
		lists, err := step.Tokens(membersOf(index))
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

	if reps == 0 {
		return r, nil
	}
	// Timing at the final length: the step's stages and dense attention,
	// after keeping the GPU busy a while so its clocks have risen.
	if err := warmUp(step, time.Second); err != nil {
		return r, err
	}
	// Stages are timed with a timestamp after each; the whole step without
	// them, as it runs in a decoder.
	if r.StageUs, err = stageMicros(step, reps); err != nil {
		return r, err
	}
	if r.TacticUs, err = medianMicros(step, reps); err != nil {
		return r, err
	}
	r.UnionGBps = unionGBps(r.UnionPct/100*float64(layer.Len()), heads, r.StageUs["attend"])
	reads, err := TacticReads(step, heads, clusters)
	if err != nil {
		return r, err
	}
	r.Skeleton = &Skeleton{Stages: step.Stages(), Bytes: reads}
	plan, err := dense.Plan([]*kvcache.Layer{layer})
	if err != nil {
		return r, err
	}
	defer plan.Release()
	if err := plan.SetQuery(t.Query(t.Queries() - 1)); err != nil {
		return r, err
	}
	if r.DenseUs, err = medianMicros(plan, reps); err != nil {
		return r, err
	}
	r.Speedup = r.DenseUs / r.TacticUs
	return r, nil
}

// peers are the other sequences of a timed batch: caches of a trace's
// tokens with their indexes.
type peers struct {
	layers   []*kvcache.Layer
	clusters []*kvcache.Clusters
}

// first returns the first n peers.
func (x *peers) first(n int) *peers {
	return &peers{layers: x.layers[:n], clusters: x.clusters[:n]}
}

func (x *peers) release() {
	for _, c := range x.clusters {
		c.Release()
	}
	for _, l := range x.layers {
		l.Release()
	}
}

// batchPeers builds count caches holding tokens [0, n) of the trace
// (rows), each clustered over [sinks, prefill) with clustering and a seed
// of its own (clustering.Seed+1, +2, …) and put in cluster order.
func batchPeers(dev *vk.Device, km *sparse.KMeans, heads sparse.Heads, count, prefill, n int, rows func(from, to int) ([]uint16, []uint16), clustering sparse.KMeansOptions) (*peers, error) {
	x := &peers{}
	for i := 0; i < count; i++ {
		layer, err := kvcache.NewLayer(dev, heads.KV, heads.Dim, n)
		if err != nil {
			x.release()
			return nil, err
		}
		x.layers = append(x.layers, layer)
		k, v := rows(0, prefill)
		if err := layer.Prefill(k, v, prefill); err != nil {
			x.release()
			return nil, err
		}
		opts := clustering
		opts.Seed += uint64(i) + 1
		c, err := km.Cluster(layer, sparse.TacticDefaultSinks, prefill-sparse.TacticDefaultSinks, opts)
		if err != nil {
			x.release()
			return nil, err
		}
		x.clusters = append(x.clusters, c)
		if err := layer.Reorder(c); err != nil {
			x.release()
			return nil, err
		}
		for layer.Len() < n {
			k, v := rows(layer.Len(), layer.Len()+1)
			if err := layer.Append(k, v); err != nil {
				x.release()
				return nil, err
			}
		}
	}
	return x, nil
}

// timeBatch times a sparse.TacticBatch over layer and the peers (every
// sequence given query q) and dense attention over the same caches.
func timeBatch(dense *sparse.Dense, layer *kvcache.Layer, clusters *kvcache.Clusters, others *peers, p float64, fit sparse.TacticFit, reps int, prev, q []float32) (BatchRun, error) {
	var r BatchRun
	layers := append([]*kvcache.Layer{layer}, others.layers...)
	indexes := append([]*kvcache.Clusters{clusters}, others.clusters...)
	b, err := sparse.NewTacticBatch(dense, layers, indexes, p, fit)
	if err != nil {
		return r, err
	}
	defer b.Release()
	qs := make([]float32, 0, len(layers)*len(q))
	for range layers {
		qs = append(qs, prev...)
	}
	// A step of the query before, as in decoding: its unions divide the
	// timed step's attention among workgroups (sparse.DensePlan.Rebalance).
	if _, err := b.Attend(qs); err != nil {
		return r, err
	}
	qs = qs[:0]
	for range layers {
		qs = append(qs, q...)
	}
	if _, err := b.Attend(qs); err != nil {
		return r, err
	}
	h := dense.Heads()
	var unionTokens int // every sequence's KV heads' unions
	for i := range layers {
		idx := make([][][]int32, h.KV)
		for g := range idx {
			hc, err := indexes[i].Read(g)
			if err != nil {
				return r, err
			}
			idx[g] = hc.Members
		}
		lists, err := b.Step(i).Tokens(idx)
		if err != nil {
			return r, err
		}
		for _, l := range lists {
			r.UnionPct += 100 * float64(len(l)) / float64(layers[i].Len()) / float64(h.KV*len(layers))
			unionTokens += len(l)
		}
	}
	if err := warmUp(b, time.Second); err != nil {
		return r, err
	}
	if r.StageUs, err = stageMicros(b, reps); err != nil {
		return r, err
	}
	tacticUs, err := medianMicros(b, reps)
	if err != nil {
		return r, err
	}
	r.UnionGBps = unionGBps(float64(unionTokens)/float64(h.KV), h, r.StageUs["attend"])
	r.Skeleton = &Skeleton{Stages: b.Stages()}
	for i := range layers {
		reads, err := TacticReads(b.Step(i), h, indexes[i])
		if err != nil {
			return r, err
		}
		if r.Skeleton.Bytes == nil {
			r.Skeleton.Bytes = make([]float64, len(reads))
		}
		if err := r.Skeleton.Add(&Skeleton{Bytes: reads}); err != nil {
			return r, err
		}
	}
	plan, err := dense.Plan(layers)
	if err != nil {
		return r, err
	}
	defer plan.Release()
	if err := plan.SetQuery(qs); err != nil {
		return r, err
	}
	denseUs, err := medianMicros(plan, reps)
	if err != nil {
		return r, err
	}
	r.Batch = len(layers)
	r.TacticUs, r.DenseUs = tacticUs, denseUs
	r.Speedup = r.DenseUs / r.TacticUs
	for _, l := range layers {
		r.KVBytes += float64(2 * l.Len() * h.KV * h.Dim * 2)
	}
	r.DenseGBps = r.KVBytes / (r.DenseUs * 1e3)
	return r, nil
}

// membersOf returns the members of every cluster of each KV head's index,
// as sparse.TacticStep.Tokens takes them.
func membersOf(index []*kvcache.HostClusters) [][][]int32 {
	members := make([][][]int32, len(index))
	for g, x := range index {
		members[g] = x.Members
	}
	return members
}

// unionGBps returns the K and V bytes (fp16) of tokens per KV head of
// heads over us microseconds, in GB/s (0 where us is not positive).
func unionGBps(tokens float64, heads sparse.Heads, us float64) float64 {
	if us <= 0 {
		return 0
	}
	return tokens * float64(heads.KV*heads.Dim*2*2) / (us * 1e3)
}
