package main

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"

	"github.com/vksparse/vksparse/decode"
	"github.com/vksparse/vksparse/lm"
	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/vk"
)

// defaultLayouts is every policy over all layers and over layers 2–5
// (layers 0 and 1 of the project's model are diffuse), fixed budgets
// matched to Tactic's; DELTA and LuKA at the papers' budgets and matched
// to Tactic's.
const defaultLayouts = "tactic:0.9; tactic:0.9@2-5; tactic:0.9/curve; tactic:0.9/curve@2-5; doublep:0.95/0.7; doublep:0.95/0.7@2-5; oracle:0.9; oracle:0.9@2-5; " +
	"quest:tactic; quest:tactic@2-5; streaming:tactic; streaming:tactic@2-5; h2o:tactic; h2o:tactic@2-5; " +
	"delta:64/8@2; delta:64/8@2,4; delta:16/4@2,4; delta:tactic/8@2; " +
	"luka; luka@2-5; luka:mixed; luka:tactic; luka:tactic@2-5; luka:logsize; luka:logsize/tactic; luka:logsize/tactic@2-5"

// generateLayer is one layer's figures under a layout.
type generateLayer struct {
	Policy      string  `json:"policy"`
	TokensPct   float64 `json:"tokens_pct"`  // rows attended per KV head, mean over steps, % of the stored tokens
	AttendUs    float64 `json:"attend_us"`   // GPU time of the layer's attention, median
	DenseUs     float64 `json:"dense_us"`    // the same under dense attention
	FloorUs     float64 `json:"floor_us"`    // the device's floor: one dependent dispatch per stage, median of empty dispatches
	Attended    float64 `json:"attended"`    // rows attended per KV head, mean over steps
	KVBytesGBps float64 `json:"kv_gb_per_s"` // K and V bytes of the attended rows over AttendUs
	Stored      float64 `json:"stored_mean"` // tokens stored, mean over steps
	BudgetGiven int     `json:"budget,omitempty"`
}

// generateResult is one layout's costs to the model.
type generateResult struct {
	Layout       string          `json:"layout"`
	SparseLayers int             `json:"sparse_layers"`
	TokensPct    float64         `json:"tokens_pct"` // mean over the sparse layers
	AttendUs     float64         `json:"attend_us_per_token"`
	DenseUs      float64         `json:"dense_attend_us_per_token"`
	Costs        lm.Costs        `json:"costs"`
	Layers       []generateLayer `json:"layers"`
}

// generateReport is what -json writes.
type generateReport struct {
	Document  string           `json:"document"`
	Prefill   int              `json:"prefill_bytes"`
	PrefillS  float64          `json:"prefill_seconds"`
	Positions int              `json:"positions"`
	DenseBPB  float64          `json:"dense_bits_per_byte"`
	Results   []generateResult `json:"results"`
}

