package main

import (
	"flag"
	"fmt"
	"math"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/vk"
)

// attnResult is one row of `vkbench attn`.
type attnResult struct {
	Tokens    int                 `json:"tokens"`
	Batch     int                 `json:"batch"`
	QHeads    int                 `json:"q_heads"`
	KVHeads   int                 `json:"kv_heads"`
	HeadDim   int                 `json:"head_dim"`
	Chunk     int                 `json:"chunk_tokens"` // 0: chosen by the kernel
	Kernel    sparse.DenseOptions `json:"kernel"`
	Reps      int                 `json:"reps"`
	MedianUs  float64             `json:"median_us"`
	P10Us     float64             `json:"p10_us"`
	P90Us     float64             `json:"p90_us"`
	KVBytes   uint64              `json:"kv_bytes"`
	GBps      float64             `json:"kv_gb_per_s"` // K+V bytes / median time
	MaxRelErr float64             `json:"max_rel_err,omitempty"`
	Checked   bool                `json:"checked"`
	Selected  int                 `json:"selected_tokens_per_kv_head,omitempty"` // -select: tokens read per KV head
}

func attn(args []string) error {
	fs := flag.NewFlagSet("attn", flag.ExitOnError)
	ns := fs.String("n", "4096,32768,131072", "context lengths (comma-separated)")
	qHeads := fs.Int("heads", 32, "query heads")
	kvHeads := fs.Int("kv-heads", 8, "KV heads")
	dim := fs.Int("dim", 128, "head dimension")
	batches := fs.String("batch", "1", "batch sizes (comma-separated)")
	chunks := fs.String("chunk", "0", "tokens per chunk to try (comma-separated; 0 = automatic)")
	variants := fs.String("variants", "", "kernel variants to compare, ';'-separated, each a ','-separated list of tpr=N, tree=0|1, wg=N, tile=N, unroll=N, rpt=N, group=N (query heads a workgroup attends for) (empty: chosen for the device)")
	reps := fs.Int("reps", 50, "timed runs per row")
	warmup := fs.Int("warmup", 10, "untimed runs before timing")
	check := fs.Bool("check", true, "compare the first sequence with the float64 reference")
	jsonPath := fs.String("json", "", "write results as JSON to this file")
	selectFrac := fs.Float64("select", 0, "attend only this share, in (0, 1], of each KV head's tokens, chosen at random, through token lists (the gathered attention of sparse policies); batch 1 (left out: dense attention)")
	fs.Parse(args)
	if err := checkOutputs(output{"json", *jsonPath}); err != nil {
		return err
	}
	nList, err := ints(*ns)
	if err != nil {
		return fmt.Errorf("-n: %v", err)
	}
	bList, err := ints(*batches)
	if err != nil {
		return fmt.Errorf("-batch: %v", err)
	}
	gatherShare = 0
	if flagGiven(fs, "select") {
		if err := checkSelect(*selectFrac, bList); err != nil {
			return err
		}
		gatherShare = *selectFrac
	}
	cList, err := intsFrom(*chunks, 0)
	if err != nil {
		return fmt.Errorf("-chunk: %v", err)
	}
	optList, err := parseVariants(*variants)
	if err != nil {
		return fmt.Errorf("-variants: %v", err)
	}
	heads := sparse.Heads{Query: *qHeads, KV: *kvHeads, Dim: *dim}
	dev, err := openDevice()
	if err != nil {
		return err
	}
	defer dev.Release()
	info := dev.Info()
	var kernels []*sparse.Dense
	for _, opts := range optList {
		dense, err := sparse.NewDenseWith(dev, heads, opts)
		if err != nil {
			return err
		}
		defer dense.Release()
		kernels = append(kernels, dense)
	}

	prog := &progress{total: len(nList) * len(bList) * len(cList) * len(kernels)}
	var results []attnResult
	for _, b := range bList {
		for _, n := range nList {
			res, err := attnRows(dev, kernels, heads, n, b, cList, *warmup, *reps, *check, prog)
			if err != nil {
				prog.finish()
				return err
			}
			results = append(results, res...)
		}
	}
	prog.finish()
	var rows [][]string
	for _, r := range results {
		chunk := "auto"
		if r.Chunk > 0 {
			chunk = fmt.Sprint(r.Chunk)
		}
		errCol := "-"
		if r.Checked {
			errCol = fmt.Sprintf("%.1e", r.MaxRelErr)
		}
		rows = append(rows, []string{fmt.Sprint(r.Tokens), fmt.Sprint(r.Batch), fmt.Sprintf("%d/%d", r.QHeads, r.KVHeads), fmt.Sprint(r.HeadDim), chunk, variantName(r.Kernel),
			fmt.Sprintf("%.1f", r.MedianUs), fmt.Sprintf("%.1f", r.P10Us), fmt.Sprintf("%.1f", r.P90Us), fmt.Sprintf("%.1f", float64(r.KVBytes)/1e6), fmt.Sprintf("%.0f", r.GBps), errCol})
	}
	table(os.Stdout, []string{"tokens", "batch", "heads q/kv", "dim", "chunk", "kernel", "median µs", "p10 µs", "p90 µs", "K+V MB", "GB/s", "rel err"}, rows)
	if *jsonPath != "" {
		return writeJSON(*jsonPath, "attn "+fmt.Sprint(args), info, results)
	}
	return nil
}

