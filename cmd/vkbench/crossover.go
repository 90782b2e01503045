package main

import (
	"flag"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/vksparse/vksparse/decode"
	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/trace"
	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/workload"
)

// crossoverRow is one row of `vkbench crossover`: a policy on one layer,
// what its step and dense attention cost at the probe length by the
// layer's cost models and as timed, and the shortest length at which the
// policy's step costs less than dense attention by those models (where
// decode's dense fallback hands the layer to the policy); -1 where it
// never does up to the longest length searched. With a batch, the layer
// holds Batch copies of the sequence, its choices priced for a sequence's
// part of the batch (decode.Config.PriceBatch).
type crossoverRow struct {
	Layer  string  `json:"layer"`
	Heads  string  `json:"heads"` // Hq/Hkv/D
	Policy string  `json:"policy"`
	Tokens int     `json:"probe_tokens"`
	Batch  int     `json:"batch"`
	Share  float64 `json:"share"` // of its index the step took at the probe
	// PolicyCost and DenseCost are counted at the probe length, and priced
	// per sequence by the layer's cost models (Measured: the policy's and
	// dense attention's own, decode.MeasureSteps; else the device's).
	PolicyCost sparse.Cost       `json:"policy_cost"`
	DenseCost  sparse.Cost       `json:"dense_cost"`
	PolicyUs   float64           `json:"policy_us"`
	DenseUs    float64           `json:"dense_us"`
	Measured   bool              `json:"measured"`
	StepCosts  *decode.StepCosts `json:"step_costs,omitempty"`
	// Chosen is what the fallback attends with at the probe length, and
	// LayerOverDense the layer's cost over dense attention's by the
	// models (≤ 1).
	Chosen         string  `json:"chosen"`
	LayerOverDense float64 `json:"layer_over_dense"`
	// Timed at the probe for the whole batch (decode.Model.TimeFallbacks:
	// the fastest of three rounds of medians): the policy's step, dense
	// attention, and the layer under FallbackAuto as it chose; and the
	// last over dense attention's.
	TimedPolicyUs       float64 `json:"timed_policy_us"`
	TimedDenseUs        float64 `json:"timed_dense_us"`
	TimedLayerUs        float64 `json:"timed_layer_us"`
	TimedLayerOverDense float64 `json:"timed_layer_over_dense"`
	Crossover           int     `json:"crossover_tokens"`
}

// crossoverReport is what -json writes.
type crossoverReport struct {
	CostModel sparse.CostModel `json:"cost_model"`
	Measured  bool             `json:"cost_model_measured"`
	MaxTokens int              `json:"max_tokens"`
	Rows      []crossoverRow   `json:"rows"`
}

// crossoverLayer is one layer the crossover is found on: a real trace, or
// a generated layer of a shape.
type crossoverLayer struct {
	name string
	t    *trace.Trace
}