func generate(args []string) error {
	fs := flag.NewFlagSet("generate", flag.ExitOnError)
	weights := fs.String("weights", "testdata/model/model-int8.safetensors", "the model's int8 safetensors weights")
	docPath := fs.String("doc", "testdata/model/serve_test_16k.txt", "the document: prefilled, then teacher-forced")
	prefill := fs.Int("prefill", 16128, "bytes of the document prefilled with dense attention")
	positions := fs.Int("positions", 256, "positions after the prefill decoded under each layout, teacher-forced on the document's bytes")
	layoutList := fs.String("layouts", defaultLayouts, "layouts separated by ';': POLICY[:ARGS][@LAYERS] (dense, tactic:P or tactic:P/curve, doublep:P1/P2, oracle:P, cluster-oracle:P, quest|streaming|h2o:BUDGET|tactic|doublep, delta:K/L@Δ-LAYERS, luka:OPT/OPT…; LAYERS all, a-b or a,b,c)")
	reps := fs.Int("reps", 50, "timed runs of each layer's attention at the last position (median reported)")
	whole := fs.Bool("whole", false, "only prefill the whole document densely: bits per byte and the prefill's time")
	calibrate := fs.Int("calibrate", 0, "only DELTA's calibration: the attention shift of consecutive layers over the document's first N bytes (on the CPU, at its last 16 positions), and the Δ-layers it proposes")
	warmup := fs.Int("warmup", 2, "with -calibrate: DELTA's warm-up depth")
	prompt := fs.String("prompt", "", "generate greedily from this prompt instead (with -n and -layout)")
	count := fs.Int("n", 200, "bytes to generate with -prompt")
	layout := fs.String("layout", "dense", "the layout -prompt generates under")
	jsonPath := fs.String("json", "", "write the results as JSON to this file")
	plotPath := fs.String("plot", "", "draw KL against tokens attended, a point per layout, into this PNG")
	fs.Parse(args)
	if err := checkOutputs(output{"json", *jsonPath}, output{"plot", *plotPath}); err != nil {
		return err
	}

	w, err := lm.LoadWeights(*weights)
	if err != nil {
		return err
	}
	if *calibrate > 0 {
		return calibrateDelta(w, *docPath, *calibrate, *warmup, *jsonPath, "vkbench generate "+strings.Join(args, " "))
	}
	dev, err := openDevice()
	if err != nil {
		return err
	}
	defer dev.Release()
	if *prompt != "" {
		return greedy(dev, w, []byte(*prompt), *count, *layout)
	}
	doc, err := os.ReadFile(*docPath)
	if err != nil {
		return err
	}
	if *whole {
		res, err := wholeDocument(dev, w, doc)
		if err == nil && *jsonPath != "" {
			err = writeJSON(*jsonPath, "vkbench generate "+strings.Join(args, " "), dev.Info(), res)
		}
		return err
	}
	switch {
	case *prefill <= 0 || *positions <= 0 || *prefill+*positions > len(doc):
		return fmt.Errorf("a prefill of %d bytes and %d positions in a document of %d", *prefill, *positions, len(doc))
	case *reps <= 0:
		return fmt.Errorf("-reps %d: at least one timed run", *reps)
	}
	specs, err := parseLayouts(*layoutList, w.Config.Layers)
	if err != nil {
		return err
	}
	rep, err := compareLayouts(dev, w, doc, *prefill, *positions, *reps, specs)
	if err != nil {
		return err
	}
	printGenerate(rep)
	info := dev.Info()
	if *jsonPath != "" {
		if err := writeJSON(*jsonPath, "vkbench generate "+strings.Join(args, " "), info, rep); err != nil {
			return err
		}
	}
	if *plotPath != "" {
		return plotGenerate(*plotPath, rep)
	}
	return nil
}

// modelConfig is a decode.Config for the weights' geometry, one slot of
// capacity tokens, with a policy per layer, each always run (never the
// dense fallback: its cost to the output is what is measured).
func modelConfig(w *lm.Weights, capacity int, layout []decode.Policy) decode.Config {
	c := w.Config
	return decode.Config{Heads: sparse.Heads{Query: c.Heads, KV: c.KVHeads, Dim: c.HeadDim}, Layers: c.Layers, Slots: 1, Capacity: capacity, Layout: layout, Fallback: decode.FallbackNever}
}

// wholeResult is what -whole measures.
type wholeResult struct {
	Bytes       int             `json:"bytes"`
	BitsPerByte float64         `json:"bits_per_byte"`
	PrefillS    float64         `json:"prefill_seconds"`
	Times       lm.PrefillTimes `json:"prefill_parts_ns"`
}

// wholeDocument prefills the whole document densely and prints its bits
// per byte and the prefill's wall time.
func wholeDocument(dev *vk.Device, w *lm.Weights, doc []byte) (*wholeResult, error) {
	m, err := decode.New(dev, modelConfig(w, len(doc), nil))
	if err != nil {
		return nil, err
	}
	defer m.Release()
	r, err := lm.NewRunner(dev, w, m, lm.Options{})
	if err != nil {
		return nil, err
	}
	defer r.Release()
	start := time.Now()
	logits, err := r.Prefill(0, doc)
	if err != nil {
		return nil, err
	}
	took := time.Since(start)
	next := make([]int, len(doc))
	for i := range next {
		next[i] = -1
		if i+1 < len(doc) {
			next[i] = int(doc[i+1])
		}
	}
	bpb, err := lm.BitsPerByte(logits, w.Config.Vocab, next)
	if err != nil {
		return nil, err
	}
	pt := r.LastPrefillTimes()
	fmt.Printf("whole document: %d bytes, bits per byte %.6f (dense attention), prefill %.2f s (%.0f bytes/s): GPU attention %.2f s, causal blocks %.2f s, scratch writes %.2f s, the rest (projections, MLP, head) %.2f s\n",
		len(doc), bpb, took.Seconds(), float64(len(doc))/took.Seconds(), pt.GPU.Seconds(), pt.Block.Seconds(), pt.Store.Seconds(), (pt.Total - pt.GPU - pt.Block - pt.Store).Seconds())
	return &wholeResult{Bytes: len(doc), BitsPerByte: bpb, PrefillS: took.Seconds(), Times: pt}, nil
}

