package main

import (
	"flag"
	"fmt"
	"math"
	"os"
	"time"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/vk"
)

// attnResult is one row of `vkbench attn`.
type attnResult struct {
	Tokens    int     `json:"tokens"`
	Batch     int     `json:"batch"`
	QHeads    int     `json:"q_heads"`
	KVHeads   int     `json:"kv_heads"`
	HeadDim   int     `json:"head_dim"`
	Chunk     int     `json:"chunk_tokens"` // 0: chosen by the kernel
	TPR       int     `json:"threads_per_row"`
	Tree      bool    `json:"tree_reduce"`
	Reps      int     `json:"reps"`
	MedianUs  float64 `json:"median_us"`
	P10Us     float64 `json:"p10_us"`
	P90Us     float64 `json:"p90_us"`
	KVBytes   uint64  `json:"kv_bytes"`
	GBps      float64 `json:"kv_gb_per_s"` // K+V bytes / median time
	MaxRelErr float64 `json:"max_rel_err,omitempty"`
	Checked   bool    `json:"checked"`
}

func attn(args []string) error {
	fs := flag.NewFlagSet("attn", flag.ExitOnError)
	ns := fs.String("n", "4096,32768,131072", "context lengths (comma-separated)")
	qHeads := fs.Int("heads", 32, "query heads")
	kvHeads := fs.Int("kv-heads", 8, "KV heads")
	dim := fs.Int("dim", 128, "head dimension")
	batches := fs.String("batch", "1", "batch sizes (comma-separated)")
	chunks := fs.String("chunk", "0", "tokens per chunk to try (comma-separated; 0 = automatic)")
	tprs := fs.String("tpr", "0", "threads per K row to try (comma-separated; 0 = automatic)")
	trees := fs.String("tree", "0", "reductions to try: 0 subgroup where supported, 1 shared-memory tree (comma-separated)")
	reps := fs.Int("reps", 50, "timed runs per row")
	warmup := fs.Int("warmup", 10, "untimed runs before timing")
	check := fs.Bool("check", true, "compare the first sequence with the float64 reference")
	jsonPath := fs.String("json", "", "write results as JSON to this file")
	fs.Parse(args)
	nList, err := ints(*ns)
	if err != nil {
		return fmt.Errorf("-n: %v", err)
	}
	bList, err := ints(*batches)
	if err != nil {
		return fmt.Errorf("-batch: %v", err)
	}
	cList, err := intsFrom(*chunks, 0)
	if err != nil {
		return fmt.Errorf("-chunk: %v", err)
	}
	tList, err := intsFrom(*tprs, 0)
	if err != nil {
		return fmt.Errorf("-tpr: %v", err)
	}
	heads := sparse.Heads{Query: *qHeads, KV: *kvHeads, Dim: *dim}
	dev, err := vk.Open(vk.OptionsFromEnv())
	if err != nil {
		return err
	}
	defer dev.Release()
	info := dev.Info()
	fmt.Printf("device: %s (%s), driver %s\n", info.Name, info.Type, info.Driver)
	treeList, err := intsFrom(*trees, 0)
	if err != nil {
		return fmt.Errorf("-tree: %v", err)
	}
	var kernels []*sparse.Dense
	for _, tree := range treeList {
		for _, tpr := range tList {
			dense, err := sparse.NewDenseWith(dev, heads, sparse.DenseOptions{ThreadsPerRow: tpr, TreeReduce: tree != 0})
			if err != nil {
				return err
			}
			defer dense.Release()
			kernels = append(kernels, dense)
		}
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
		rows = append(rows, []string{fmt.Sprint(r.Tokens), fmt.Sprint(r.Batch), fmt.Sprintf("%d/%d", r.QHeads, r.KVHeads), fmt.Sprint(r.HeadDim), chunk, fmt.Sprint(r.TPR), map[bool]string{true: "tree", false: "subgroup"}[r.Tree],
			fmt.Sprintf("%.1f", r.MedianUs), fmt.Sprintf("%.1f", r.P10Us), fmt.Sprintf("%.1f", r.P90Us), fmt.Sprintf("%.1f", float64(r.KVBytes)/1e6), fmt.Sprintf("%.0f", r.GBps), errCol})
	}
	table(os.Stdout, []string{"tokens", "batch", "heads q/kv", "dim", "chunk", "tpr", "reduce", "median µs", "p10 µs", "p90 µs", "K+V MB", "GB/s", "rel err"}, rows)
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

// attnTime times one kernel variant over the caches for every chunk size.
func attnTime(dense *sparse.Dense, layers []*kvcache.Layer, q []float32, k0, v0 []uint16, chunks []int, warmup, reps int, check bool, prog *progress) ([]attnResult, error) {
	heads, n, batch := dense.Heads(), layers[0].Len(), len(layers)
	plan, err := dense.Plan(layers)
	if err != nil {
		return nil, err
	}
	defer plan.Release()
	defer func() { dense.ChunkTokens = 0 }()
	var out []attnResult
	for _, chunk := range chunks {
		prog.step(fmt.Sprintf("attn n=%d batch=%d chunk=%d tpr=%d", n, batch, chunk, dense.ThreadsPerRow()))
		dense.ChunkTokens = chunk
		r := attnResult{Tokens: n, Batch: batch, QHeads: heads.Query, KVHeads: heads.KV, HeadDim: heads.Dim, Chunk: chunk, TPR: dense.ThreadsPerRow(), Tree: dense.TreeReduce(), Reps: reps,
			KVBytes: uint64(batch) * uint64(n) * uint64(heads.KV*heads.Dim) * 4}
		if check {
			got, err := plan.Attend(q)
			if err != nil {
				return nil, err
			}
			want := sparse.AttendRef(heads, q[:heads.Query*heads.Dim], sparse.HalvesToFloat64(k0), sparse.HalvesToFloat64(v0), n, 1/math.Sqrt(float64(heads.Dim)))
			r.MaxRelErr, r.Checked = maxRelErr(want, got, heads.Dim), true
			if !(r.MaxRelErr < 1e-3) {
				return nil, fmt.Errorf("attention at n=%d differs from the reference: relative error %.3g", n, r.MaxRelErr)
			}
		} else if err := plan.SetQuery(q); err != nil {
			return nil, err
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

// maxRelErr returns the largest per-head ‖got − want‖/‖want‖.
func maxRelErr(want []float64, got []float32, dim int) float64 {
	worst := 0.0
	for h := 0; h*dim < len(want); h++ {
		var num, den float64
		for i := h * dim; i < (h+1)*dim; i++ {
			d := float64(got[i]) - want[i]
			num += d * d
			den += want[i] * want[i]
		}
		e := math.Sqrt(num / den)
		if math.IsNaN(e) {
			return math.Inf(1)
		}
		worst = math.Max(worst, e)
	}
	return worst
}
