// Package sparsetest is a conformance suite for the decode steps of
// package sparse. A policy describes itself in a Policy: how to make its
// step over a filled layer, the float64 reference of a step's output and,
// where it has them, its counters, its scratch and its batches. Run (or
// RunOn) then checks, on fresh generated layers of every length the policy
// names (the last one also for determinism, the step after refused input
// and release), what every step must do:
//
//   - every output element is written: the output is poisoned with NaN
//     before the checked step, and so is the policy's scratch;
//   - the output matches the reference, per query head, within the
//     policy's tolerance, the first mismatches reported;
//   - the counters are back at their idle value (0) after a step;
//   - a second step made over the same layer and given the same queries
//     writes a bit-identical output (determinism);
//   - refused input (a query with NaN, a query of the wrong length) is
//     refused with an error and leaves the step as it was: the output is
//     unchanged and the next step matches, bit for bit, that of a step
//     that saw no refused input;
//   - a sequence batched with others writes what it writes alone, within
//     a tenth of the policy's tolerance, where the policy batches;
//   - Release reports a second release, and every call after it returns
//     vk.ErrReleased, none panics.
//
// Each step checked runs after a step for another query (−2 times the
// checked one, so its scores and their order differ), so that state a
// step leaves behind for the next (counters, extremes, accumulated
// attention) is exercised.
package sparsetest

import (
	"errors"
	"fmt"
	"math"
	"math/rand"
	"testing"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/vk/vktest"
	"github.com/vksparse/vksparse/workload"
)

// Step is a policy's decode step for one sequence, as the suite drives it.
// sparse.Step, sparse.TacticStep, sparse.LuKAStep and sparse.DensePlan
// (of one sequence) are Steps.
type Step interface {
	// SetQuery uploads the queries, [Hq][D], or refuses them and leaves
	// the step as it was.
	SetQuery(q []float32) error
	// Record appends the step for the uploaded queries to c.
	Record(c *vk.Commands) error
	// Attend runs a step for q and returns the output, [Hq][D].
	Attend(q []float32) ([]float32, error)
	// OutputRange returns where the step writes its output.
	OutputRange() vk.Range
	// Release frees the step; a second Release returns vk.ErrReleased.
	Release() error
}

// Batch is several sequences' steps run together.
type Batch interface {
	// Attend runs a batched step for q, [B][Hq][D], and returns the
	// outputs, [B][Hq][D].
	Attend(q []float32) ([]float32, error)
	// Release frees the batch and its steps.
	Release() error
}

// Inputs is one sequence's layer, filled with a generated trace's tokens,
// as a policy's constructor and reference see it.
type Inputs struct {
	Dev   *vk.Device
	Dense *sparse.Dense
	Heads sparse.Heads
	Layer *kvcache.Layer
	// N is the tokens the layer holds; K and V are its keys and values,
	// [KV][N][D], the fp16 rows in float64, in the order of the trace
	// (token ids, whatever order a policy stores them in).
	N    int
	K, V []float64
	// Scale is the logits' scale 1/√D.
	Scale float64
	// Query is the trace's decode query, [Hq][D]: the query checked.
	Query []float32
	// Seed is the trace's seed, logged so that a failure can be replayed.
	Seed int64
	// Prepared is what the policy's Prepare returned for this layer.
	Prepared any
}

// KV returns KV head g's keys and values, [N][D] each.
func (in *Inputs) KV(g int) (keys, values []float64) {
	w := in.N * in.Heads.Dim
	return in.K[g*w : (g+1)*w], in.V[g*w : (g+1)*w]
}

// QueryHeads returns the queries of KV head g's query heads in float64.
func (in *Inputs) QueryHeads(q []float32, g int) [][]float64 {
	return in.Heads.GroupQueries(q, g)
}

