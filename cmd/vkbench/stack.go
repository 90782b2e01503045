package main

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/vksparse/vksparse/decode"
	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/trace"
	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/workload"
)

// stackQueries is the most decode queries the generated layer holds;
// layer l attends query l mod stackQueries.
const stackQueries = 32

// Parts of a model under DELTA's layout.
const (
	partWarmup  = "warm-up"
	partRefresh = "Δ-layer"
	partReuse   = "reuse"
)

// stackLayer is one layer's row of `vkbench stack`: its attention alone
// (decode.Model.Time) under Dense and under DELTA.
type stackLayer struct {
	Layer      int     `json:"layer"`
	Policy     string  `json:"policy"` // under DELTA
	Part       string  `json:"part"`   // warm-up, Δ-layer or reuse
	DenseUs    float64 `json:"dense_us"`
	DenseP10Us float64 `json:"dense_p10_us"`
	DenseP90Us float64 `json:"dense_p90_us"`
	DeltaUs    float64 `json:"delta_us"`
	DeltaP10Us float64 `json:"delta_p10_us"`
	DeltaP90Us float64 `json:"delta_p90_us"`
	Attended   float64 `json:"delta_rows_per_kv_head"` // rows DELTA's layer reads per KV head
}

// stackTotal is one layout's attention per decoded token: every layer in
// one pass (decode.Model.TimeStack), and the sum of the layers alone.
type stackTotal struct {
	MedianUs   float64       `json:"median_us"`
	P10Us      float64       `json:"p10_us"`
	P90Us      float64       `json:"p90_us"`
	LayerSumUs float64       `json:"layer_sum_us"` // the per-layer medians, summed
	Bytes      uint64        `json:"bytes_per_token"`
	GBps       float64       `json:"gb_per_s"` // Bytes over MedianUs
	FloorUs    float64       `json:"floor_us"` // Bytes at the read probe's bandwidth
	Memory     decode.Memory `json:"memory"`   // device memory the model held
	PrefillS   float64       `json:"prefill_s"`
}

// stackParts divides DELTA's per-layer medians among the parts of its
// layout.
type stackParts struct {
	WarmupUs       float64 `json:"warmup_us"`        // the dense warm-up layers
	RefreshDenseUs float64 `json:"refresh_dense_us"` // the Δ-layers' dense passes: those layers' medians under Dense
	RefreshPickUs  float64 `json:"refresh_pick_us"`  // the rest of the Δ-layers' medians: page scoring and selection
	ReuseUs        float64 `json:"reuse_us"`         // the layers that reuse a pick
	ReuseLayers    int     `json:"reuse_layers"`
	// CapReuseFree is the dense layer sum over DELTA's without its reuse
	// layers: the most the ratio could reach if they cost nothing.
	CapReuseFree float64 `json:"cap_reuse_free"`
	// CapDenseOnly is the dense layer sum over the dense passes alone
	// (warm-up and Δ-layers): the most the layout allows.
	CapDenseOnly float64 `json:"cap_dense_passes_only"`
}

// stackReport is what `vkbench stack -json` writes under results.
type stackReport struct {
	Layers          int          `json:"layers"`
	QHeads          int          `json:"q_heads"`
	KVHeads         int          `json:"kv_heads"`
	HeadDim         int          `json:"head_dim"`
	Tokens          int          `json:"tokens"`
	Sequences       int          `json:"sequences"`
	Delta           sparse.Delta `json:"delta"`
	Seed            int64        `json:"seed"`
	Warmup          int          `json:"warmup_runs"`
	Reps            int          `json:"reps"`
	ReadGBps        float64      `json:"read_probe_gb_per_s"`
	ProbeBytes      uint64       `json:"read_probe_bytes"`
	DispatchFloorUs float64      `json:"dispatch_floor_us"`
	Dense           stackTotal   `json:"dense"`
	DELTA           stackTotal   `json:"delta_layout"`
	Ratio           float64      `json:"dense_over_delta"` // stack medians
	Target          float64      `json:"target"`
	Parts           stackParts   `json:"delta_parts"`
	Bound           string       `json:"bound"`
	PerLayer        []stackLayer `json:"per_layer"`
	Stages          []deltaStage `json:"delta_stages"` // each stage alone, on one layer
}

// stackRun is what one layout's model measured.
type stackRun struct {
	total    stackTotal
	layers   [][]time.Duration // per layer, sorted
	attended []float64         // per layer, rows read per KV head
}

