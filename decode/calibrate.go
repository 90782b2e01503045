package decode

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/vk"
	"github.com/x448/float16"
)

// Measure is how FallbackAuto prices a layer's two ways to attend a
// sequence.
type Measure int

const (
	// MeasureOnGPU measures each policy's step and dense attention on a
	// GPU (MeasureSteps) and prices both by the device's cost model on a
	// CPU device (a software renderer, where speed is not the point), or
	// where the capacity is below MinMeasureTokens. Config.Costs, when
	// given, prices both instead.
	MeasureOnGPU Measure = iota
	// MeasureAlways measures on every device (Config.Costs then only
	// prices what cannot be measured: a capacity below MinMeasureTokens).
	MeasureAlways
	// MeasureNever prices both by the device's cost model.
	MeasureNever
)

// String names the measure.
func (m Measure) String() string {
	switch m {
	case MeasureOnGPU:
		return "on GPU"
	case MeasureAlways:
		return "always"
	case MeasureNever:
		return "never"
	}
	return fmt.Sprintf("measure %d", int(m))
}

// MinMeasureTokens is the least capacity at which a model measures its
// policies' steps: MeasureSteps runs them at a quarter of it and at
// all of it (at most MaxMeasureTokens).
const (
	MinMeasureTokens = 2048
	MaxMeasureTokens = 32768
)

// MeasureLengths returns the two lengths a model of the capacity measures
// its policies' steps at: min(capacity, MaxMeasureTokens) and a quarter
// of that; ok is false below MinMeasureTokens.
func MeasureLengths(capacity int) (lengths [2]int, ok bool) {
	hi := min(capacity, MaxMeasureTokens)
	return [2]int{hi / 4, hi}, hi >= MinMeasureTokens
}

// StepCosts prices one layer's choice: the policy's step and dense
// attention over one sequence, each by its own cost model, fitted
// (sparse.FitCostModel) to two runs: the policy's to Points, dense
// attention's to DensePoints where present (runs at the model's own
// lengths, where the policy's budget moved Points beyond them), else to
// Points.
type StepCosts struct {
	Policy      sparse.CostModel `json:"policy"`
	Dense       sparse.CostModel `json:"dense"`
	Points      []StepPoint      `json:"points"`
	DensePoints []StepPoint      `json:"dense_points,omitempty"`
}

// StepPoint is one measured run of MeasureSteps: the costs of the
// policy's step and of dense attention over Tokens tokens as the library
// counts them (Choice), and their GPU times, medians of timed runs. Where
// StepCosts.DensePoints holds dense attention's own runs, Points leave
// DenseUs zero and DensePoints the policy's fields.
type StepPoint struct {
	Tokens     int         `json:"tokens"`
	Share      float64     `json:"share"`
	PolicyCost sparse.Cost `json:"policy_cost"`
	DenseCost  sparse.Cost `json:"dense_cost"`
	PolicyUs   float64     `json:"policy_us"`
	DenseUs    float64     `json:"dense_us"`
}

// stepCosts caches MeasureSteps' results per device, heads, policy and
// lengths (stepKey).
var stepCosts sync.Map

// stepKey names what MeasureSteps measured.
func stepKey(info vk.Info, h sparse.Heads, p Policy, lengths [2]int, batch int) string {
	p.fallback, p.fallbackSet = 0, false
	return fmt.Sprintf("%s|%+v|%+v|%v|%d", info.Identity(), h, p, lengths, batch)
}

// Timed runs of each measured step, after untimed ones that keep the
// GPU busy for measureWarm first, in measureRounds rounds
// (TimeFallbacks): a GPU idle a while lowers its clocks (an H100 went
// from 1 980 to 345 MHz in the gaps of host work between steps, and
// dense attention took 3.4× as long).
const (
	measureReps   = 9
	measureRounds = 3
	measureWarm   = 20 * time.Millisecond
	// measureClocks of GPU load (sparse.WarmUp) come before each length's
	// rounds.
	measureClocks = 300 * time.Millisecond
)

// TimeFallbacks times the layer's attention for the query q under each
// fallback of modes in turn (SetFallback, SetQuery, then reps timed runs
// after measureWarm of untimed ones), measureRounds times over, and
// returns each mode's fastest median, in µs: a GPU's clocks follow its
// load with a lag and drop in the host's gaps between submissions, so a
// round may run at a fraction of them whatever its warm-up, and the
// fastest round is the steady state of a model decoding layer after
// layer. The layer is left under the last of modes.
func (m *Model) TimeFallbacks(layer int, q []float32, modes []Fallback, reps int) ([]float64, error) {
	out := make([]float64, len(modes))
	for i := range out {
		out[i] = math.Inf(1)
	}
	for range measureRounds {
		for i, f := range modes {
			if err := m.SetFallback(layer, f); err != nil {
				return nil, err
			}
			if err := m.SetQuery(layer, q); err != nil {
				return nil, err
			}
			t, err := m.timeWarm(layer, measureWarm, reps)
			if err != nil {
				return nil, err
			}
			out[i] = min(out[i], float64(t[len(t)/2])/float64(time.Microsecond))
		}
	}
	return out, nil
}