// Policy describes a policy's step to the suite. New and Reference are
// required; the rest are optional.
type Policy struct {
	// Heads are the step's heads (zero: 8 query heads, 2 KV heads, D 64).
	Heads sparse.Heads
	// Lengths are the tokens of the layers checked; the last one fills its
	// layer to capacity, the others leave a few rows free. Use odd lengths
	// and edge ones (one token, one past a page or a workgroup).
	Lengths []int
	// Prepare, when set, readies a filled layer for the policy once,
	// before steps are made over it (clusters and reorders it, say); what
	// it returns is in.Prepared, released (where it has a Release() error)
	// when the layer's checks end.
	Prepare func(in *Inputs) (any, error)
	// New makes a step over in.Layer.
	New func(in *Inputs) (Step, error)
	// Reference returns the float64 output, [Hq][D], of the step s that
	// just ran for q (it may read s's selection back).
	Reference func(in *Inputs, s Step, q []float32) ([]float64, error)
	// Tolerance is the largest relative error per query head against the
	// reference, ‖got − want‖ / ‖want‖ (zero: 1e-3).
	Tolerance float64
	// Idle returns the ranges of s, uint32 words, that hold 0 between
	// steps (arrival counters, extremes).
	Idle func(s Step) []vk.Range
	// Scratch returns ranges of s that a step writes before it reads them
	// (logits, partials): poisoned with NaN before the checked step.
	Scratch func(s Step) []vk.Range
	// Batch batches steps made by New over distinct layers.
	Batch func(dense *sparse.Dense, steps []Step) (Batch, error)
}

// defaultHeads are the heads of a Policy that names none.
var defaultHeads = sparse.Heads{Query: 8, KV: 2, Dim: 64}

// spare is the rows a layer keeps free, but for the last length's.
const spare = 13

// Run checks the policy p's steps (see the package comment) on a device
// of the environment's choosing (vktest.Open) with kernels of its own.
func Run(t *testing.T, p Policy) {
	t.Helper()
	if p.Heads == (sparse.Heads{}) {
		p.Heads = defaultHeads
	}
	dev := vktest.Open(t)
	dense, err := sparse.NewDense(dev, p.Heads)
	if err != nil {
		t.Fatalf("dense kernels: %v", err)
	}
	defer dense.Release()
	RunOn(t, dev, dense, p)
}

// RunOn checks the policy p's steps (see the package comment) on dev with
// the kernels dense, of p's heads, made on dev: several policies over one set of kernels
// compile the shared ones once. Each length runs in a subtest of its own;
// the last one's also checks determinism, the steps after refused input
// and release; then the batches run.
func RunOn(t *testing.T, dev *vk.Device, dense *sparse.Dense, p Policy) {
	t.Helper()
	if p.New == nil || p.Reference == nil || len(p.Lengths) == 0 {
		t.Fatal("sparsetest: a Policy needs New, Reference and Lengths")
	}
	if p.Heads == (sparse.Heads{}) {
		p.Heads = defaultHeads
	}
	if p.Heads != dense.Heads() {
		t.Fatalf("sparsetest: kernels of heads %+v for a policy of %+v", dense.Heads(), p.Heads)
	}
	if p.Tolerance == 0 {
		p.Tolerance = 1e-3
	}
	for i, n := range p.Lengths {
		capacity, last := n+spare, i == len(p.Lengths)-1
		if last {
			capacity = n
		}
		t.Run(fmt.Sprintf("n%d_cap%d", n, capacity), func(t *testing.T) {
			checkStep(t, p, newInputs(t, p, dev, dense, n, capacity), last)
		})
	}
	if p.Batch != nil {
		t.Run("batch", func(t *testing.T) { checkBatch(t, p, dev, dense) })
	}
}

// newInputs fills a fresh layer of capacity rows with n tokens of a
// generated trace of a random seed and runs p's Prepare over it; the layer
// and what Prepare made are released when t ends.
func newInputs(t *testing.T, p Policy, dev *vk.Device, dense *sparse.Dense, n, capacity int) *Inputs {
	t.Helper()
	h := p.Heads
	cfg := workload.DefaultConfig(n)
	cfg.KVHeads, cfg.QHeads, cfg.HeadDim, cfg.Queries, cfg.Seed = h.KV, h.Query, h.Dim, 1, rand.Int63()
	tr, err := workload.Generate(cfg)
	must(t, err, "generating a layer")
	layer, err := kvcache.NewLayer(dev, h.KV, h.Dim, capacity)
	must(t, err, "a layer")
	t.Cleanup(func() { layer.Release() })
	must(t, layer.Prefill(tr.K, tr.V, n), "filling the layer")
	in := &Inputs{Dev: dev, Dense: dense, Heads: h, Layer: layer, N: n,
		K: sparse.HalvesToFloat64(tr.K), V: sparse.HalvesToFloat64(tr.V), Scale: 1 / math.Sqrt(float64(h.Dim)),
		Query: tr.Query(0), Seed: cfg.Seed}
	t.Logf("%d tokens of capacity %d, trace seed %d", n, capacity, cfg.Seed)
	if p.Prepare != nil {
		in.Prepared, err = p.Prepare(in)
		must(t, err, "preparing the layer")
		if r, ok := in.Prepared.(interface{ Release() error }); ok {
			t.Cleanup(func() {
				if err := r.Release(); err != nil {
					t.Errorf("releasing what Prepare made: %v", err)
				}
			})
		}
	}
	return in
}