func stack(args []string) error {
	fs := flag.NewFlagSet("stack", flag.ExitOnError)
	layers := fs.Int("layers", 32, "layers of the model")
	qHeads := fs.Int("heads", 32, "query heads")
	kvHeads := fs.Int("kv", 8, "KV heads")
	dim := fs.Int("dim", 128, "head dimension")
	tokens := fs.Int("tokens", 131072, "tokens of keys and values in every layer (one sequence)")
	deltaList := fs.String("delta", "2,12,22", "DELTA's Δ-layers (comma-separated, ascending); the first ends the dense warm-up")
	pages := fs.Int("pages", 64, "K: pages each DELTA layer attends (0: sparse.DefaultDelta's)")
	recent := fs.Int("recent", 8, "L: of them, the most recent pages, always taken (0: sparse.DefaultDelta's)")
	pageSize := fs.Int("page", 16, "tokens a page (0: sparse.DefaultDelta's)")
	runPages := fs.Int("run-pages", 0, "picked pages a workgroup of a reusing layer's attention takes (0: sparse.Delta's default)")
	warmup := fs.Int("warmup", 3, "untimed runs before the timed ones")
	reps := fs.Int("reps", 20, "timed runs of the stack and of each layer")
	target := fs.Float64("target", 4, "the dense/DELTA ratio the report compares with")
	seed := fs.Int64("seed", 1, "seed of the generated keys, values and queries")
	jsonPath := fs.String("json", "", "write the results as JSON to this file")
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), "usage: vkbench stack [flags]\n\nTimes the attention of one decoded token across a whole model, every layer\nholding the same generated keys and values (workload llama), under dense\nattention and under DELTA's layout, layer by layer and as one pass.\n\n")
		fs.PrintDefaults()
	}
	fs.Parse(args)
	if fs.NArg() > 0 {
		return fmt.Errorf("stack: unexpected arguments %q", fs.Args())
	}
	refresh, err := intsFrom(*deltaList, 0)
	if err != nil {
		return fmt.Errorf("-delta: %v", err)
	}
	switch {
	case *layers <= 0 || *tokens <= 0:
		return fmt.Errorf("-layers %d, -tokens %d: both must be positive", *layers, *tokens)
	case *reps <= 0 || *warmup < 0:
		return fmt.Errorf("-reps %d, -warmup %d: at least one timed run, no negative warm-up", *reps, *warmup)
	case *target <= 0:
		return fmt.Errorf("-target %v: must be positive", *target)
	}
	heads := sparse.Heads{Query: *qHeads, KV: *kvHeads, Dim: *dim}
	if err := heads.Validate(); err != nil {
		return err
	}
	opts := sparse.Delta{Warmup: refresh[0], Refresh: refresh, Pages: *pages, Recent: *recent, PageSize: *pageSize, RunPages: *runPages}
	resolved, err := opts.Resolve(*layers)
	if err != nil {
		return err
	}
	layout, err := decode.DeltaLayout(*layers, opts)
	if err != nil {
		return err
	}
	if *tokens <= resolved.PageSize {
		return fmt.Errorf("-tokens %d: DELTA needs more than a page of %d", *tokens, resolved.PageSize)
	}
	if err := checkOutputs(output{"json", *jsonPath}); err != nil {
		return err
	}

	prog := &progress{total: 1 + 2*(*layers+1)}
	defer prog.finish()
	prog.step(fmt.Sprintf("generating %d tokens of keys and values", *tokens))
	start := time.Now()
	cfg, err := workload.NamedConfig("llama", *tokens, heads.Query, heads.KV, heads.Dim)
	if err != nil {
		return err
	}
	cfg.Seed, cfg.Queries = *seed, min(*layers, stackQueries, *tokens)
	tr, err := workload.Generate(cfg)
	if err != nil {
		return err
	}
	genTook := time.Since(start)

	dev, err := openDevice()
	if err != nil {
		return err
	}
	defer dev.Release()
	readGBps, probeBytes, err := readBandwidth(dev, 5, 50)
	if err != nil {
		return err
	}
	floor, err := dispatchFloor(dev)
	if err != nil {
		return err
	}
	dense, err := runStack(dev, heads, tr, make([]decode.Policy, *layers), "dense", *warmup, *reps, prog)
	if err != nil {
		return fmt.Errorf("dense: %w", err)
	}
	delta, err := runStack(dev, heads, tr, layout, "DELTA", *warmup, *reps, prog)
	if err != nil {
		return fmt.Errorf("DELTA: %w", err)
	}
	prog.finish()

	rep := &stackReport{Layers: *layers, QHeads: heads.Query, KVHeads: heads.KV, HeadDim: heads.Dim, Tokens: *tokens, Sequences: 1,
		Delta: resolved, Seed: *seed, Warmup: *warmup, Reps: *reps, ReadGBps: readGBps, ProbeBytes: probeBytes, DispatchFloorUs: floor, Target: *target}
	rep.fill(layout, dense, delta)
	if rep.Stages, err = deltaStages(dev, heads, tr, resolved, *warmup, *reps); err != nil {
		return fmt.Errorf("DELTA's stages: %w", err)
	}
	fmt.Printf("keys, values and %d queries generated in %.1f s; prefill %.1f s (dense), %.1f s (DELTA)\n", tr.Queries(), genTook.Seconds(), dense.total.PrefillS, delta.total.PrefillS)
	printStack(rep)
	printDeltaStages(rep.Stages)
	if *jsonPath != "" {
		return writeJSON(*jsonPath, "vkbench stack "+strings.Join(args, " "), dev.Info(), rep)
	}
	return nil
}

