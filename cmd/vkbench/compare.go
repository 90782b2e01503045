package main

import (
	"cmp"
	"flag"
	"fmt"
	"io"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/vksparse/vksparse/decode"
	"github.com/vksparse/vksparse/evaluate"
	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/trace"
	"github.com/vksparse/vksparse/vk"
)

// compareRow is one row of `vkbench compare`'s GPU table.
type compareRow struct {
	Source string `json:"source"`
	evaluate.StepRun
	// DenseChoice is how a decode.Model layer under the policy would attend
	// this layer (denseChoices): "dense", "policy", "dense k/B" where k of
	// a batch's B sequences fall back, or "-" for a policy that never falls
	// back; PricedBy says by which cost models ("measured": the policy's
	// and dense attention's own, decode.MeasureSteps; "device": the
	// device's, sparse.Calibrate).
	DenseChoice string `json:"dense_choice"`
	PricedBy    string `json:"priced_by,omitempty"`
	// StepModelUs is each sequence's step priced by the policy's cost
	// model, DenseModelUs dense attention priced by its own: what the
	// choice weighed.
	StepModelUs  []float64 `json:"step_model_us,omitempty"`
	DenseModelUs float64   `json:"dense_model_us,omitempty"`
	// StepCosts are the measured runs and models that priced them, where
	// PricedBy is "measured".
	StepCosts *decode.StepCosts `json:"step_costs,omitempty"`
}

// fallbackPolicies maps the names of compare's policies that fall back
// to dense attention to the decode policies they stand for.
type fallbackPolicies func(name string, budget int) (decode.Policy, bool)

// compareFallbacks returns the decode policies of evaluate's default
// policies at the targets ps, clustered with opts (Double-P at its
// default targets only).
func compareFallbacks(ps []float64, opts sparse.TacticDecoderOptions) fallbackPolicies {
	curve := opts
	curve.Fit = sparse.TacticCurveFit()
	return func(name string, budget int) (decode.Policy, bool) {
		switch name {
		case "double-p":
			return decode.DoubleP(sparse.DefaultDoubleP(), opts), true
		case "quest":
			return decode.Quest(budget), true
		case "streaming":
			return decode.StreamingLLM(budget), true
		case "h2o":
			return decode.H2O(budget), true
		}
		for _, p := range ps {
			switch name {
			case fmt.Sprintf("tactic P=%v", p):
				return decode.Tactic(p, opts), true
			case fmt.Sprintf("tactic curve P=%v", p):
				return decode.Tactic(p, curve), true
			}
		}
		return decode.Policy{}, false
	}
}

// denseChoices fills each row's DenseChoice the way decode.Model chooses
// under FallbackAuto with its choices priced for the row's batch
// (decode.Config.PriceBatch): a sequence is attended densely where its
// step's cost (evaluate.StepRun.Costs, the library's count) exceeds dense
// attention's, priced on a GPU by the policy's and dense attention's
// measured cost models at the layer's geometry and batch
// (decode.MeasureSteps, as a model of the row's tokens measures them),
// and elsewhere, or for a policy decode does not know, by the device's
// calibrated cost model (sparse.Calibrate), its floor shared by the
// batch. It returns the device's cost model.
func denseChoices(dev *vk.Device, rows []compareRow, heads map[string]sparse.Heads, policies fallbackPolicies) (*sparse.CostModel, error) {
	var model *sparse.CostModel
	for i := range rows {
		r := &rows[i]
		r.DenseChoice = "-"
		if len(r.Costs) == 0 {
			continue
		}
		if model == nil {
			m, err := sparse.Calibrate(dev)
			if err != nil {
				return nil, fmt.Errorf("the dense fallback's cost model: %w", err)
			}
			model = &m
		}
		policyModel := model.PerSequence(r.Batch)
		denseModel := policyModel
		r.PricedBy = "device"
		lengths, ok := decode.MeasureLengths(r.Tokens)
		pol, known := policies(r.Policy, r.Budget)
		h, shaped := heads[r.Source]
		if ok && known && shaped && dev.Info().Type != "cpu" {
			sc, err := decode.MeasureSteps(dev, h, pol, lengths, r.Batch, *model)
			if err != nil {
				return nil, err
			}
			policyModel, denseModel, r.PricedBy, r.StepCosts = sc.Policy, sc.Dense, "measured", &sc
		}
		dense := 0
		r.DenseModelUs = denseModel.Us(r.DenseCost)
		for _, c := range r.Costs {
			us := policyModel.Us(c)
			r.StepModelUs = append(r.StepModelUs, us)
			if us > r.DenseModelUs {
				dense++
			}
		}
		switch {
		case dense == 0:
			r.DenseChoice = "policy"
		case dense == len(r.Costs):
			r.DenseChoice = "dense"
		default:
			r.DenseChoice = fmt.Sprintf("dense %d/%d", dense, len(r.Costs))
		}
	}
	return model, nil
}