func crossover(args []string) error {
	fs := flag.NewFlagSet("crossover", flag.ExitOnError)
	traces := fs.String("trace", "", "trace files (comma-separated): the crossover on each one's shape, the shares measured on its data")
	shapes := fs.String("shapes", "8,2,64", "without -trace: generated layers of these shapes, Hq,Hkv,D separated by ';' (8,2,64 is the real traces')")
	kinds := fs.String("kinds", "llama", kindsUsage)
	n := fs.Int("n", 16384, "probe length: tokens prefilled (at most a trace's) where each step runs and its share of the index is measured")
	maxTokens := fs.Int("max", 1<<22, "longest length searched for the crossover")
	p := fs.Float64("p", 0.9, "Tactic's target mass")
	budget := fs.Int("budget", 1024, "middle tokens of Quest, StreamingLLM and H2O")
	sinks := fs.Int("sinks", 4, "sinks of the clustered policies")
	clusterSize := fs.Int("cluster-size", sparse.KMeansDefaultAvgClusterSize, "tokens per K-means cluster on average")
	floor := fs.Float64("floor-us", 0, "the cost model's floor per dependent dispatch in µs (with -gbps; both unset: measured on the device, sparse.Calibrate)")
	gbps := fs.Float64("gbps", 0, "the cost model's read bandwidth in GB/s (with -floor-us)")
	measure := fs.Bool("measure", true, "price each policy's step and dense attention by cost models measured on their own kernels at the layer's geometry (decode.MeasureSteps; needs a probe of at least 2048 tokens); false: by the device's cost model")
	reps := fs.Int("reps", 21, "timed runs of each step at the probe")
	batch := fs.Int("batch", 1, "sequences the layer attends at once (copies of the probe), its choices priced for them (decode.Config.PriceBatch)")
	seed := fs.Int64("seed", 1, "workload and K-means seed")
	jsonPath := fs.String("json", "", "write results as JSON to this file")
	fs.Parse(args)
	if err := checkOutputs(output{"json", *jsonPath}); err != nil {
		return err
	}
	switch {
	case *n < 256:
		return fmt.Errorf("-n: %d tokens leave the positional policies no middle to index (at least 256)", *n)
	case *maxTokens < *n:
		return fmt.Errorf("-max: %d is below -n %d", *maxTokens, *n)
	case *budget < 1 || *budget > *n:
		return fmt.Errorf("-budget: %d outside [1, -n]", *budget)
	case *reps < 1:
		return fmt.Errorf("-reps: %d timed runs", *reps)
	case *batch < 1:
		return fmt.Errorf("-batch: %d sequences", *batch)
	case (*floor == 0) != (*gbps == 0):
		return fmt.Errorf("-floor-us and -gbps go together")
	}
	layers, err := crossoverLayers(*traces, *shapes, *kinds, *n, *seed)
	if err != nil {
		return err
	}
	opts := sparse.TacticDecoderOptions{Sinks: *sinks, KMeans: sparse.KMeansOptions{AvgClusterSize: *clusterSize, Seed: uint64(*seed)}}
	policies := []decode.Policy{
		decode.Tactic(*p, opts),
		decode.DoubleP(sparse.DefaultDoubleP(), opts),
		decode.Quest(*budget),
		decode.StreamingLLM(*budget),
		decode.H2O(*budget),
	}
	dev, err := openDevice()
	if err != nil {
		return err
	}
	defer dev.Release()
	report := crossoverReport{CostModel: sparse.CostModel{FloorUs: *floor, ReadGBps: *gbps}, MaxTokens: *maxTokens}
	if *floor == 0 {
		if report.CostModel, err = sparse.Calibrate(dev); err != nil {
			return err
		}
		report.Measured = true
	}
	if err := report.CostModel.Validate(); err != nil {
		return err
	}
	fmt.Printf("cost model: %.2f µs a dependent dispatch, %.1f GB/s (%s)\n", report.CostModel.FloorUs, report.CostModel.ReadGBps, map[bool]string{true: "measured", false: "given"}[report.Measured])
	prog := &progress{total: len(layers) * len(policies)}
	defer prog.finish()
	for _, l := range layers {
		for _, pol := range policies {
			prog.step(fmt.Sprintf("%s %s", l.name, pol))
			row, err := crossoverOf(dev, l, pol, report.CostModel, *measure, *n, *batch, *maxTokens, *clusterSize, *reps)
			if err != nil {
				return fmt.Errorf("%s, %s: %w", l.name, pol, err)
			}
			report.Rows = append(report.Rows, row)
		}
	}
	prog.finish()
	var rows [][]string
	for _, r := range report.Rows {
		cross := strconv.Itoa(r.Crossover)
		if r.Crossover < 0 {
			cross = fmt.Sprintf("never ≤ %d", *maxTokens)
		}
		priced := "device"
		if r.Measured {
			priced = "measured"
		}
		rows = append(rows, []string{r.Layer, r.Heads, r.Policy, strconv.Itoa(r.Tokens), strconv.Itoa(r.Batch), fmt.Sprintf("%.3f", r.Share), priced,
			fmt.Sprintf("%.2f", r.PolicyUs), fmt.Sprintf("%.2f", r.DenseUs), r.Chosen, fmt.Sprintf("%.2f", r.LayerOverDense),
			fmt.Sprintf("%.2f", r.TimedPolicyUs), fmt.Sprintf("%.2f", r.TimedDenseUs), fmt.Sprintf("%.2f", r.TimedLayerUs), fmt.Sprintf("%.2f", r.TimedLayerOverDense), cross})
	}
	table(os.Stdout, []string{"layer", "Hq/Hkv/D", "policy", "tokens", "batch", "share", "priced by", "policy µs", "dense µs", "chosen", "layer/dense", "timed policy µs", "timed dense µs", "timed layer µs", "timed layer/dense", "crossover"}, rows)
	if *jsonPath != "" {
		return writeJSON(*jsonPath, "crossover "+strings.Join(args, " "), dev.Info(), report)
	}
	return nil
}

// crossoverLayers reads the traces, or generates a layer of each shape.
func crossoverLayers(traces, shapes, kinds string, n int, seed int64) ([]crossoverLayer, error) {
	var out []crossoverLayer
	if traces != "" {
		for _, path := range strings.Split(traces, ",") {
			t, err := trace.Read(strings.TrimSpace(path))
			if err != nil {
				return nil, err
			}
			out = append(out, crossoverLayer{name: filepath.Base(path), t: t})
		}
		return out, nil
	}
	for _, s := range strings.Split(shapes, ";") {
		dims, err := ints(s)
		if err != nil || len(dims) != 3 {
			return nil, fmt.Errorf("-shapes: %q is not Hq,Hkv,D", s)
		}
		cfg, err := workload.NamedConfig(kinds, n, dims[0], dims[1], dims[2])
		if err != nil {
			return nil, fmt.Errorf("-kinds: %v", err)
		}
		cfg.Seed = seed
		t, err := workload.Generate(cfg)
		if err != nil {
			return nil, err
		}
		out = append(out, crossoverLayer{name: fmt.Sprintf("%s n=%d", kinds, n), t: t})
	}
	return out, nil
}

