// Package soak runs decode.Models for a long time under a random mix of
// operations and checks them against a float64 model of what they should
// hold.
//
// Each step draws one operation: a prefill of a random length into a slot
// that is idle (sometimes of only some of its layers, leaving it partly
// prefilled, completed by a later prefill), a burst of appends to an
// active slot (Append layer by layer or AppendAll; bursts cross the
// reclustering boundaries of the clustered layers), an attention of a
// layer's random queries (by Attend, or by SetQuery and Record into a
// command buffer of the soak's), a free of a slot, or a drain that frees
// every slot. Every model (one per Config.Layers policies) receives the same
// operations, and the float64 model records what each slot's layers
// should store: the fp16 keys and values given, in token order.
//
// Every CheckEvery steps, and after the last, a check reads every
// model's caches back in sequence order (decode.Model.ReadSequence) and
// compares them with the float64 model bit for bit; it compares the slots' states, attends every layer and compares each
// query head's output with float64 dense attention over the stored tokens
// (see Policy for the tolerance), requires the device to hold exactly
// the memory the models' Memory reports, and the validation layer, when
// on, to have reported no error. Between checks, outputs must be finite.
//
// Device memory: a warm-up fills every slot to the capacity and attends
// every layer, so that the memory the models keep for their largest need
// (the attention workspace, the K-means scratch, which grow and stay) is
// taken; the models then drain. Every later drain must find the device
// holding exactly what it held after the warm-up's, and releasing the
// models must give back everything they took.
package soak

import (
	"errors"
	"fmt"
	"math"
	"math/rand"
	"slices"
	"time"

	"github.com/vksparse/vksparse/decode"
	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/vk"
)

// ErrCheck is what a failed check wraps: a cache, a slot's state, an
// output or the device's memory differs from the float64 model, or the
// validation layer reported an error.
var ErrCheck = errors.New("soak: check failed")

// RelTol is the relative error (‖o − ref‖ / ‖ref‖ per query head) allowed
// to a policy that attends every stored token: fp16 caches attended in
// float32 against float64, as decode's tests allow.
const RelTol = 1e-3

// Policy is a policy soaked, and how far its output may lie from dense
// attention.
//
// A policy attending a subset S of the stored tokens with the softmax
// renormalised over S gives o_S, and dense attention is o = m·o_S +
// (1−m)·o_R, where m is S's share of the softmax mass and o_R the
// attention of the rest; so ‖o_S − o‖ = (1−m)·‖o_S − o_R‖ ≤ 2(1−m)·max‖v‖
// over the head's stored values. A query head passes when ‖o_S − o‖ ≤
// RelTol·‖o‖ + 2(1−Mass)·max‖v‖, and each coordinate of o_S lies within
// the range of that coordinate over the stored values (widened by RelTol
// of their largest magnitude): attention is a convex combination of them,
// whatever it selects.
type Policy struct {
	Name   string
	Policy decode.Policy
	// Mass is the least share of the softmax mass that the policy's
	// selection holds: 1 for one that attends every token (Dense; Tactic
	// at P = 1, whose budget is every token; a positional policy whose
	// budget passes the capacity), 0 where nothing is claimed (only the
	// range check binds).
	Mass float64
}

// Config is a soak: the models' shape, the policies, the operations.
type Config struct {
	Heads    sparse.Heads
	Layers   int // per model
	Slots    int
	Capacity int // tokens per sequence
	// MaxPrefill is the longest prefill drawn (0: Capacity/2); the
	// shortest is the least that every policy takes.
	MaxPrefill int
	// Policies are soaked Layers at a time: model i's layer l takes
	// Policies[(i·Layers + l) mod len(Policies)].
	Policies   []Policy
	Steps      int
	Seed       int64
	CheckEvery int // a full check every this many steps, and after the last
	// Duration, when positive, ends the soak at the first step that
	// finishes past it (checked like a last step), even short of Steps.
	Duration time.Duration

	// tamper, when set (tests), may change the float64 model after each
	// step, so that a check must fail.
	tamper func(step int, s *state)
}

// recluster is the reclustering interval of DefaultPolicies: appends
// cross it often.
const recluster = 16

// maxBurst is the most tokens one append operation adds to a slot.
const maxBurst = 12