// other returns −2·q: a query whose scores, and their order, differ.
func other(q []float32) []float32 {
	o := make([]float32, len(q))
	for i, x := range q {
		o[i] = -2 * x
	}
	return o
}

// checkStep runs a step over in's layer and checks it against the
// reference, its counters and the refusal of bad input; with twin, it runs
// a second step through the same queries and compares the two bit for
// bit, then releases the first and checks that it refuses every call.
func checkStep(t *testing.T, p Policy, in *Inputs, twin bool) {
	q := in.Query
	s, err := p.New(in)
	must(t, err, "making the step")
	released := false
	defer func() {
		if !released {
			must(t, s.Release(), "releasing the step")
		}
	}()
	_, err = s.Attend(other(q))
	must(t, err, "the step before")
	poison(t, in.Dev, s, p.Scratch)
	got, err := s.Attend(q)
	must(t, err, "the checked step")
	requireWritten(t, got, "the checked step")
	if p.Idle != nil {
		requireIdle(t, in.Dev, p.Idle(s))
	}
	want, err := p.Reference(in, s, q)
	must(t, err, "the reference")
	requireClose(t, want, got, in.Heads.Dim, p.Tolerance, "against the reference")

	// Refused input leaves the step as it was.
	nan := append([]float32(nil), q...)
	nan[len(nan)/3] = float32(math.NaN())
	for what, bad := range map[string][]float32{"NaN": nan, "short": q[:len(q)-1], "long": append(append([]float32(nil), q...), 1)} {
		if err := s.SetQuery(bad); err == nil {
			t.Errorf("SetQuery took a %s query", what)
		}
		if _, err := s.Attend(bad); err == nil {
			t.Errorf("Attend took a %s query", what)
		}
	}
	after := readOutput(t, s)
	requireIdentical(t, got, after, "the output after refused queries")
	if !twin {
		return
	}
	replay := replayStep(t, in.Dev, s)

	// A twin through the same queries: bit-identical outputs.
	second, err := p.New(in)
	must(t, err, "making a second step")
	defer func() { must(t, second.Release(), "releasing the second step") }()
	_, err = second.Attend(other(q))
	must(t, err, "the second step's step before")
	again, err := second.Attend(q)
	must(t, err, "the second step")
	requireIdentical(t, got, again, "a second step for the same queries")
	requireIdentical(t, replayStep(t, in.Dev, second), replay, "the next step after refused queries")

	released = true
	must(t, s.Release(), "releasing the step")
	checkReleased(t, in.Dev, s, q)
}

// replayStep runs s again for the queries it holds and returns the output.
func replayStep(t *testing.T, dev *vk.Device, s Step) []float32 {
	t.Helper()
	must(t, dev.Do(s.Record), "running the step again")
	return readOutput(t, s)
}

// checkBatch runs two sequences of the policy's last lengths, each alone
// and in a batch, through the same queries, and compares each sequence's
// batched output with its output alone.
func checkBatch(t *testing.T, p Policy, dev *vk.Device, dense *sparse.Dense) {
	lengths := p.Lengths
	if len(lengths) > 2 {
		lengths = lengths[len(lengths)-2:]
	}
	var alone []float32
	var batched []Step
	var qs, others []float32
	defer func() {
		for _, s := range batched {
			s.Release()
		}
	}()
	for _, n := range lengths {
		in := newInputs(t, p, dev, dense, n, n+spare)
		q := in.Query
		s, err := p.New(in)
		must(t, err, "making a step")
		_, err = s.Attend(other(q))
		must(t, err, "a step alone")
		poison(t, dev, s, nil)
		out, err := s.Attend(q)
		must(t, err, "a step alone")
		requireWritten(t, out, "a step alone")
		must(t, s.Release(), "releasing a step")
		alone, qs, others = append(alone, out...), append(qs, q...), append(others, other(q)...)
		s, err = p.New(in)
		must(t, err, "making a step to batch")
		batched = append(batched, s)
	}
	b, err := p.Batch(dense, batched)
	batched = nil // the batch owns them, or released them
	must(t, err, "the batch")
	defer func() { must(t, b.Release(), "releasing the batch") }()
	_, err = b.Attend(others)
	must(t, err, "the batched step before")
	got, err := b.Attend(qs)
	must(t, err, "the batched step")
	requireWritten(t, got, "the batch")
	want := make([]float64, len(alone))
	for i, x := range alone {
		want[i] = float64(x)
	}
	requireClose(t, want, got, p.Heads.Dim, p.Tolerance/10, "batched against alone")
}