// crossoverOf runs pol's step on the layer's first n tokens (at most the
// layer's), in batch copies, twice, so that the second is weighed by the
// share of its index the first took, and times it, dense attention, and
// the layer under FallbackAuto (priced for a sequence's part of the
// batch, by measured step costs where measure);
// then it finds the crossover by Policy.Cost at longer and shorter
// lengths, priced by the same models: a clustered policy keeps that
// share of an index growing with the tokens (every token past the sinks
// clustered, clusters of clusterSize), a positional one the rows it took
// of the middle (its budget is a number of tokens).
func crossoverOf(dev *vk.Device, l crossoverLayer, pol decode.Policy, costs sparse.CostModel, measure bool, n, batch, maxTokens, clusterSize, reps int) (crossoverRow, error) {
	t := l.t
	n = min(n, t.Tokens)
	h := sparse.Heads{Query: t.QHeads, KV: t.KVHeads, Dim: t.HeadDim}
	row := crossoverRow{Layer: l.name, Heads: fmt.Sprintf("%d/%d/%d", h.Query, h.KV, h.Dim), Policy: pol.String(), Tokens: n, Batch: batch}
	how := decode.MeasureNever
	if measure {
		how = decode.MeasureAlways
	}
	m, err := decode.New(dev, decode.Config{Heads: h, Layers: 1, Slots: batch, Capacity: n, Policy: pol, Fallback: decode.FallbackNever, Costs: &costs, Measure: how, PriceBatch: batch})
	if err != nil {
		return row, err
	}
	defer m.Release()
	var k, v []uint16
	for g := 0; g < h.KV; g++ {
		k = append(k, t.K[g*t.Tokens*h.Dim:(g*t.Tokens+n)*h.Dim]...)
		v = append(v, t.V[g*t.Tokens*h.Dim:(g*t.Tokens+n)*h.Dim]...)
	}
	for s := range batch {
		if err := m.Prefill(s, 0, k, v, n); err != nil {
			return row, err
		}
	}
	// The query nearest the end of the prefill that sees all of it.
	q := t.Queries() - 1
	for i, pos := range t.QPos {
		if int(pos) >= n-1 && int(pos) < int(t.QPos[q]) {
			q = i
		}
	}
	var queries []float32
	for range batch {
		queries = append(queries, t.Query(q)...)
	}
	for range 2 {
		if _, err := m.Attend(0, queries); err != nil {
			return row, err
		}
	}
	timed, err := m.TimeFallbacks(0, queries, []decode.Fallback{decode.FallbackNever, decode.FallbackAlways, decode.FallbackAuto}, reps)
	if err != nil {
		return row, err
	}
	row.TimedPolicyUs, row.TimedDenseUs, row.TimedLayerUs = timed[0], timed[1], timed[2]
	row.TimedLayerOverDense = row.TimedLayerUs / row.TimedDenseUs
	choices, err := m.Choices(0)
	if err != nil {
		return row, err
	}
	c := choices[0]
	row.Share, row.PolicyCost, row.DenseCost = c.Share, c.PolicyCost, c.DenseCost
	row.PolicyUs, row.DenseUs, row.Measured = c.PolicyUs, c.DenseUs, c.Measured
	policyModel := costs.PerSequence(batch)
	denseModel := policyModel
	if sc, ok := m.StepCosts(0); ok {
		row.StepCosts = &sc
		policyModel, denseModel = sc.Policy, sc.Dense
	}
	row.Chosen = pol.String()
	if c.Dense {
		row.Chosen = "dense"
	}
	row.LayerOverDense = math.Min(row.PolicyUs, row.DenseUs) / row.DenseUs
	sinks := pol.Options().Sinks
	if sinks == 0 {
		sinks = sparse.TacticDefaultSinks
	}
	middle := func(tokens int) int {
		lo, hi := sparse.DefaultBaselineLayout().Middle(tokens)
		return max(hi-lo, 0)
	}
	rows := c.Share * float64(middle(n))
	wins := func(tokens int) (bool, error) {
		indexed, clusters, share := 0, 0, c.Share
		if pol.Clustered() {
			indexed = max(tokens-sinks, 0)
			clusters = min(indexed, (indexed+clusterSize-1)/clusterSize)
		} else if m := middle(tokens); m > 0 {
			share = min(1, rows/float64(m))
		}
		pc, err := pol.Cost(h, tokens, indexed, clusters, share)
		if err != nil {
			return false, err
		}
		return policyModel.Us(pc) < denseModel.Us(h.DenseCost(tokens)), nil
	}
	row.Crossover, err = firstTrue(sparse.BaselineSinks+sparse.BaselineWindow+1, maxTokens, wins)
	return row, err
}

// firstTrue returns the least length in [lo, hi] where f holds, f being
// false below some length and true from it on; -1 where it holds nowhere.
func firstTrue(lo, hi int, f func(int) (bool, error)) (int, error) {
	ok, err := f(hi)
	if err != nil || !ok {
		return -1, err
	}
	for lo < hi {
		mid := lo + (hi-lo)/2
		ok, err := f(mid)
		if err != nil {
			return -1, err
		}
		if ok {
			hi = mid
		} else {
			lo = mid + 1
		}
	}
	return lo, nil
}