// attnRows builds batch caches of n random tokens and times every chunk size.
func attnRows(dev *vk.Device, kernels []*sparse.Dense, heads sparse.Heads, n, batch int, chunks []int, warmup, reps int, check bool, prog *progress) ([]attnResult, error) {
	rng := newHalfSource(uint64(n*31 + batch))
	layers := make([]*kvcache.Layer, batch)
	defer func() {
		for _, l := range layers {
			if l != nil {
				l.Release()
			}
		}
	}()
	var k0, v0 []uint16
	for i := range layers {
		l, err := kvcache.NewLayer(dev, heads.KV, heads.Dim, n)
		if err != nil {
			return nil, err
		}
		layers[i] = l
		k, v := rng.halves(heads.KV*n*heads.Dim), rng.halves(heads.KV*n*heads.Dim)
		if err := l.Prefill(k, v, n); err != nil {
			return nil, err
		}
		if i == 0 {
			k0, v0 = k, v
		}
	}
	q := make([]float32, batch*heads.Query*heads.Dim)
	for i := range q {
		q[i] = float32(rng.normal() * 2)
	}
	var out []attnResult
	for _, dense := range kernels {
		rows, err := attnTime(dense, layers, q, k0, v0, chunks, warmup, reps, check, prog)
		if err != nil {
			return nil, err
		}
		out = append(out, rows...)
	}
	return out, nil
}

// gatherShare is -select: the share of tokens gathered attention reads.
var gatherShare float64

// planFor plans dense attention over the caches, or, with -select, gathered
// attention over a random gatherShare of the first cache's tokens per KV head.
func planFor(dense *sparse.Dense, layers []*kvcache.Layer) (*sparse.DensePlan, [][]int32, error) {
	if gatherShare == 0 {
		plan, err := dense.Plan(layers)
		return plan, nil, err
	}
	if len(layers) != 1 {
		return nil, nil, fmt.Errorf("-select needs batch 1")
	}
	n := layers[0].Len()
	count := max(1, int(gatherShare*float64(n)))
	plan, err := dense.PlanGather(layers[0], count)
	if err != nil {
		return nil, nil, err
	}
	rng := newHalfSource(uint64(n))
	lists := make([][]int32, dense.Heads().KV)
	for g := range lists {
		// A random subset, ascending: every token with probability share.
		for t := 0; t < n && len(lists[g]) < count; t++ {
			if (rng.uniform()+1)/2 < gatherShare {
				lists[g] = append(lists[g], int32(t))
			}
		}
		if len(lists[g]) == 0 {
			lists[g] = []int32{0}
		}
	}
	if err := plan.SetTokens(lists); err != nil {
		plan.Release()
		return nil, nil, err
	}
	return plan, lists, nil
}