func compare(args []string) error {
	fs := flag.NewFlagSet("compare", flag.ExitOnError)
	ns := fs.String("n", "32768", "context lengths of the generated workload (comma-separated)")
	ps := fs.String("p", "0.9", "target masses P: Tactic's on the GPU, every policy's in the fidelity comparison (comma-separated)")
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
	fid := &autoBool{}
	fs.Var(fid, "fidelity", fmt.Sprintf("also compare every policy's fidelity at matched budgets by the float64 reference on the CPU (evaluate.Compare) at each -p; default: on for a trace and for generated layers of N ≤ %d, -fidelity=false to skip", fidelityAutoTokens))
	queries := fs.Int("queries", 8, "decode queries the fidelity comparison evaluates: the last (up to) this many of the layer's consecutive tail, the earlier ones observed by H2O as its prompt (0: the whole tail); 8, a generated layer's whole tail, takes about 1 minute at N = 131072 on 2 cores for one P, 2 for four")
	p2 := fs.Float64("double-p2", sparse.DefaultDoubleP().P2, "Double-P's P2 in the fidelity comparison (its P1 is each -p)")
	clusterSize := fs.Int("cluster-size", sparse.KMeansDefaultAvgClusterSize, "tokens per K-means cluster on average, on the GPU and in the fidelity comparison")
	span := fs.Int("span", sparse.KMeansDefaultSpan, "K-means within spans of this many tokens in the fidelity comparison, as on the GPU (0: the whole prefill, the Tactic paper's clustering, far slower)")
	plotPath := fs.String("plot", "", "draw the fidelity comparison's mass reached against tokens attended, one curve per policy, into this PNG file; without a fidelity comparison, every policy's speed-up and step over skeleton against N")
	batchList := fs.String("batch", "1", "batch sizes B (comma-separated): for each B > 1 every policy whose steps batch is timed over B sequences at once, each its own cache and index, beside dense attention over B")
	skeletons := fs.Bool("skeleton", true, "time each step's skeleton in the same run: as many dependent dispatches streaming the bytes its stages read (counted from the step), printed as step / skeleton")
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), "usage: vkbench compare [flags]\n\nTimes every policy's decode step on the GPU beside dense attention, then\ncompares their fidelity at matched budgets by the float64 reference (CPU).\n\n")
		fs.PrintDefaults()
	}
	fs.Parse(args)
	if fs.NArg() > 0 {
		return fmt.Errorf("compare: unexpected arguments %q", fs.Args())
	}
	if err := checkOutputs(output{"json", *jsonPath}, output{"plot", *plotPath}); err != nil {
		return err
	}
	if err := checkClusterSize(*clusterSize); err != nil {
		return err
	}
	pList, err := floats(*ps)
	if err != nil {
		return fmt.Errorf("-p: %v", err)
	}
	batches, err := ints(*batchList)
	if err != nil {
		return fmt.Errorf("-batch: %v", err)
	}
	for _, b := range batches {
		if b < 1 {
			return fmt.Errorf("-batch: %d sequences", b)
		}
	}
	if *queries < 0 {
		return fmt.Errorf("-queries: %d is negative", *queries)
	}
	if *span < 0 {
		return fmt.Errorf("-span: %d is negative", *span)
	}
	copts := evaluate.DefaultCompareOptions()
	copts.P, copts.DoubleP2, copts.KMeansSpan = pList, *p2, *span
	copts.Sinks, copts.Window, copts.Seed = *sinks, *recent, uint64(*seed)
	copts.AvgClusterSize = *clusterSize
	if err := copts.Validate(); err != nil {
		return err
	}
	traces, names, err := layers(*tracePath, *ns, *kindsName, *qHeads, *kvHeads, *dim, *seed)
	if err != nil {
		return err
	}
	dev, err := openDevice()
	if err != nil {
		return err
	}
	defer dev.Release()
	policies, err := comparePolicies(pList, *variants)
	if err != nil {
		return err
	}
	rows, err := timeSteps(dev, traces, names, policies, sparse.DenseOptions{ClusterChunk: *chunk},
		sparse.KMeansOptions{AvgClusterSize: *clusterSize, Span: sparse.KMeansDefaultSpan, Seed: uint64(*seed)}, *sinks, *recent, *reps, batches)
	if err != nil {
		return err
	}
	if *skeletons {
		if err := timeSkeletons(dev, rows, *reps); err != nil {
			return err
		}
	} else {
		for i := range rows {
			rows[i].Skeleton = nil
		}
	}
	heads := map[string]sparse.Heads{}
	for i, t := range traces {
		heads[names[i]] = sparse.Heads{Query: t.QHeads, KV: t.KVHeads, Dim: t.HeadDim}
	}
	opts := sparse.TacticDecoderOptions{Sinks: *sinks, KMeans: sparse.KMeansOptions{AvgClusterSize: *clusterSize, Span: sparse.KMeansDefaultSpan, Seed: uint64(*seed)}}
	costs, err := denseChoices(dev, rows, heads, compareFallbacks(pList, opts))
	if err != nil {
		return err
	}
	printSteps(rows)

	out := compareReport{Steps: rows, Fidelity: []compareFidelity{}, CostModel: costs}
	for i, t := range traces {
		if !fid.on(*tracePath != "", t.Tokens) {
			continue
		}
		f, err := compareFidelityOf(t, names[i], copts, *queries)
		if err != nil {
			return err
		}
		out.Fidelity = append(out.Fidelity, f)
	}
	if len(out.Fidelity) > 0 {
		fmt.Println()
		printFidelity(os.Stdout, out.Fidelity)
		warnBounds(out.Fidelity)
	}
	if *plotPath != "" {
		if len(out.Fidelity) == 0 {
			if err := plotPolicySteps(*plotPath, rows); err != nil {
				return err
			}
		} else if err := plotCompare(*plotPath, out.Fidelity); err != nil {
			return err
		}
	}
	if *jsonPath != "" {
		return writeJSON(*jsonPath, "compare "+strings.Join(args, " "), dev.Info(), out)
	}
	return nil
}