// runStack builds a model of one sequence under layout, prefills every
// layer with the trace's keys and values, attends every layer once in
// order (layer l the trace's query l mod its queries), sets the same
// queries again (a sparse layer divides its attention by the step that
// ran), and times the whole stack (Model.TimeStack) and each layer alone
// (Model.Time).
func runStack(dev *vk.Device, heads sparse.Heads, tr *trace.Trace, layout []decode.Policy, name string, warmup, reps int, prog *progress) (run *stackRun, err error) {
	L := len(layout)
	m, err := decode.New(dev, decode.Config{Heads: heads, Layers: L, Slots: 1, Capacity: tr.Tokens, Layout: layout, Fallback: decode.FallbackNever})
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, m.Release()) }()
	start := time.Now()
	for l := range L {
		prog.step(fmt.Sprintf("%s: prefill of layer %d of %d (%d tokens)", name, l+1, L, tr.Tokens))
		if err := m.Prefill(0, l, tr.K, tr.V, tr.Tokens); err != nil {
			return nil, err
		}
	}
	run = &stackRun{layers: make([][]time.Duration, L), attended: make([]float64, L)}
	run.total.PrefillS = time.Since(start).Seconds()
	prog.step(fmt.Sprintf("%s: timing %d layers", name, L))
	query := func(l int) []float32 { return tr.Query(l % tr.Queries()) }
	for l := range L {
		if _, err := m.Attend(l, query(l)); err != nil {
			return nil, err
		}
	}
	for l := range L {
		if err := m.SetQuery(l, query(l)); err != nil {
			return nil, err
		}
	}
	// Keep the GPU busy a while first, so its clocks have risen.
	for spin := time.Now(); time.Since(spin) < 300*time.Millisecond; {
		if _, err := m.TimeStack(0, 3); err != nil {
			return nil, err
		}
	}
	times, err := m.TimeStack(warmup, reps)
	if err != nil {
		return nil, err
	}
	t := &run.total
	t.MedianUs, t.P10Us, t.P90Us = quantilesUs(times)
	for l := range L {
		if run.layers[l], err = m.Time(l, warmup, reps); err != nil {
			return nil, err
		}
		att, err := m.Attended(l)
		if err != nil {
			return nil, err
		}
		run.attended[l] = att[0]
	}
	if t.Memory, err = m.Memory(); err != nil {
		return nil, err
	}
	return run, nil
}

// quantilesUs returns the median, 10th and 90th percentiles of sorted
// times in µs.
func quantilesUs(times []time.Duration) (median, p10, p90 float64) {
	us := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }
	n := len(times)
	return us(times[n/2]), us(times[n/10]), us(times[n*9/10])
}