// attnTime times one kernel variant over the caches for every chunk size.
func attnTime(dense *sparse.Dense, layers []*kvcache.Layer, q []float32, k0, v0 []uint16, chunks []int, warmup, reps int, check bool, prog *progress) ([]attnResult, error) {
	heads, n, batch := dense.Heads(), layers[0].Len(), len(layers)
	plan, lists, err := planFor(dense, layers)
	if err != nil {
		return nil, err
	}
	defer plan.Release()
	defer func() { dense.ChunkTokens = 0 }()
	var out []attnResult
	for _, chunk := range chunks {
		prog.step(fmt.Sprintf("attn n=%d batch=%d chunk=%d %s", n, batch, chunk, variantName(dense.Options())))
		dense.ChunkTokens = chunk
		r := attnResult{Tokens: n, Batch: batch, QHeads: heads.Query, KVHeads: heads.KV, HeadDim: heads.Dim, Chunk: chunk, Kernel: dense.Options(), Reps: reps,
			KVBytes: uint64(batch) * uint64(n) * uint64(heads.KV*heads.Dim) * 4}
		if lists != nil {
			r.KVBytes = 0
			for _, l := range lists {
				r.Selected += len(l)
				r.KVBytes += uint64(len(l)*heads.Dim) * 4
			}
			r.Selected /= len(lists)
		}
		if check {
			got, err := plan.Attend(q)
			if err != nil {
				return nil, err
			}
			want, err := reference(heads, q, k0, v0, n, lists)
			if err != nil {
				return nil, err
			}
			r.MaxRelErr, r.Checked = maxRelErr(want, got, heads.Dim), true
			if !(r.MaxRelErr < 1e-3) {
				return nil, fmt.Errorf("attention at n=%d differs from the reference: relative error %.3g", n, r.MaxRelErr)
			}
		} else if err := plan.SetQuery(q); err != nil {
			return nil, err
		}
		// Keep the GPU busy a while first, so its clocks have risen.
		for spin := time.Now(); time.Since(spin) < 300*time.Millisecond; {
			if _, err := plan.Time(0, 20); err != nil {
				return nil, err
			}
		}
		times, err := plan.Time(warmup, reps)
		if err != nil {
			return nil, err
		}
		us := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }
		r.MedianUs, r.P10Us, r.P90Us = us(times[len(times)/2]), us(times[len(times)/10]), us(times[len(times)*9/10])
		r.GBps = float64(r.KVBytes) / (r.MedianUs * 1e3)
		out = append(out, r)
	}
	return out, nil
}

// reference computes the float64 attention of the first sequence: dense,
// or over lists[g] for KV head g.
func reference(heads sparse.Heads, q []float32, k0, v0 []uint16, n int, lists [][]int32) ([]float64, error) {
	k, v := sparse.HalvesToFloat64(k0), sparse.HalvesToFloat64(v0)
	scale := 1 / math.Sqrt(float64(heads.Dim))
	if lists == nil {
		return sparse.DenseRef(heads, q[:heads.Query*heads.Dim], k, v, n, scale)
	}
	d := heads.Dim
	var out []float64
	for h := 0; h < heads.Query; h++ {
		g := h / heads.Group()
		qh := make([]float64, d)
		for i := range qh {
			qh[i] = float64(q[h*d+i])
		}
		o, err := sparse.AttendSubsetRef(qh, k[g*n*d:(g+1)*n*d], v[g*n*d:(g+1)*n*d], lists[g], scale)
		if err != nil {
			return nil, err
		}
		out = append(out, o...)
	}
	return out, nil
}

// maxRelErr returns the largest per-head ‖got − want‖/‖want‖.
func maxRelErr(want []float64, got []float32, dim int) float64 {
	worst := 0.0
	for h := 0; h*dim < len(want); h++ {
		o := make([]float64, dim)
		for i := range o {
			o[i] = float64(got[h*dim+i])
		}
		e, err := sparse.RelativeError(o, want[h*dim:(h+1)*dim])
		if err != nil || math.IsNaN(e) {
			return math.Inf(1)
		}
		worst = math.Max(worst, e)
	}
	return worst
}

// parseVariants reads the -variants flag.
func parseVariants(s string) ([]sparse.DenseOptions, error) {
	if strings.TrimSpace(s) == "" {
		return []sparse.DenseOptions{{}}, nil
	}
	var out []sparse.DenseOptions
	for _, v := range strings.Split(s, ";") {
		var o sparse.DenseOptions
		for _, kv := range strings.Split(v, ",") {
			key, val, ok := strings.Cut(strings.TrimSpace(kv), "=")
			n, err := strconv.Atoi(val)
			if !ok || err != nil || n < 0 {
				return nil, fmt.Errorf("%q is not key=N", kv)
			}
			switch key {
			case "tpr":
				o.ThreadsPerRow = n
			case "tree":
				o.TreeReduce = n != 0
			case "wg":
				o.Workgroup = n
			case "tile":
				o.Tile = n
			case "unroll":
				o.Unroll = n
			case "rpt":
				o.RowsPerThread = n
			case "group":
				o.Group = n
			default:
				return nil, fmt.Errorf("unknown key %q", key)
			}
		}
		out = append(out, o)
	}
	return out, nil
}

// variantName is a short label of a kernel's options.
func variantName(o sparse.DenseOptions) string {
	r := "sg"
	if o.TreeReduce {
		r = "tree"
	}
	name := fmt.Sprintf("tpr%d/rpt%d/wg%d/tile%d/u%d/%s", o.ThreadsPerRow, o.RowsPerThread, o.Workgroup, o.Tile, o.Unroll, r)
	if o.Group > 0 {
		name += fmt.Sprintf("/g%d", o.Group)
	}
	return name
}