// comparePolicies returns the policies whose steps `vkbench compare`
// times: the defaults at each P, and Double-P at each p1/p2 pair of
// variants (comma-separated; "" for none).
func comparePolicies(pList []float64, variants string) ([]evaluate.Policy, error) {
	policies := evaluate.DefaultPolicies(pList)
	if variants == "" {
		return policies, nil
	}
	var targets []sparse.DoubleP
	for _, v := range strings.Split(variants, ",") {
		var o sparse.DoubleP
		if _, err := fmt.Sscanf(v, "%g/%g", &o.P1, &o.P2); err != nil {
			return nil, fmt.Errorf("-double-p: %q is not p1/p2", v)
		}
		targets = append(targets, o)
	}
	return append(policies, evaluate.DoublePVariants(targets)...), nil
}

// timeSteps times every policy's step on each trace at each batch size
// (evaluate.Steps at 1, evaluate.BatchSteps beyond), one row per (trace,
// batch, policy that batches).
func timeSteps(dev *vk.Device, traces []*trace.Trace, names []string, policies []evaluate.Policy, dense sparse.DenseOptions, clustering sparse.KMeansOptions, sinks, recent, reps int, batches []int) ([]compareRow, error) {
	prog := &progress{total: len(traces) * len(batches) * len(policies)}
	defer prog.finish()
	var rows []compareRow
	for i, t := range traces {
		for _, b := range batches {
			tell := func(name string) { prog.step(fmt.Sprintf("%s, batch %d: %s", names[i], b, name)) }
			var runs []evaluate.StepRun
			var err error
			if b == 1 {
				runs, err = evaluate.Steps(dev, t, dense, clustering, policies, sinks, recent, reps, tell)
			} else {
				runs, err = evaluate.BatchSteps(dev, t, dense, clustering, policies, sinks, recent, reps, b, tell)
			}
			if err != nil {
				return nil, err
			}
			for _, r := range runs {
				rows = append(rows, compareRow{Source: names[i], StepRun: r})
			}
		}
	}
	return rows, nil
}