// Topics of the keys MeasureSteps attends over: a topic per
// topicTokens tokens on average, in runs of topicRun tokens; the query
// takes queryTopics of them, at a weight that puts about nine tenths of
// the attention on their tokens (a few percent of all).
const (
	topicTokens = 64
	topicRun    = 32
	queryTopics = 3
	topicWeight = 1.2
)

// topicKeys returns keys of h's KV heads over n tokens as text has them,
// fp16 [KV][n][D]: each token's key is its topic's centre (standard
// normal) plus standard normal noise, topics changing every topicRun
// tokens; and queries [Hq][D] (float32) that each point at queryTopics
// topics of their KV head (those of random runs): the scaled sum of
// their centres over √queryTopics, so that
// their tokens' logits stand about topicWeight·√(D/queryTopics) above the
// others' (√2·topicWeight standard deviations of noise).
func topicKeys(rng *rand.Rand, h sparse.Heads, n int) (k []uint16, q []float32) {
	topics := max(queryTopics, n/topicTokens)
	noise := normalHalves(rng, h.KV*n*h.Dim)
	k = make([]uint16, len(noise))
	q = make([]float32, h.Query*h.Dim)
	for g := range h.KV {
		centres := make([]float32, topics*h.Dim)
		for i := range centres {
			centres[i] = float32(rng.NormFloat64())
		}
		var runs []int // each run's topic
		for t := 0; t < n; t += topicRun {
			runs = append(runs, rng.IntN(topics))
			c := centres[runs[len(runs)-1]*h.Dim:][:h.Dim]
			for u := t; u < min(n, t+topicRun); u++ {
				row := (g*n + u) * h.Dim
				for d := range h.Dim {
					k[row+d] = float16.Fromfloat32(c[d] + float16.Frombits(noise[row+d]).Float32()).Bits()
				}
			}
		}
		for j := range h.Group() {
			qh := q[(g*h.Group()+j)*h.Dim:][:h.Dim]
			for range queryTopics {
				c := centres[runs[rng.IntN(len(runs))]*h.Dim:][:h.Dim]
				for d := range h.Dim {
					qh[d] += float32(topicWeight/math.Sqrt(queryTopics)) * c[d]
				}
			}
		}
	}
	return k, q
}

// normalHalves returns count fp16 values drawn from a table of 2^16
// standard normal ones (fast enough for a 131 072-token layer).
func normalHalves(rng *rand.Rand, count int) []uint16 {
	table := make([]uint16, 1<<16)
	for i := range table {
		table[i] = float16.Fromfloat32(float32(rng.NormFloat64())).Bits()
	}
	out := make([]uint16, count)
	for i := 0; i < count; i += 4 {
		r := rng.Uint64()
		for j := 0; j < 4 && i+j < count; j++ {
			out[i+j] = table[uint16(r>>(16*j))]
		}
	}
	return out
}