// fill computes the report's rows, totals, parts and bound from the runs.
func (r *stackReport) fill(layout []decode.Policy, dense, delta *stackRun) {
	row := uint64(r.KVHeads*r.HeadDim) * 2 // one token's keys (or values) of every KV head, fp16
	r.Dense, r.DELTA = dense.total, delta.total
	p := &r.Parts
	for l, pol := range layout {
		s := stackLayer{Layer: l, Policy: pol.String(), Attended: delta.attended[l]}
		s.DenseUs, s.DenseP10Us, s.DenseP90Us = quantilesUs(dense.layers[l])
		s.DeltaUs, s.DeltaP10Us, s.DeltaP90Us = quantilesUs(delta.layers[l])
		r.Dense.LayerSumUs += s.DenseUs
		r.DELTA.LayerSumUs += s.DeltaUs
		r.Dense.Bytes += 2 * row * uint64(dense.attended[l])
		r.DELTA.Bytes += 2 * row * uint64(delta.attended[l])
		switch {
		case l < r.Delta.Warmup:
			s.Part = partWarmup
			p.WarmupUs += s.DeltaUs
		case isRefresh(r.Delta, l):
			s.Part = partRefresh
			p.RefreshDenseUs += s.DenseUs
			p.RefreshPickUs += s.DeltaUs - s.DenseUs
			// The page scores read the layer's keys a second time.
			r.DELTA.Bytes += row * uint64(r.Tokens)
		default:
			s.Part = partReuse
			p.ReuseUs += s.DeltaUs
			p.ReuseLayers++
		}
		r.PerLayer = append(r.PerLayer, s)
	}
	for _, t := range []*stackTotal{&r.Dense, &r.DELTA} {
		t.GBps = float64(t.Bytes) / (t.MedianUs * 1e3)
		t.FloorUs = float64(t.Bytes) / (r.ReadGBps * 1e3)
	}
	r.Ratio = r.Dense.MedianUs / r.DELTA.MedianUs
	p.CapReuseFree = r.Dense.LayerSumUs / (p.WarmupUs + p.RefreshDenseUs + p.RefreshPickUs)
	p.CapDenseOnly = r.Dense.LayerSumUs / (p.WarmupUs + p.RefreshDenseUs)
	r.Bound = r.bound()
}

// isRefresh reports whether layer l is one of d's Δ-layers.
func isRefresh(d sparse.Delta, l int) bool {
	for _, x := range d.Refresh {
		if x == l {
			return true
		}
	}
	return false
}

// bound says which part of DELTA's layout takes the most of its time per
// token, by the per-layer medians, and what the ratio could reach without
// the other parts.
func (r *stackReport) bound() string {
	p := r.Parts
	parts := []struct {
		name string
		us   float64
	}{
		{fmt.Sprintf("the %d dense warm-up layers", r.Delta.Warmup), p.WarmupUs},
		{fmt.Sprintf("the dense passes of the %d Δ-layers", len(r.Delta.Refresh)), p.RefreshDenseUs},
		{"the Δ-layers' page scoring and selection", p.RefreshPickUs},
		{fmt.Sprintf("the %d reuse layers", p.ReuseLayers), p.ReuseUs},
	}
	top := 0
	for i := range parts {
		if parts[i].us > parts[top].us {
			top = i
		}
	}
	sum := r.DELTA.LayerSumUs
	met := "meets"
	if r.Ratio < r.Target {
		met = "misses"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "dense/DELTA %.2f× as one pass of every layer (stack medians %.1f / %.1f µs per token) %s the target of %g×; summed over the layers (per-layer medians %.1f / %.1f µs) %.2f×. ",
		r.Ratio, r.Dense.MedianUs, r.DELTA.MedianUs, met, r.Target, r.Dense.LayerSumUs, sum, r.Dense.LayerSumUs/sum)
	fmt.Fprintf(&b, "Of DELTA's %.1f µs (per-layer medians summed), %s take the most: %.1f µs (%.0f %%)", sum, parts[top].name, parts[top].us, 100*parts[top].us/sum)
	for i, q := range parts {
		if i != top {
			fmt.Fprintf(&b, "; %s %.1f µs (%.0f %%)", q.name, q.us, 100*q.us/sum)
		}
	}
	fmt.Fprintf(&b, ". With the reuse layers free the ratio could reach %.2f×, with the page scoring and selection free too %.2f× (the dense passes alone).", p.CapReuseFree, p.CapDenseOnly)
	return b.String()
}