// timeSkeletons times the skeleton of every row's step
// (evaluate.StepRun.Skeleton) over reps runs.
func timeSkeletons(dev *vk.Device, rows []compareRow, reps int) error {
	t, err := newSkeletonTimer(dev, reps)
	if err != nil {
		return err
	}
	defer t.release()
	prog := &progress{total: len(rows)}
	defer prog.finish()
	for i := range rows {
		r := &rows[i]
		name := fmt.Sprintf("%s, batch %d: %s", r.Source, r.Batch, r.Policy)
		prog.step("skeleton " + name)
		if err := t.time(name, r.Skeleton, r.StepUs); err != nil {
			return err
		}
	}
	return nil
}

// compareFidelityOf compares every policy's fidelity on t, named name,
// over its last queries tail queries (evaluate.Compare with copts).
func compareFidelityOf(t *trace.Trace, name string, copts evaluate.CompareOptions, queries int) (compareFidelity, error) {
	o := copts
	o.Queries = lastQueries(t, queries)
	p := &progress{}
	what := fmt.Sprintf("fidelity %s: %d queries", name, len(o.Queries))
	o.Progress = func(_, total int) { p.total = total; p.step(what) }
	c, err := evaluate.Compare(t, o)
	p.finish()
	if err != nil {
		return compareFidelity{}, err
	}
	return compareFidelity{Source: name, Comparison: c}, nil
}

// warnBounds reports on stderr every policy whose output error exceeded
// its bound where the bound applies.
func warnBounds(fids []compareFidelity) {
	for _, f := range fids {
		for _, r := range f.Results {
			for _, pr := range r.Policies {
				if pr.BoundApplies && pr.BoundWorst > 1 {
					fmt.Fprintf(os.Stderr, "vkbench: %s P=%g %s: output error exceeds the bound 2(1 − p(I))·max‖v‖ (worst ratio %.3g)\n", f.Source, r.P, policyLabel(pr), pr.BoundWorst)
				}
			}
		}
	}
}

// printSteps prints the GPU table of `vkbench compare`.
func printSteps(rows []compareRow) {
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
		exact, budget, mass := "—", "—", "—"
		if r.ExactPct > 0 {
			exact = fmt.Sprintf("%.1f", r.ExactPct)
		}
		if r.ReadPct > 0 {
			exact = fmt.Sprintf("%.1f read", r.ReadPct)
			mass = fmt.Sprintf("%.3f", r.Mass)
		}
		if r.Budget > 0 {
			budget = fmt.Sprint(r.Budget)
		}
		skUs, skMB, over := skeletonCells(r.Skeleton)
		choice := r.DenseChoice
		if r.PricedBy != "" {
			choice += ", " + r.PricedBy
		}
		cells = append(cells, []string{r.Source, fmt.Sprint(r.Batch), r.Policy, fmt.Sprintf("%.1f", r.DenseUs), fmt.Sprintf("%.0f", r.DenseGBps), fmt.Sprintf("%.1f", r.StepUs), fmt.Sprintf("%.2f×", r.Speedup),
			skUs, over, fmt.Sprint(r.Dispatches), exact, budget, mass, fmt.Sprintf("%.1e", r.RelErr), st, skMB, choice})
	}
	table(os.Stdout, []string{"source", "batch", "policy", "dense µs", "dense GB/s", "step µs", "speed-up", "skeleton µs", "step/skeleton", "dispatches", "exact %", "budget", "exact mass", "rel err", "stages µs", "stages MB", "dense fallback"}, cells)
}

// fidelityAutoTokens is the largest generated layer the fidelity
// comparison runs on unless -fidelity says otherwise.
const fidelityAutoTokens = 131072

// autoBool is a boolean flag that remembers whether it was given: unset,
// the command decides.
type autoBool struct{ set, value bool }

func (b *autoBool) String() string {
	if b == nil || !b.set {
		return "auto"
	}
	return strconv.FormatBool(b.value)
}

func (b *autoBool) Set(s string) error {
	v, err := strconv.ParseBool(s)
	if err != nil {
		return fmt.Errorf("%q is not true or false", s)
	}
	b.set, b.value = true, v
	return nil
}

func (b *autoBool) IsBoolFlag() bool { return true }

// on says whether the fidelity comparison runs on a layer of tokens
// tokens, read from a trace or generated.
func (b *autoBool) on(fromTrace bool, tokens int) bool {
	if b.set {
		return b.value
	}
	return fromTrace || tokens <= fidelityAutoTokens
}