// DefaultPolicies returns the policies DefaultConfig soaks for a capacity:
// dense; Tactic at P = 1 and at P = 0.9; Double-P; Quest, StreamingLLM and
// H2O with budgets past the capacity (they attend every token) and
// StreamingLLM with 32. Clustered and positional policies index their
// layers every 16 tokens, and K-means makes clusters of 8 tokens.
//
// Tactic at P = 0.9 is held to a Mass of 0.8, a tenth below its P: its
// budget comes from a fit of the attention distribution (sparse.TacticFit),
// an estimate of the mass rather than a bound on it. Double-P attends some
// clusters by their mean value, and StreamingLLM with a budget chooses by
// position: no mass is claimed for them (the range check binds).
func DefaultPolicies(capacity int) []Policy {
	opts := sparse.TacticDecoderOptions{Recluster: recluster, KMeans: sparse.KMeansOptions{AvgClusterSize: 8}}
	return []Policy{
		{"dense", decode.Dense(), 1},
		{"tactic P=1", decode.Tactic(1, opts), 1},
		{"tactic P=0.9", decode.Tactic(0.9, opts), 0.8},
		{"double-p", decode.DoubleP(sparse.DefaultDoubleP(), opts), 0},
		{"quest all", decode.Quest(capacity).WithRecluster(recluster), 1},
		{"streaming all", decode.StreamingLLM(capacity).WithRecluster(recluster), 1},
		{"h2o all", decode.H2O(capacity).WithRecluster(recluster), 1},
		{"streaming 32", decode.StreamingLLM(32).WithRecluster(recluster), 0},
	}
}

// DefaultConfig returns a small soak: 8 slots × 4 layers of 4 query heads,
// 2 KV heads of 64, 256 tokens per sequence, DefaultPolicies (two
// models), steps steps, a check every 25.
func DefaultConfig(steps int, seed int64) Config {
	return Config{
		Heads: sparse.Heads{Query: 4, KV: 2, Dim: 64}, Layers: 4, Slots: 8, Capacity: 256,
		Policies: DefaultPolicies(256), Steps: steps, Seed: seed, CheckEvery: 25,
	}
}

// Report is what a soak did and saw.
type Report struct {
	Steps int   `json:"steps"`
	Seed  int64 `json:"seed"`
	// Models is how many decode.Models ran side by side.
	Models int `json:"models"`
	// Operations counts the steps by kind: prefill, append, attend,
	// free, drain.
	Operations map[string]int `json:"operations"`
	// Appended is the tokens appended; Reclusters the times a clustered
	// layer's tail reached the reclustering interval (summed over
	// layers and models).
	Appended   int `json:"tokens_appended"`
	Reclusters int `json:"recluster_boundaries"`
	Checks     int `json:"checks"`
	// Validating says whether the validation layer was on;
	// ValidationErrors is the errors it reported.
	Validating       bool   `json:"validating"`
	ValidationErrors uint64 `json:"validation_errors"`
	// Device memory the soak's models held (dev.Allocated above what it
	// was before Run): after construction, idle after the warm-up, at
	// most, after the last drain, after release.
	ConstructedBytes uint64 `json:"constructed_bytes"`
	WarmBytes        uint64 `json:"warm_bytes"`
	PeakBytes        uint64 `json:"peak_bytes"`
	FinalBytes       uint64 `json:"final_bytes"`
	ReleasedBytes    uint64 `json:"released_bytes"`
	// Policies is the worst error of each policy against dense attention.
	Policies    []PolicyReport `json:"policies"`
	WallSeconds float64        `json:"wall_seconds"`
	StepsPerSec float64        `json:"steps_per_second"`
}

// PolicyReport is one policy's outputs against float64 dense attention.
type PolicyReport struct {
	Name string  `json:"name"`
	Mass float64 `json:"mass"`
	// Heads is the query heads' outputs checked.
	Heads int `json:"heads_checked"`
	// WorstRelative is the largest ‖o − ref‖ / ‖ref‖; WorstShare the
	// largest share of its tolerance an error took (below 1 passes).
	WorstRelative float64 `json:"worst_relative_error"`
	WorstShare    float64 `json:"worst_share_of_tolerance"`
}