// MeasureSteps returns the policy's step costs on dev for heads h, a
// sequence's part in a batch of batch sequences, measured on its first
// call for that device, driver, geometry, policy, lengths and batch and
// cached for the process. At each length it fills batch sequences of a
// one-layer model with the same keys in topics (topicKeys: a few percent
// of the tokens hold most of a query's attention, as in text) and
// standard normal values, and attends queries that point at a few topics
// twice, so that the policy's cost counts the share of its index its step
// takes; then it times the policy's step and dense attention (a dense
// plan a sequence, as the fallback attends them) in turn
// (Model.TimeFallbacks, after a warm-up of the clocks), divides each time
// by batch and fits each a cost model through its two runs. A policy of a
// budget of middle tokens (Quest, StreamingLLM, H2O) is measured from
// twice its budget at least, the longer run at lengths[1] or twice the
// shorter, whichever is longer; dense attention is then timed alone at
// lengths instead, and fitted to those runs. Choices are made up to the
// model's capacity, and a line through runs beyond it misprices them: on
// an H200, through runs at 11 870 and 47 480 tokens (four times apart),
// dense attention at 32 768 was priced at 1.2× its time, and Quest's step
// (40.9 µs at 11 870 tokens, 48.5 at 32 768, 65.5 at 47 480) at 1.1×.
// fallback's bandwidth (the device's) prices the bytes; the fit gives what
// they leave to a floor per dispatch and a cost per token of context
// (sparse.FitCostModel).
func MeasureSteps(dev *vk.Device, h sparse.Heads, p Policy, lengths [2]int, batch int, fallback sparse.CostModel) (StepCosts, error) {
	if !p.FallsBack() {
		return StepCosts{}, fmt.Errorf("decode: %s never falls back to dense attention: nothing to measure", p)
	}
	if lengths[0] <= 0 || lengths[1] <= lengths[0] {
		return StepCosts{}, fmt.Errorf("decode: measuring %s at %v tokens: two increasing positive lengths", p, lengths)
	}
	if batch < 1 {
		return StepCosts{}, fmt.Errorf("decode: measuring %s in a batch of %d sequences", p, batch)
	}
	if err := errors.Join(h.Validate(), fallback.Validate()); err != nil {
		return StepCosts{}, err
	}
	own := lengths
	if p.budget > 0 && lengths[0] < 2*p.budget {
		lengths[0] = 2 * p.budget
		lengths[1] = max(lengths[1], 2*lengths[0])
	}
	key := stepKey(dev.Info(), h, p, own, batch)
	if c, ok := stepCosts.Load(key); ok {
		return c.(StepCosts), nil
	}
	// Dense attention is timed beside the policy's step where the same
	// runs price both, else alone at the model's own lengths.
	moved := lengths != own
	var out StepCosts
	for i, n := range lengths {
		pt, err := measureStep(dev, h, p, n, batch, uint64(i+1), true, !moved)
		if err != nil {
			return StepCosts{}, fmt.Errorf("decode: measuring %s over %d tokens: %w", p, n, err)
		}
		out.Points = append(out.Points, pt)
	}
	if moved {
		for i, n := range own {
			pt, err := measureStep(dev, h, p, n, batch, uint64(i+1), false, true)
			if err != nil {
				return StepCosts{}, fmt.Errorf("decode: measuring dense attention over %d tokens: %w", n, err)
			}
			out.DensePoints = append(out.DensePoints, pt)
		}
	}
	a, b := out.Points[0], out.Points[1]
	var err error
	if out.Policy, err = sparse.FitCostModel(a.PolicyCost, a.PolicyUs, b.PolicyCost, b.PolicyUs, fallback); err != nil {
		return StepCosts{}, fmt.Errorf("decode: %s's step: %w", p, err)
	}
	if out.DensePoints != nil {
		a, b = out.DensePoints[0], out.DensePoints[1]
	}
	if out.Dense, err = sparse.FitCostModel(a.DenseCost, a.DenseUs, b.DenseCost, b.DenseUs, fallback); err != nil {
		return StepCosts{}, fmt.Errorf("decode: dense attention: %w", err)
	}
	stepCosts.Store(key, out)
	return out, nil
}

// measureStep runs MeasureSteps' measurement at one length: the policy's
// step where policy, dense attention where dense.
func measureStep(dev *vk.Device, h sparse.Heads, p Policy, n, batch int, seed uint64, policy, dense bool) (_ StepPoint, err error) {
	var modes []Fallback
	if policy {
		modes = append(modes, FallbackNever)
	} else {
		p.budget = min(p.budget, n) // never attended: only checked
	}
	if dense {
		modes = append(modes, FallbackAlways)
	}
	m, err := New(dev, Config{Heads: h, Layers: 1, Slots: batch, Capacity: n, Policy: p.WithFallback(modes[0]), Measure: MeasureNever})
	if err != nil {
		return StepPoint{}, err
	}
	defer func() { err = errors.Join(err, m.Release()) }()
	rng := rand.New(rand.NewPCG(seed, 0x5eed))
	k, q1 := topicKeys(rng, h, n)
	v := normalHalves(rng, h.KV*n*h.Dim)
	var q []float32
	for s := range batch {
		if err := m.Prefill(s, 0, k, v, n); err != nil {
			return StepPoint{}, err
		}
		q = append(q, q1...)
	}
	pt := StepPoint{Tokens: n, DenseCost: h.DenseCost(n)}
	if policy {
		for range 2 {
			if _, err := m.Attend(0, q); err != nil {
				return StepPoint{}, err
			}
		}
		choices, err := m.Choices(0)
		if err != nil {
			return StepPoint{}, err
		}
		pt.Share, pt.PolicyCost, pt.DenseCost = choices[0].Share, choices[0].PolicyCost, choices[0].DenseCost
	}
	// The clocks up first: they follow the load with a lag of about a
	// second.
	if err := sparse.WarmUp(dev, measureClocks); err != nil {
		return StepPoint{}, err
	}
	us, err := m.TimeFallbacks(0, q, modes, measureReps)
	if err != nil {
		return StepPoint{}, err
	}
	for i := range us {
		us[i] /= float64(batch)
	}
	if policy {
		pt.PolicyUs = us[0]
	}
	if dense {
		pt.DenseUs = us[len(us)-1]
	}
	if math.IsNaN(pt.PolicyUs+pt.DenseUs) || (policy && pt.PolicyUs <= 0) || (dense && pt.DenseUs <= 0) {
		return StepPoint{}, fmt.Errorf("timed %v µs for the step and %v µs for dense attention", pt.PolicyUs, pt.DenseUs)
	}
	return pt, nil
}