// lastQueries returns the last k of the trace's consecutive tail queries
// (evaluate.TailQueries), all of them when k is 0 or exceeds them.
func lastQueries(t *trace.Trace, k int) []int {
	tail := evaluate.TailQueries(t)
	if k == 0 || k > len(tail) {
		return tail
	}
	return tail[len(tail)-k:]
}

// compareReport is what `vkbench compare -json` writes under results.
type compareReport struct {
	// Steps are the GPU rows.
	Steps []compareRow `json:"steps"`
	// Fidelity holds the float64 comparison of each layer it ran on.
	Fidelity []compareFidelity `json:"fidelity"`
	// CostModel is the device's cost model, that priced the dense
	// fallback's choices where they were not measured (nil where no
	// policy falls back).
	CostModel *sparse.CostModel `json:"cost_model,omitempty"`
}

// compareFidelity is evaluate.Compare's result on one layer.
type compareFidelity struct {
	Source string `json:"source"`
	*evaluate.Comparison
}

// policyLabel names a policy's entry: a fixed-budget policy with the
// adaptive policy whose budget it was given.
func policyLabel(r evaluate.PolicyResult) string {
	if r.BudgetFrom == "" {
		return r.Policy
	}
	return fmt.Sprintf("%s (%s budget)", r.Policy, r.BudgetFrom)
}

// printFidelity prints the fidelity comparison: a line per layer on what
// was evaluated, then one row per (layer, P, policy, budget source).
func printFidelity(w io.Writer, fids []compareFidelity) {
	var cells [][]string
	for _, f := range fids {
		o := f.Options
		fmt.Fprintf(w, "fidelity at matched budgets, float64 reference: %s, N = %d, %d queries × %d heads, prefill %d, K-means span %d, Double-P P2 = %g\n",
			f.Source, f.Tokens, len(o.Queries), f.QHeads, o.Prefill, o.KMeansSpan, o.DoubleP2)
		for _, r := range f.Results {
			for _, pr := range r.Policies {
				budget, bound := "—", "—"
				if pr.BudgetFrom != "" {
					budget = fmt.Sprintf("%s %.0f", pr.BudgetFrom, pr.Budget)
				}
				if pr.BoundApplies {
					bound = fmt.Sprintf("%.3f", pr.BoundWorst)
				}
				cells = append(cells, []string{f.Source, fmt.Sprint(r.P), pr.Policy, budget, fmt.Sprintf("%.1f", pr.Union), fmt.Sprintf("%.2f%%", 100*pr.UnionFrac),
					fmt.Sprintf("%.3f", pr.Mass), fmt.Sprintf("%.3f", pr.Covered), fmt.Sprintf("%.1f%%", 100*pr.SuccessRate),
					fmt.Sprintf("%.2e", pr.RelErr), fmt.Sprintf("%.2e", pr.MaxRelErr), bound})
			}
		}
	}
	table(w, []string{"source", "P", "policy", "budget from", "tokens", "% of N", "mass", "covered", "success", "rel err", "max rel err", "bound"}, cells)
}

// fidelityCurve is one policy's mass reached against tokens attended: a
// point per P, in ascending order of tokens.
type fidelityCurve struct {
	Name   string
	Points []fidelityPoint
}

// fidelityPoint is a policy's figures at one P: the tokens its KV heads
// attend exactly (% of the tokens a query could attend) and the mass its
// output accounts for (Double-P's approximated clusters included).
type fidelityPoint struct {
	P, TokensPct, Mass float64
}

// fidelityCurves returns a curve per policy and budget source, in the
// order Compare reports them.
func fidelityCurves(c *evaluate.Comparison) []fidelityCurve {
	if len(c.Results) == 0 {
		return nil
	}
	var out []fidelityCurve
	for _, e := range c.Results[0].Policies {
		fc := fidelityCurve{Name: policyLabel(e)}
		for i := range c.Results {
			if r := c.Results[i].Policy(e.Policy, e.BudgetFrom); r != nil {
				fc.Points = append(fc.Points, fidelityPoint{P: c.Results[i].P, TokensPct: 100 * r.UnionFrac, Mass: r.Covered})
			}
		}
		slices.SortStableFunc(fc.Points, func(a, b fidelityPoint) int { return cmp.Compare(a.TokensPct, b.TokensPct) })
		out = append(out, fc)
	}
	return out
}