// greedy prefills prompt and prints the n bytes the model picks greedily
// under the layout.
func greedy(dev *vk.Device, w *lm.Weights, prompt []byte, n int, layout string) error {
	specs, err := parseLayouts(layout, w.Config.Layers)
	if err != nil {
		return err
	}
	if len(specs) != 1 || specs[0].BudgetFrom != "" {
		return fmt.Errorf("-layout: one layout with its budget given")
	}
	m, err := decode.New(dev, modelConfig(w, len(prompt)+n+1, specs[0].policies(nil, w.Config.Heads/w.Config.KVHeads)))
	if err != nil {
		return err
	}
	defer m.Release()
	r, err := lm.NewRunner(dev, w, m, lm.Options{})
	if err != nil {
		return err
	}
	defer r.Release()
	logits, err := r.Prefill(0, prompt)
	if err != nil {
		return err
	}
	v := w.Config.Vocab
	last := logits[len(logits)-v:]
	fmt.Printf("%s", prompt)
	for range n {
		b := byte(lm.Argmax(last))
		fmt.Printf("%c", b)
		if last, err = r.Step([]byte{b}); err != nil {
			return err
		}
	}
	fmt.Println()
	return nil
}

// layoutRun is what one layout's decode left: the logits of every
// position, the rows each layer attended and the layers' times.
type layoutRun struct {
	logits   []float32
	attended []float64 // per layer, mean over steps
	stored   []float64
	times    []float64 // per layer, µs
}

// runLayout decodes positions bytes of doc after the prompt under the
// layout, teacher-forced, and times every layer's attention at the last.
func runLayout(dev *vk.Device, w *lm.Weights, pr *lm.Prompt, doc []byte, positions, reps int, layout []decode.Policy, prog *progress, name string) (*layoutRun, error) {
	m, err := decode.New(dev, modelConfig(w, pr.Len()+positions, layout))
	if err != nil {
		return nil, err
	}
	defer m.Release()
	// The prompt comes encoded: this runner only stores and steps.
	r, err := lm.NewRunner(dev, w, m, lm.Options{CPUPrefill: true})
	if err != nil {
		return nil, err
	}
	defer r.Release()
	if err := r.Store(0, pr); err != nil {
		return nil, err
	}
	L := w.Config.Layers
	run := &layoutRun{attended: make([]float64, L), stored: make([]float64, L), times: make([]float64, L)}
	for i := range positions {
		logits, err := r.Step([]byte{doc[pr.Len()+i]})
		if err != nil {
			return nil, fmt.Errorf("position %d: %w", pr.Len()+i, err)
		}
		run.logits = append(run.logits, logits...)
		for l := range L {
			att, err := m.Attended(l)
			if err != nil {
				return nil, err
			}
			run.attended[l] += att[0] / float64(positions)
			run.stored[l] += float64(m.Len(0, l)) / float64(positions)
		}
		if i%16 == 0 {
			prog.step(fmt.Sprintf("%s: position %d of %d", name, i, positions))
		}
	}
	for l := range L {
		d, err := m.Time(l, 5, reps)
		if err != nil {
			return nil, err
		}
		run.times[l] = float64(d[len(d)/2].Nanoseconds()) / 1e3
	}
	return run, nil
}