// Validate refuses a config that cannot run, saying why.
func (cfg Config) Validate() error {
	_, err := cfg.validate()
	return err
}

// validate refuses a config that cannot run, and fills its defaults.
func (cfg Config) validate() (Config, error) {
	if err := cfg.Heads.Validate(); err != nil {
		return cfg, fmt.Errorf("soak: %w", err)
	}
	if cfg.MaxPrefill == 0 {
		cfg.MaxPrefill = cfg.Capacity / 2
	}
	least := cfg.minPrefill()
	switch {
	case cfg.Layers < 1 || cfg.Slots < 1:
		return cfg, fmt.Errorf("soak: %d layers and %d slots: want at least 1 each", cfg.Layers, cfg.Slots)
	case len(cfg.Policies) == 0:
		return cfg, fmt.Errorf("soak: no policy to soak")
	case cfg.MaxPrefill < least || cfg.MaxPrefill > cfg.Capacity:
		return cfg, fmt.Errorf("soak: prefills of at most %d tokens in a capacity of %d: the policies need prefills of %d to %d", cfg.MaxPrefill, cfg.Capacity, least, cfg.Capacity)
	case cfg.Steps < 0:
		return cfg, fmt.Errorf("soak: %d steps", cfg.Steps)
	case cfg.CheckEvery < 1:
		return cfg, fmt.Errorf("soak: a check every %d steps: want at least 1", cfg.CheckEvery)
	}
	for _, p := range cfg.Policies {
		if !(p.Mass >= 0 && p.Mass <= 1) {
			return cfg, fmt.Errorf("soak: policy %s: mass %v outside [0, 1]", p.Name, p.Mass)
		}
	}
	return cfg, nil
}

// minPrefill is the least prefill every policy takes: past the sinks of
// a clustered one, past the baseline layout's sinks and window of any
// other sparse one.
func (cfg Config) minPrefill() int {
	least := 1
	for _, p := range cfg.Policies {
		switch {
		case p.Policy.Clustered():
			opts, _ := p.Policy.Options().Resolve()
			least = max(least, opts.Sinks+1)
		case !p.Policy.IsDense():
			least = max(least, sparse.BaselineSinks+sparse.BaselineWindow+1)
		}
	}
	return least
}

// models returns how many models the policies take.
func (cfg Config) models() int { return (len(cfg.Policies) + cfg.Layers - 1) / cfg.Layers }

// policy returns the index in cfg.Policies of model i's layer l.
func (cfg Config) policy(i, l int) int { return (i*cfg.Layers + l) % len(cfg.Policies) }

// runner is one soak under way.
type runner struct {
	cfg    Config
	dev    *vk.Device
	rng    *rand.Rand
	models []*decode.Model
	cmd    *vk.Commands // what record records into
	st     *state
	rep    *Report
	before uint64 // dev.Allocated() before the models
	errs   uint64 // validation errors before Run
	step   int    // the step under way (-1: the warm-up)
}

// Run soaks cfg's policies on dev and reports what it did; progress, when
// not nil, is told after each step. The error says what failed first
// (errors.Is(err, ErrCheck) for a check, otherwise the call that failed);
// the report holds what ran until then.
func Run(dev *vk.Device, cfg Config, progress func(done, total int)) (Report, error) {
	cfg, err := cfg.validate()
	if err != nil {
		return Report{}, err
	}
	start := time.Now()
	r := &runner{cfg: cfg, dev: dev, rng: rand.New(rand.NewSource(cfg.Seed)), step: -1,
		st:  newState(cfg.Slots, cfg.Layers, cfg.Heads.KV, cfg.Heads.Dim),
		rep: &Report{Seed: cfg.Seed, Models: cfg.models(), Operations: map[string]int{}, Validating: dev.Validating()}}
	for _, p := range cfg.Policies {
		r.rep.Policies = append(r.rep.Policies, PolicyReport{Name: p.Name, Mass: p.Mass})
	}
	r.before = dev.Allocated()
	_, r.errs = dev.ValidationMessages()
	err = r.run(progress)
	var errs []error
	if r.cmd != nil {
		errs = append(errs, r.cmd.Release())
	}
	for _, m := range r.models {
		errs = append(errs, m.Release())
	}
	if err == nil {
		err = errors.Join(errs...)
	}
	r.rep.ReleasedBytes = r.held()
	if err == nil && r.rep.ReleasedBytes != 0 {
		err = fmt.Errorf("%w: the released models still hold %d bytes of device memory", ErrCheck, r.rep.ReleasedBytes)
	}
	r.rep.WallSeconds = time.Since(start).Seconds()
	if r.rep.WallSeconds > 0 {
		r.rep.StepsPerSec = float64(r.rep.Steps) / r.rep.WallSeconds
	}
	return *r.rep, err
}