// checkReleased checks that a second release of the released step s, and
// every call after, return vk.ErrReleased without a panic.
func checkReleased(t *testing.T, dev *vk.Device, s Step, q []float32) {
	for what, call := range map[string]func() error{
		"Release":  s.Release,
		"SetQuery": func() error { return s.SetQuery(q) },
		"Attend":   func() error { _, err := s.Attend(q); return err },
		"Record":   func() error { return dev.Do(s.Record) },
	} {
		err := callSafely(call)
		if !errors.Is(err, vk.ErrReleased) {
			t.Errorf("%s after Release: %v, want vk.ErrReleased", what, err)
		}
	}
	if err := callSafely(func() error { s.OutputRange(); return nil }); err != nil {
		t.Errorf("OutputRange after Release: %v", err)
	}
}

// callSafely returns what call returns, or its panic as an error.
func callSafely(call func() error) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("panic: %v", r)
		}
	}()
	return call()
}

// poison fills s's output and scratch with NaN.
func poison(t *testing.T, dev *vk.Device, s Step, scratch func(Step) []vk.Range) {
	t.Helper()
	ranges := []vk.Range{s.OutputRange()}
	if scratch != nil {
		ranges = append(ranges, scratch(s)...)
	}
	nan := math.Float32bits(float32(math.NaN()))
	must(t, dev.Run(func(c *vk.Commands) {
		for _, r := range ranges {
			c.Fill(r, nan)
		}
	}), "poisoning the output")
}

// readOutput reads s's output back.
func readOutput(t *testing.T, s Step) []float32 {
	t.Helper()
	r := s.OutputRange()
	out := make([]float32, r.Size/4)
	must(t, r.Buffer.ReadFloat32(r.Offset, out), "reading the output")
	return out
}

// requireIdle fails unless every uint32 word of the ranges is 0.
func requireIdle(t *testing.T, dev *vk.Device, ranges []vk.Range) {
	t.Helper()
	for i, r := range ranges {
		w := make([]uint32, r.Size/4)
		must(t, r.Buffer.ReadUint32(r.Offset, w), "reading counters")
		var bad []string
		for j, x := range w {
			if x != 0 && len(bad) < 5 {
				bad = append(bad, fmt.Sprintf("[%d] = %d", j, x))
			}
		}
		if len(bad) > 0 {
			t.Errorf("idle range %d (%d words) not back at 0 after a step: %v", i, len(w), bad)
		}
	}
}

// requireWritten fails at the first elements of got that are not finite
// (left poisoned, or computed so).
func requireWritten(t *testing.T, got []float32, what string) {
	t.Helper()
	var bad []int
	count := 0
	for i, x := range got {
		if math.IsNaN(float64(x)) || math.IsInf(float64(x), 0) {
			if len(bad) < 5 {
				bad = append(bad, i)
			}
			count++
		}
	}
	if count > 0 {
		t.Fatalf("%s: %d of %d output elements not finite (unwritten?), first at %v", what, count, len(got), bad)
	}
}

// requireIdentical fails at the first elements where got and want differ
// in their bits.
func requireIdentical(t *testing.T, want, got []float32, what string) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: %d elements, want %d", what, len(got), len(want))
	}
	var bad []string
	count := 0
	for i := range want {
		if math.Float32bits(want[i]) != math.Float32bits(got[i]) {
			if len(bad) < 5 {
				bad = append(bad, fmt.Sprintf("[%d] %g, was %g", i, got[i], want[i]))
			}
			count++
		}
	}
	if count > 0 {
		t.Fatalf("%s: %d of %d elements differ, first %v", what, count, len(want), bad)
	}
}

// requireClose fails unless, per row of dim elements (a query head),
// ‖got − want‖ / ‖want‖ < tol; it reports the first mismatching elements.
func requireClose(t *testing.T, want []float64, got []float32, dim int, tol float64, what string) {
	t.Helper()
	if err := sparse.CompareHeads(want, got, dim, tol); err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

// must fails t with what when err is not nil.
func must(t *testing.T, err error, what string) {
	t.Helper()
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}