// printStack prints the per-layer table, the totals and the bound.
func printStack(r *stackReport) {
	fmt.Printf("%d layers, heads %d/%d, dim %d, 1 sequence of %d tokens; DELTA: Δ-layers %v (warm-up %d), K = %d pages of %d, L = %d; median of %d runs after %d\n",
		r.Layers, r.QHeads, r.KVHeads, r.HeadDim, r.Tokens, r.Delta.Refresh, r.Delta.Warmup, r.Delta.Pages, r.Delta.PageSize, r.Delta.Recent, r.Reps, r.Warmup)
	var rows [][]string
	for _, s := range r.PerLayer {
		rows = append(rows, []string{fmt.Sprint(s.Layer), s.Part, s.Policy, fmt.Sprintf("%.1f", s.DenseUs), fmt.Sprintf("%.1f", s.DeltaUs), fmt.Sprintf("%.0f", s.Attended)})
	}
	table(os.Stdout, []string{"layer", "part", "DELTA policy", "dense µs", "DELTA µs", "DELTA rows/KV head"}, rows)
	fmt.Println()
	rows = nil
	for _, t := range []struct {
		name string
		t    stackTotal
	}{{"dense", r.Dense}, {"DELTA", r.DELTA}} {
		rows = append(rows, []string{t.name, fmt.Sprintf("%.1f", t.t.MedianUs), fmt.Sprintf("%.1f", t.t.P10Us), fmt.Sprintf("%.1f", t.t.P90Us), fmt.Sprintf("%.1f", t.t.LayerSumUs),
			fmt.Sprintf("%.1f", float64(t.t.Bytes)/1e6), fmt.Sprintf("%.1f", t.t.GBps), fmt.Sprintf("%.1f", t.t.FloorUs), mib(t.t.Memory.Caches + t.t.Memory.Other)})
	}
	table(os.Stdout, []string{"per token", "stack µs", "p10 µs", "p90 µs", "layers' sum µs", "MB read", "GB/s", "floor µs", "device memory"}, rows)
	p := r.Parts
	fmt.Printf("\nDELTA by part (per-layer medians): warm-up %.1f µs, Δ-layers %.1f µs (dense passes %.1f, page scoring and selection %.1f), reuse layers %.1f µs (%d, %.1f µs each)\n",
		p.WarmupUs, p.RefreshDenseUs+p.RefreshPickUs, p.RefreshDenseUs, p.RefreshPickUs, p.ReuseUs, p.ReuseLayers, p.ReuseUs/float64(max(p.ReuseLayers, 1)))
	fmt.Printf("floors: read probe %.0f GB/s over %d MiB (floor µs = MB read at that rate); %.2f µs per dependent dispatch\n", r.ReadGBps, r.ProbeBytes>>20, r.DispatchFloorUs)
	fmt.Printf("bound: %s\n", r.Bound)
}

// readBandwidth returns the device's read bandwidth in GB/s: the median of
// reps runs, after warmup, of the read probe over a buffer of up to 1 GiB
// (the device's storage-buffer range and allocation limits), and the
// bytes it read.
func readBandwidth(dev *vk.Device, warmup, reps int) (float64, uint64, error) {
	info := dev.Info()
	bytes := min(uint64(1)<<30, info.MaxStorageBufferRange, info.MaxAllocation) &^ (1<<20 - 1)
	if bytes == 0 {
		return 0, 0, fmt.Errorf("the device's storage-buffer range (%d bytes) holds no MiB to probe", info.MaxStorageBufferRange)
	}
	pipe, err := readProbe(dev)
	if err != nil {
		return 0, 0, err
	}
	defer pipe.Release()
	const groups = 4096
	src, err := dev.NewBuffer(bytes, vk.DeviceLocal)
	if err != nil {
		return 0, 0, err
	}
	defer src.Release()
	dst, err := dev.NewBuffer(groups*256*4, vk.DeviceLocal)
	if err != nil {
		return 0, 0, err
	}
	defer dst.Release()
	bind, err := pipe.Bind(src.All(), dst.All())
	if err != nil {
		return 0, 0, err
	}
	defer bind.Release()
	cmd, err := dev.NewCommands()
	if err != nil {
		return 0, 0, err
	}
	defer cmd.Release()
	times, err := chainTimes(dev, cmd, pipe, bind, []uint32{uint32(bytes / 16)}, 1, groups, false, warmup, reps)
	if err != nil {
		return 0, 0, err
	}
	median, _, _ := quantilesUs(times)
	return float64(bytes) / (median * 1e3), bytes, nil
}