// held returns the device memory allocated since Run began.
func (r *runner) held() uint64 {
	a := r.dev.Allocated()
	if a < r.before {
		return 0
	}
	return a - r.before
}

func (r *runner) run(progress func(done, total int)) error {
	cfg := r.cfg
	var err error
	if r.cmd, err = r.dev.NewCommands(); err != nil {
		return fmt.Errorf("soak: %w", err)
	}
	for i := range cfg.models() {
		layout := make([]decode.Policy, cfg.Layers)
		for l := range layout {
			layout[l] = cfg.Policies[cfg.policy(i, l)].Policy
		}
		// The policies themselves are soaked: at the soak's small sizes the
		// dense fallback would attend most layers densely.
		m, err := decode.New(r.dev, decode.Config{Heads: cfg.Heads, Layers: cfg.Layers, Slots: cfg.Slots, Capacity: cfg.Capacity, Layout: layout, Fallback: decode.FallbackNever})
		if err != nil {
			return fmt.Errorf("soak: model %d: %w", i, err)
		}
		r.models = append(r.models, m)
	}
	r.rep.ConstructedBytes = r.held()
	if err := r.warmUp(); err != nil {
		return err
	}
	start := time.Now()
	for r.step = 0; r.step < cfg.Steps; r.step++ {
		if err := r.operate(); err != nil {
			return err
		}
		last := r.step == cfg.Steps-1 || (cfg.Duration > 0 && time.Since(start) >= cfg.Duration)
		r.rep.Steps++
		r.rep.PeakBytes = max(r.rep.PeakBytes, r.held())
		if cfg.tamper != nil {
			cfg.tamper(r.step, r.st)
		}
		if (r.step+1)%cfg.CheckEvery == 0 || last {
			if err := r.check(); err != nil {
				return err
			}
		}
		if progress != nil {
			progress(r.step+1, cfg.Steps)
		}
		if last {
			break
		}
	}
	if err := r.drain(); err != nil {
		return err
	}
	r.rep.FinalBytes = r.held()
	return nil
}

// warmUp fills every slot to the capacity, checks, attends every layer
// and drains: the models then hold the scratch of their largest need.
func (r *runner) warmUp() error {
	for s := range r.cfg.Slots {
		if err := r.prefill(s, r.cfg.Capacity, r.cfg.Layers); err != nil {
			return err
		}
	}
	if err := r.check(); err != nil {
		return err
	}
	r.rep.PeakBytes = r.held()
	if err := r.drain(); err != nil {
		return err
	}
	r.rep.WarmBytes = r.held()
	return nil
}

// fail wraps err with where the soak stood.
func (r *runner) fail(what string, err error) error {
	if r.step < 0 {
		return fmt.Errorf("soak: warm-up: %s: %w", what, err)
	}
	return fmt.Errorf("soak: step %d: %s: %w", r.step, what, err)
}

// mismatch is a failed check.
func (r *runner) mismatch(format string, args ...any) error {
	return r.fail("check", fmt.Errorf("%w: %s", ErrCheck, fmt.Sprintf(format, args...)))
}