// compareLayouts prefills the document's first prefill bytes densely once,
// decodes the next positions under dense attention and under each layout,
// and returns each layout's costs beside dense.
func compareLayouts(dev *vk.Device, w *lm.Weights, doc []byte, prefill, positions, reps int, specs []layoutSpec) (*generateReport, error) {
	L := w.Config.Layers
	denseModel, err := decode.New(dev, modelConfig(w, prefill+positions, nil))
	if err != nil {
		return nil, err
	}
	runner, err := lm.NewRunner(dev, w, denseModel, lm.Options{})
	if err != nil {
		return nil, errors.Join(err, denseModel.Release())
	}
	start := time.Now()
	pr, err := runner.Encode(doc[:prefill])
	took := time.Since(start)
	err = errors.Join(err, runner.Release(), denseModel.Release())
	if err != nil {
		return nil, err
	}
	fmt.Printf("prefill: %d bytes in %.2f s (dense attention)\n", prefill, took.Seconds())
	next := make([]int, positions)
	for i := range next {
		next[i] = -1
		if p := prefill + i + 1; p < len(doc) {
			next[i] = int(doc[p])
		}
	}
	prog := &progress{total: (len(specs) + 1) * positions / 16}
	defer prog.finish()
	dense, err := runLayout(dev, w, pr, doc, positions, reps, make([]decode.Policy, L), prog, "dense")
	if err != nil {
		return nil, fmt.Errorf("dense: %w", err)
	}
	denseCosts, err := lm.CompareLogits(dense.logits, dense.logits, w.Config.Vocab, next)
	if err != nil {
		return nil, err
	}
	floor, err := dispatchFloor(dev)
	if err != nil {
		return nil, err
	}
	rep := &generateReport{Prefill: prefill, PrefillS: took.Seconds(), Positions: positions, DenseBPB: denseCosts.BitsPerByte}
	runs := map[string]*layoutRun{} // "tactic@all" → its run, for matched budgets
	for _, s := range specs {
		budgets := make([]int, L)
		if s.BudgetFrom != "" {
			src, ok := runs[s.BudgetFrom+"@"+s.matchSpec()]
			if !ok {
				return nil, fmt.Errorf("layout %s: no %s layout over layers %s before it to match", s.Name, s.BudgetFrom, s.matchSpec())
			}
			for l := range budgets {
				budgets[l] = int(src.attended[l]+0.5) - sparse.BaselineSinks - sparse.BaselineWindow
			}
		}
		s.Tokens = prefill
		layout := s.policies(budgets, w.Config.Heads/w.Config.KVHeads)
		run, err := runLayout(dev, w, pr, doc, positions, reps, layout, prog, s.Name)
		if err != nil {
			return nil, fmt.Errorf("layout %s: %w", s.Name, err)
		}
		if _, ok := runs[s.Policy+"@"+s.LayerSpec]; !ok {
			runs[s.Policy+"@"+s.LayerSpec] = run
		}
		costs, err := lm.CompareLogits(dense.logits, run.logits, w.Config.Vocab, next)
		if err != nil {
			return nil, err
		}
		res := generateResult{Layout: s.Name, SparseLayers: s.sparseLayers(), Costs: costs}
		c := w.Config
		for l := range L {
			gl := generateLayer{Policy: layout[l].String(), Attended: run.attended[l], Stored: run.stored[l],
				TokensPct: 100 * run.attended[l] / run.stored[l], AttendUs: run.times[l], DenseUs: dense.times[l], FloorUs: floor,
				KVBytesGBps: run.attended[l] * float64(c.KVHeads*c.HeadDim*2*2) / (run.times[l] * 1e3)}
			if layout[l].Budget() > 0 {
				gl.BudgetGiven = layout[l].Budget()
			}
			res.Layers = append(res.Layers, gl)
			res.AttendUs += run.times[l]
			res.DenseUs += dense.times[l]
			if !layout[l].IsDense() {
				res.TokensPct += gl.TokensPct / float64(res.SparseLayers)
			}
		}
		rep.Results = append(rep.Results, res)
	}
	return rep, nil
}

// dispatchFloor is the device's floor per dependent dispatch in µs: the
// median, over 100 runs, of a chain of 8 dispatches of one workgroup that
// each read 4 KiB (read_probe) with a compute barrier between, divided by
// 8 (vkbench probe -chain measures the same at any size).
func dispatchFloor(dev *vk.Device) (float64, error) {
	pipe, err := readProbe(dev)
	if err != nil {
		return 0, err
	}
	defer pipe.Release()
	src, err := dev.NewBuffer(4096, vk.DeviceLocal)
	if err != nil {
		return 0, err
	}
	defer src.Release()
	dst, err := dev.NewBuffer(256*4, vk.DeviceLocal)
	if err != nil {
		return 0, err
	}
	defer dst.Release()
	bind, err := pipe.Bind(src.All(), dst.All())
	if err != nil {
		return 0, err
	}
	defer bind.Release()
	cmd, err := dev.NewCommands()
	if err != nil {
		return 0, err
	}
	defer cmd.Release()
	const chain = 8
	times, err := chainTimes(dev, cmd, pipe, bind, []uint32{4096 / 16}, chain, 1, false, 5, 100)
	if err != nil {
		return 0, err
	}
	return float64(times[len(times)/2].Nanoseconds()) / 1e3 / chain, nil
}