// operate runs one random operation.
func (r *runner) operate() error {
	var open, busy, growing []int // idle or partly prefilled; holding something; active and not full
	active := r.st.active()
	for s := range r.cfg.Slots {
		if r.st.prefilled(s) < r.cfg.Layers {
			open = append(open, s)
		}
		if r.st.prefilled(s) > 0 {
			busy = append(busy, s)
		}
	}
	for _, s := range active {
		if r.st.tokens(s, 0) < r.cfg.Capacity {
			growing = append(growing, s)
		}
	}
	x := r.rng.Float64()
	switch {
	case len(open) > 0 && (x < 0.12 || len(busy) == 0):
		r.rep.Operations["prefill"]++
		s := open[r.rng.Intn(len(open))]
		n := r.st.slotPrefill(s)
		if n == 0 {
			least := r.cfg.minPrefill()
			n = least + r.rng.Intn(r.cfg.MaxPrefill-least+1)
		}
		layers := r.cfg.Layers - r.st.prefilled(s)
		if layers > 1 && r.rng.Float64() < 0.15 {
			layers = 1 + r.rng.Intn(layers-1) // leave it partly prefilled
		}
		return r.prefill(s, n, layers)
	case len(busy) > 0 && x < 0.21:
		r.rep.Operations["free"]++
		return r.free(busy[r.rng.Intn(len(busy))])
	case len(busy) > 0 && x < 0.22:
		r.rep.Operations["drain"]++
		return r.drain()
	case len(growing) > 0 && x < 0.6:
		r.rep.Operations["append"]++
		s := growing[r.rng.Intn(len(growing))]
		count := min(1+r.rng.Intn(maxBurst), r.cfg.Capacity-r.st.tokens(s, 0))
		return r.append(s, count)
	case len(active) > 0:
		r.rep.Operations["attend"]++
		return r.attend(false)
	}
	r.rep.Operations["drain"]++
	return r.drain()
}

// halves returns n random fp16 values, uniform in [-1, 1).
func (r *runner) halves(n int) ([]uint16, error) {
	f := make([]float32, n)
	for i := range f {
		f[i] = 2*r.rng.Float32() - 1
	}
	return kvcache.ToHalves(f)
}

// prefill prefills n tokens into the first layers of slot's layers not
// yet prefilled.
func (r *runner) prefill(slot, n, layers int) error {
	for l := range r.cfg.Layers {
		if layers == 0 {
			break
		}
		if r.st.slots[slot][l] != nil {
			continue
		}
		layers--
		size := r.cfg.Heads.KV * n * r.cfg.Heads.Dim
		k, err := r.halves(size)
		if err != nil {
			return r.fail("prefill", err)
		}
		v, err := r.halves(size)
		if err != nil {
			return r.fail("prefill", err)
		}
		for i, m := range r.models {
			if err := m.Prefill(slot, l, k, v, n); err != nil {
				return r.fail(fmt.Sprintf("model %d: prefill of %d tokens into slot %d layer %d", i, n, slot, l), err)
			}
		}
		r.st.store(slot, l, k, v, n)
	}
	return nil
}

// append appends count tokens to an active slot, each by AppendAll or
// layer by layer, at random.
func (r *runner) append(slot, count int) error {
	cfg := r.cfg
	per := cfg.Heads.KV * cfg.Heads.Dim
	for range count {
		k, err := r.halves(cfg.Layers * per) // [Layers][KV][Dim]
		if err != nil {
			return r.fail("append", err)
		}
		v, err := r.halves(cfg.Layers * per)
		if err != nil {
			return r.fail("append", err)
		}
		all := r.rng.Intn(2) == 0
		for i, m := range r.models {
			if all {
				err = m.AppendAll(slot, k, v)
			} else {
				for l := 0; l < cfg.Layers && err == nil; l++ {
					err = m.Append(slot, l, k[l*per:(l+1)*per], v[l*per:(l+1)*per])
				}
			}
			if err != nil {
				return r.fail(fmt.Sprintf("model %d: append to slot %d", i, slot), err)
			}
		}
		for l := range cfg.Layers {
			r.st.store(slot, l, k[l*per:(l+1)*per], v[l*per:(l+1)*per], 1)
			r.rep.Reclusters += r.reclusteredAt(l, r.st.tokens(slot, l)-r.st.slots[slot][l].prefill)
		}
		r.rep.Appended++
	}
	return nil
}

// reclusteredAt returns how many models cluster layer l's tail once
// appended tokens have been appended to it.
func (r *runner) reclusteredAt(l, appended int) int {
	n := 0
	for i := range r.models {
		p := r.cfg.Policies[r.cfg.policy(i, l)].Policy
		if opts, _ := p.Options().Resolve(); p.Clustered() && appended%opts.Recluster == 0 {
			n++
		}
	}
	return n
}