// printGenerate prints the layouts' costs as one aligned table.
func printGenerate(rep *generateReport) {
	fmt.Printf("%d positions after a prefill of %d bytes; dense: %.4f bits per byte\n", rep.Positions, rep.Prefill, rep.DenseBPB)
	rows := [][]string{}
	for _, r := range rep.Results {
		c := r.Costs
		rows = append(rows, []string{r.Layout, fmt.Sprint(r.SparseLayers), fmt.Sprintf("%.1f %%", r.TokensPct),
			fmt.Sprintf("%.4f", c.BitsPerByte), fmt.Sprintf("%+.4f", c.BitsPerByte-c.DenseBitsPerByte),
			fmt.Sprintf("%.4f", c.KLMean), fmt.Sprintf("%.4f", c.KLP99), fmt.Sprintf("%.1f %%", 100*c.Top1),
			fmt.Sprintf("%.3f", c.Acceptance), fmt.Sprintf("%.1f", r.AttendUs), fmt.Sprintf("%.1f", r.DenseUs)})
	}
	table(os.Stdout, []string{"layout", "sparse layers", "tokens", "bits/byte", "Δ", "KL mean", "KL p99", "top-1", "acceptance", "attn µs/token", "dense µs"}, rows)
}

// plotGenerate draws each layout's mean KL against the tokens it attended.
func plotGenerate(path string, rep *generateReport) error {
	p := plot.New()
	p.Title.Text = fmt.Sprintf("what each policy costs the model (%d positions after %d bytes)", rep.Positions, rep.Prefill)
	p.X.Label.Text, p.Y.Label.Text = "tokens attended in the sparse layers (% of N)", "mean KL(dense ‖ policy), nats"
	var xys plotter.XYs
	var labels []string
	for _, r := range rep.Results {
		xys = append(xys, plotter.XY{X: r.TokensPct, Y: r.Costs.KLMean})
		labels = append(labels, r.Layout)
	}
	sc, err := plotter.NewScatter(xys)
	if err != nil {
		return err
	}
	lb, err := plotter.NewLabels(plotter.XYLabels{XYs: xys, Labels: labels})
	if err != nil {
		return err
	}
	p.Add(sc, lb, plotter.NewGrid())
	return savePanels(path, []*plot.Plot{p}, 9*vg.Inch, 6*vg.Inch)
}

// calibration is what -calibrate measures.
type calibration struct {
	Bytes     int       `json:"bytes"`
	Positions []int     `json:"positions"`
	Shifts    []float64 `json:"shifts"` // layers (l, l+1)
	Warmup    int       `json:"warmup"`
	Refresh   []int     `json:"refresh"`
}

// calibrateDelta prints the attention shift of every pair of consecutive
// layers over the document's first n bytes and the Δ-layers it proposes.
func calibrateDelta(w *lm.Weights, docPath string, n, warmup int, jsonPath, command string) error {
	doc, err := os.ReadFile(docPath)
	if err != nil {
		return err
	}
	if n > len(doc) {
		return fmt.Errorf("-calibrate %d: the document holds %d bytes", n, len(doc))
	}
	var positions []int
	for p := max(0, n-16); p < n; p++ {
		positions = append(positions, p)
	}
	shifts, err := w.AttentionShifts(doc[:n], positions)
	if err != nil {
		return err
	}
	refresh, err := lm.ProposeRefresh(shifts, warmup)
	if err != nil {
		return err
	}
	var rows [][]string
	for l, s := range shifts {
		rows = append(rows, []string{fmt.Sprintf("%d → %d", l, l+1), fmt.Sprintf("%.4f", s)})
	}
	fmt.Printf("attention shift 1 − cos of consecutive layers, %d bytes, mean over the last %d positions and every head:\n", n, len(positions))
	table(os.Stdout, []string{"layers", "shift"}, rows)
	fmt.Printf("proposed Δ-layers (warm-up %d): %v\n", warmup, refresh)
	if jsonPath != "" {
		return writeJSON(jsonPath, command, vk.Info{}, calibration{Bytes: n, Positions: positions, Shifts: shifts, Warmup: warmup, Refresh: refresh})
	}
	return nil
}