// free frees slot in every model.
func (r *runner) free(slot int) error {
	for i, m := range r.models {
		if err := m.Free(slot); err != nil {
			return r.fail(fmt.Sprintf("model %d: free of slot %d", i, slot), err)
		}
	}
	r.st.free(slot)
	return nil
}

// drain frees every slot that holds something, then requires the device
// to hold what it held idle after the warm-up.
func (r *runner) drain() error {
	for s := range r.cfg.Slots {
		if r.st.prefilled(s) > 0 {
			if err := r.free(s); err != nil {
				return err
			}
		}
	}
	if r.step >= 0 {
		if held := r.held(); held != r.rep.WarmBytes {
			return r.mismatch("the drained models hold %d bytes of device memory, %d after the warm-up's drain", held, r.rep.WarmBytes)
		}
	}
	return nil
}

// attend attends layers (every one of them when checked, else one at
// random) of every model with random queries, by Attend or by SetQuery
// and Record at random; checked, it compares the outputs with dense
// attention, else requires them finite.
func (r *runner) attend(checked bool) error {
	cfg := r.cfg
	layers := []int{r.rng.Intn(cfg.Layers)}
	if checked {
		layers = make([]int, cfg.Layers)
		for l := range layers {
			layers[l] = l
		}
	}
	active := r.st.active()
	per := cfg.Heads.Query * cfg.Heads.Dim
	q := make([]float32, len(active)*per)
	for _, l := range layers {
		for i := range q {
			q[i] = 2*r.rng.Float32() - 1
		}
		record := r.rng.Intn(2) == 0
		for i, m := range r.models {
			var out []float32
			var err error
			if record {
				out, err = r.record(m, l, q)
			} else {
				out, err = m.Attend(l, q)
			}
			if err != nil {
				return r.fail(fmt.Sprintf("model %d: attention of layer %d", i, l), err)
			}
			if len(out) != len(q) {
				return r.mismatch("model %d layer %d: %d outputs for %d queries", i, l, len(out), len(q))
			}
			pi := cfg.policy(i, l)
			if !checked {
				for j, x := range out {
					if math.IsNaN(float64(x)) || math.IsInf(float64(x), 0) {
						return r.mismatch("model %d layer %d (%s): output %d is %v", i, l, cfg.Policies[pi].Name, j, x)
					}
				}
				continue
			}
			for b, s := range active {
				if err := r.compare(pi, s, l, q[b*per:(b+1)*per], out[b*per:(b+1)*per]); err != nil {
					return r.mismatch("model %d layer %d (%s) slot %d (%d tokens): %v", i, l, cfg.Policies[pi].Name, s, r.st.tokens(s, l), err)
				}
			}
		}
	}
	return nil
}

// record attends layer l of m through SetQuery and Record into the
// runner's own command buffer, and reads the output back.
func (r *runner) record(m *decode.Model, l int, q []float32) ([]float32, error) {
	if err := m.SetQuery(l, q); err != nil {
		return nil, err
	}
	if err := r.cmd.Begin(); err != nil {
		return nil, err
	}
	if err := m.Record(l, r.cmd); err != nil {
		return nil, errors.Join(err, r.cmd.End())
	}
	if err := r.cmd.End(); err != nil {
		return nil, err
	}
	if err := r.cmd.Submit(); err != nil {
		return nil, err
	}
	return m.ReadOutput(l)
}

// compare checks one slot's output of a layer (out, [Hq][D]) for queries
// q against float64 dense attention over the stored tokens, within policy
// pi's tolerance (Policy).
func (r *runner) compare(pi, slot, layer int, q, out []float32) error {
	h := r.cfg.Heads
	ls := r.st.slots[slot][layer]
	pol := &r.rep.Policies[pi]
	mass := r.cfg.Policies[pi].Mass
	for g := range h.KV {
		vr := valueBounds(ls.vf[g], h.Dim) // once for the group's heads
		for i, qh := range h.GroupQueries(q, g) {
			head := g*h.Group() + i
			ref, err := sparse.AttendRef(qh, ls.kf[g], ls.vf[g], h.Scale())
			if err != nil {
				return err
			}
			got := out[head*h.Dim : (head+1)*h.Dim]
			var num, den float64
			for d, x := range got {
				diff := float64(x) - ref[d]
				num += diff * diff
				den += ref[d] * ref[d]
				if slack := RelTol * vr.maxAbs; !(float64(x) >= vr.lo[d]-slack && float64(x) <= vr.hi[d]+slack) {
					return fmt.Errorf("head %d: output[%d] = %v outside the values' range [%v, %v]", head, d, x, vr.lo[d], vr.hi[d])
				}
			}
			errNorm, refNorm := math.Sqrt(num), math.Sqrt(den)
			tol := RelTol*refNorm + 2*(1-mass)*vr.maxNorm
			pol.Heads++
			pol.WorstRelative = max(pol.WorstRelative, errNorm/math.Max(refNorm, 1e-300))
			pol.WorstShare = max(pol.WorstShare, errNorm/tol)
			if !(errNorm <= tol) {
				return fmt.Errorf("head %d: ‖o − dense‖ = %.3g, tolerance %.3g (‖dense‖ = %.3g, mass %v)", head, errNorm, tol, refNorm, mass)
			}
		}
	}
	return nil
}

// valueRange is what bounds an attention output over some value rows:
// each coordinate's least and greatest value, the largest row norm and
// the largest magnitude.
type valueRange struct {
	lo, hi          []float64
	maxNorm, maxAbs float64
}

// valueBounds returns the valueRange of the rows of v (n×d).
func valueBounds(v []float64, d int) valueRange {
	vr := valueRange{lo: slices.Clone(v[:d]), hi: slices.Clone(v[:d])}
	for t := 0; t*d < len(v); t++ {
		var sq float64
		for i, x := range v[t*d : (t+1)*d] {
			vr.lo[i], vr.hi[i] = min(vr.lo[i], x), max(vr.hi[i], x)
			sq += x * x
			vr.maxAbs = max(vr.maxAbs, math.Abs(x))
		}
		vr.maxNorm = max(vr.maxNorm, math.Sqrt(sq))
	}
	return vr
}

// check compares every model with the float64 model: the slots' states,
// the caches read back, every layer's attention; and the validation
// layer's errors.
func (r *runner) check() error {
	r.rep.Checks++
	cfg := r.cfg
	want := r.st.active()
	for i, m := range r.models {
		if got := m.Active(); !slices.Equal(got, want) {
			return r.mismatch("model %d: active slots %v, want %v", i, got, want)
		}
		for s := range cfg.Slots {
			ss, err := m.Slot(s)
			if err != nil {
				return r.fail(fmt.Sprintf("model %d: slot %d", i, s), err)
			}
			if ss.Prefilled != r.st.prefilled(s) {
				return r.mismatch("model %d slot %d: %d layers prefilled, want %d", i, s, ss.Prefilled, r.st.prefilled(s))
			}
			for l := range cfg.Layers {
				if ss.Tokens[l] != r.st.tokens(s, l) {
					return r.mismatch("model %d slot %d layer %d: %d tokens, want %d", i, s, l, ss.Tokens[l], r.st.tokens(s, l))
				}
				ls := r.st.slots[s][l]
				if ls == nil {
					continue
				}
				k, v, err := m.ReadSequence(s, l)
				if err != nil {
					return r.fail(fmt.Sprintf("model %d: reading slot %d layer %d", i, s, l), err)
				}
				if err := ls.checkCache(k, v, cfg.Heads.KV, cfg.Heads.Dim); err != nil {
					return r.mismatch("model %d slot %d layer %d: %v", i, s, l, err)
				}
			}
		}
	}
	if len(want) > 0 {
		if err := r.attend(true); err != nil {
			return err
		}
	}
	var held uint64
	for i, m := range r.models {
		mem, err := m.Memory()
		if err != nil {
			return r.fail(fmt.Sprintf("model %d: memory", i), err)
		}
		held += mem.Caches + mem.Other
	}
	if held != r.held() {
		return r.mismatch("the models say they hold %d bytes of device memory, the device counts %d", held, r.held())
	}
	if msgs, errs := r.dev.ValidationMessages(); errs > r.errs {
		r.rep.ValidationErrors = errs - r.errs
		return r.mismatch("the validation layer reported %d errors: %v", errs-r.errs, msgs)
	}
	return nil
}
