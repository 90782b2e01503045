package decode

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
	"time"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/vk"
)

// Config is what a Model holds.
type Config struct {
	Heads    sparse.Heads // every layer's geometry
	Layers   int          // L
	Slots    int          // B: sequences held (and attended) at once
	Capacity int          // most tokens of one sequence, prefill and appends
	// Policy is every layer's policy, unless Layout gives each layer its
	// own: Layout, when set, has one policy per layer.
	Policy Policy
	Layout []Policy
	// Fallback is when a layer under a sparse policy attends a sequence
	// densely instead (the zero value, FallbackAuto: whenever the policy's
	// step would cost more); a policy's WithFallback overrides it for its
	// layers.
	Fallback Fallback
	// Costs prices the steps for FallbackAuto; nil: sparse.Calibrate's
	// model of the device, measured once per device and process.
	Costs *sparse.CostModel
	// Measure is whether FallbackAuto measures each policy's step and
	// dense attention at the model's geometry (MeasureSteps, once per
	// device and process) or prices both by the device's cost model; the
	// zero value, MeasureOnGPU, measures on a GPU where Costs is not
	// given.
	Measure Measure
	// PriceBatch is the batch FallbackAuto prices each sequence's choice
	// for: a batch's sequences share each stage's dispatches, so a step
	// costs a sequence less in a batch (Tactic on llama at 32 768 tokens,
	// H200: 1.07× dense attention's time alone, 0.45× in a batch of 8). 0
	// or 1 prices a sequence alone (never slower than dense attention
	// alone); a server that decodes Slots sequences at once sets Slots. At
	// most Slots. A choice still depends on its sequence alone.
	PriceBatch int
}

// priceBatch is the batch the fallback's choices are priced for.
func (cfg Config) priceBatch() int { return max(1, cfg.PriceBatch) }

// LayerPolicy returns the policy of layer l as the config gives it.
func (cfg Config) LayerPolicy(l int) Policy {
	if cfg.Layout != nil {
		return cfg.Layout[l]
	}
	return cfg.Policy
}

// Model is a model's decode state: L layers × B sequence slots of KV
// cache on the device, with the batches that attend them (see the
// package documentation).
type Model struct {
	mu     sync.Mutex
	dev    *vk.Device // nil once released
	cfg    Config
	policy []Policy // each layer's, resolved
	dense  *sparse.Dense
	km     *sparse.KMeans    // where some layer is clustered
	ws     *sparse.Workspace // the partials of every layer's attention, a region per active slot
	builds int               // Δ-layer batches built so far (their generations)
	cmd    *vk.Commands      // Attend's
	costs  *sparse.CostModel // what the fallback weighs steps by; nil where no layer weighs them
	// steps is each layer's measured step costs (MeasureSteps), nil where
	// its layer is priced by costs.
	steps []*StepCosts
	// fallback is each layer's (FallbackNever where its policy never falls
	// back).
	fallback []Fallback
	slots    []slot
	layers   []layerBatch
	active   []int // slots whose every layer is prefilled, ascending: the batches' order
}

// slot is one sequence's state.
type slot struct {
	n      int // prefill length (0: no layer prefilled)
	filled int // layers prefilled
	seq    []seqLayer
}

// seqLayer is one layer of one slot.
type seqLayer struct {
	cache    *kvcache.Layer
	filled   bool
	clusters *kvcache.Clusters // clustered policies: the index of [Sinks, end)
	// pending is a tail clustered and stored in cluster order whose join
	// failed; the next append joins it.
	pending *kvcache.Clusters
	// luka is LuKA's state and step (its summaries), and appended counts
	// the tokens appended since its segmenter last ran.
	luka     *sparse.LuKAStep
	appended int
	// share is the part of its index that the policy's last step took (0
	// before any): the estimate of the next step's cost.
	share float64
}

// layerBatch is the attention of one layer over the active slots: one
// of plan, tactic and steps, by the layer's policy.
type layerBatch struct {
	plan   *sparse.DensePlan   // Dense
	tactic *sparse.TacticBatch // Tactic: shared selection kernels
	steps  *sparse.Batch       // every other policy
	delta  *deltaBatch         // a DELTA Δ-layer
	luka   []*sparse.LuKAStep  // LuKA: each sequence's step (the slots own them)
	// members are the active slots (their positions in Active) that the
	// policy's batch above attends, in order; dense holds, at the others'
	// positions, a dense plan each (the fallback), nil at the members'.
	members []int
	dense   []*sparse.DensePlan
	choices []Choice // of a layer that may fall back: each active slot's
	// gen numbers a Δ-layer's builds; a layer reusing its pick was built
	// against build source (and is built again when they differ).
	gen, source int
	out         *vk.Buffer // sparse policies: float32 [Slots][Hq][D], where every sequence's step writes its output
	// built is each active slot's length when the batch was built
	// (positional policies build their index then).
	built   []int
	queried bool // queries uploaded to this batch
}

// exists reports whether the layer has a batch.
func (b *layerBatch) exists() bool { return b.built != nil }

// sparse reports whether the layer's policy batch attends some sequence.
func (b *layerBatch) sparse() bool {
	return b.tactic != nil || b.steps != nil || b.delta != nil || b.luka != nil
}

// step returns sequence i's step of a sparse batch.
func (b *layerBatch) step(i int) *sparse.Step {
	if b.tactic != nil {
		return b.tactic.Step(i).Step
	}
	return b.steps.Step(i)
}

// direct makes every sequence's step of a sparse batch, and every dense
// plan of its fallback, write its output into its place in out ([B][Hq][D],
// Active order).
func (b *layerBatch) direct(per uint64) error {
	for j, i := range b.members {
		r := b.out.Slice(uint64(i)*per, per)
		var err error
		switch {
		case b.delta != nil:
			err = b.delta.plans[j].SetOutput(r)
		case b.luka != nil:
			err = b.luka[j].SetOutput(r)
		default:
			err = b.step(j).SetOutput(r)
		}
		if err != nil {
			return err
		}
	}
	for i, p := range b.dense {
		if p != nil {
			if err := p.SetOutput(b.out.Slice(uint64(i)*per, per)); err != nil {
				return err
			}
		}
	}
	return nil
}

// share moves the batch's partials into the model's workspace: the
// policy's batch into the first regions, the fallback's plans into the
// regions after.
func (b *layerBatch) share(ws *sparse.Workspace) error {
	var err error
	switch {
	case b.plan != nil:
		err = b.plan.Share(ws, 0)
	case b.tactic != nil:
		err = b.tactic.Share(ws)
	case b.steps != nil:
		err = b.steps.Share(ws)
	} // a Δ-layer's plans share theirs when made
	region := len(b.members)
	for _, p := range b.dense {
		if p != nil && err == nil {
			err = p.Share(ws, region)
			region++
		}
	}
	return err
}

// release frees the batch (not the output buffer).
func (b *layerBatch) release() error {
	var errs []error
	if b.tactic != nil {
		errs = append(errs, b.tactic.Release())
	}
	if b.steps != nil {
		errs = append(errs, b.steps.Release())
	}
	if b.plan != nil {
		errs = append(errs, b.plan.Release())
	}
	if b.delta != nil {
		errs = append(errs, b.delta.release())
	}
	for _, p := range b.dense {
		if p != nil {
			errs = append(errs, p.Release())
		}
	}
	b.plan, b.tactic, b.steps, b.delta, b.luka, b.built, b.queried = nil, nil, nil, nil, nil, nil, false
	b.members, b.dense, b.choices = nil, nil, nil
	return errors.Join(errs...)
}

// validate reports why cfg cannot be used, and each layer's resolved
// policy.
func (cfg Config) validate() ([]Policy, error) {
	if err := cfg.Heads.Validate(); err != nil {
		return nil, err
	}
	if cfg.Layers <= 0 || cfg.Slots <= 0 || cfg.Capacity <= 0 {
		return nil, fmt.Errorf("decode: %d layers, %d slots and a capacity of %d tokens must be positive", cfg.Layers, cfg.Slots, cfg.Capacity)
	}
	if cfg.Layout != nil && len(cfg.Layout) != cfg.Layers {
		return nil, fmt.Errorf("decode: a layout of %d policies for %d layers", len(cfg.Layout), cfg.Layers)
	}
	if err := cfg.Fallback.check(); err != nil {
		return nil, err
	}
	if cfg.Measure < MeasureOnGPU || cfg.Measure > MeasureNever {
		return nil, fmt.Errorf("decode: unknown %v", cfg.Measure)
	}
	if cfg.PriceBatch < 0 || cfg.PriceBatch > cfg.Slots {
		return nil, fmt.Errorf("decode: choices priced for a batch of %d sequences: at most the %d slots", cfg.PriceBatch, cfg.Slots)
	}
	if cfg.Costs != nil {
		if err := cfg.Costs.Validate(); err != nil {
			return nil, fmt.Errorf("decode: %w", err)
		}
	}
	policies := make([]Policy, cfg.Layers)
	for l := range policies {
		p, err := cfg.LayerPolicy(l).resolve(cfg.Capacity)
		if err == nil {
			err = p.fallback.check()
		}
		if err != nil {
			return nil, fmt.Errorf("decode: layer %d: %w", l, err)
		}
		policies[l] = p
	}
	for l, p := range policies {
		if p.kind == kindDeltaReuse && (p.source < 0 || p.source >= l || policies[p.source].kind != kindDeltaRefresh) {
			return nil, fmt.Errorf("decode: layer %d reuses the pick of layer %d, which is no Δ-layer before it (use DeltaLayout)", l, p.source)
		}
	}
	return policies, nil
}

// New allocates the caches of cfg.Layers × cfg.Slots sequences of
// cfg.Capacity tokens and compiles the kernels. The Model uses dev but
// does not own it.
func New(dev *vk.Device, cfg Config) (*Model, error) {
	policies, err := cfg.validate()
	if err != nil {
		return nil, err
	}
	if cfg.Layout != nil {
		cfg.Layout = slices.Clone(cfg.Layout)
	}
	m := &Model{dev: dev, cfg: cfg, policy: policies, slots: make([]slot, cfg.Slots), layers: make([]layerBatch, cfg.Layers), ws: sparse.NewWorkspace(dev)}
	h := cfg.Heads
	m.fallback = make([]Fallback, cfg.Layers)
	for l, p := range policies {
		if m.fallback[l] = FallbackNever; p.FallsBack() {
			m.fallback[l] = cfg.fallbackOf(p)
		}
	}
	switch {
	case cfg.Costs != nil:
		m.costs = new(sparse.CostModel)
		*m.costs = *cfg.Costs
	case cfg.needsCostModel(policies):
		var c sparse.CostModel
		if c, err = sparse.Calibrate(dev); err != nil {
			return nil, fmt.Errorf("decode: the dense fallback's cost model (give Config.Costs, or FallbackNever): %w", err)
		}
		m.costs = &c
	}
	m.steps = make([]*StepCosts, cfg.Layers)
	for l := range policies {
		if err := m.measureLayer(l); err != nil {
			return nil, errors.Join(err, m.release())
		}
	}
	m.dense, err = sparse.NewDense(dev, h)
	if err == nil && slices.ContainsFunc(policies, Policy.Clustered) {
		m.km, err = sparse.NewKMeans(dev, h.KV, h.Dim)
		// The scratch of the largest prefill's clustering, allocated now
		// rather than at the first prefill.
		for _, pol := range policies {
			if err == nil && pol.Clustered() && cfg.Capacity > pol.opts.Sinks {
				err = m.km.Reserve(cfg.Capacity-pol.opts.Sinks, pol.opts.KMeans)
			}
		}
	}
	if err == nil {
		m.cmd, err = dev.NewCommands()
	}
	for s := range m.slots {
		m.slots[s].seq = make([]seqLayer, cfg.Layers)
		for l := range m.slots[s].seq {
			if err == nil {
				m.slots[s].seq[l].cache, err = kvcache.NewLayer(dev, h.KV, h.Dim, cfg.Capacity)
			}
		}
	}
	for l := range m.layers {
		if err == nil && !policies[l].IsDense() {
			m.layers[l].out, err = dev.NewBuffer(uint64(cfg.Slots*h.Query*h.Dim)*4, vk.DeviceLocal)
		}
	}
	if err != nil {
		return nil, errors.Join(fmt.Errorf("decode: %w", err), m.release())
	}
	return m, nil
}

// Config returns the configuration the Model was built with.
func (m *Model) Config() Config { return m.cfg }

// live refuses a released model, and one whose device was lost.
func (m *Model) live() error {
	if m.dev == nil {
		return vk.ErrReleased
	}
	return m.dev.Lost()
}

// checkSlot refuses a slot out of range.
func (m *Model) checkSlot(s int) error {
	if s < 0 || s >= m.cfg.Slots {
		return fmt.Errorf("decode: slot %d outside [0, %d)", s, m.cfg.Slots)
	}
	return nil
}

// checkLayer refuses a layer out of range.
func (m *Model) checkLayer(l int) error {
	if l < 0 || l >= m.cfg.Layers {
		return fmt.Errorf("decode: layer %d outside [0, %d)", l, m.cfg.Layers)
	}
	return nil
}

// checkActive refuses a slot out of range or not active.
func (m *Model) checkActive(s int) error {
	if err := m.checkSlot(s); err != nil {
		return err
	}
	switch sl := &m.slots[s]; {
	case sl.filled == 0:
		return fmt.Errorf("decode: slot %d holds no sequence (idle or freed): Prefill its layers first", s)
	case sl.filled < m.cfg.Layers:
		return fmt.Errorf("decode: slot %d has %d of its %d layers prefilled", s, sl.filled, m.cfg.Layers)
	}
	return nil
}

// Prefill stores the first n tokens of the sequence in slot's layer: k and
// v hold fp16 bit patterns, [KVHeads][n][Dim]. Every layer of a slot is
// prefilled with the same n; once all are, the slot is active. Under a
// clustered policy the tokens past the sinks are clustered and stored in
// cluster order. A
// slot's layer is prefilled once per sequence: Free the slot to start
// another.
func (m *Model) Prefill(slot, layer int, k, v []uint16, n int) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := m.live(); err != nil {
		return err
	}
	if err := errors.Join(m.checkSlot(slot), m.checkLayer(layer)); err != nil {
		return err
	}
	s := &m.slots[slot]
	sl := &s.seq[layer]
	h := m.cfg.Heads
	want := h.KV * max(n, 0) * h.Dim
	least, why := m.policy[layer].minPrefill()
	switch {
	case sl.filled:
		return fmt.Errorf("decode: slot %d layer %d already holds a sequence: Free the slot before another prefill", slot, layer)
	case n <= 0 || n > m.cfg.Capacity:
		return fmt.Errorf("decode: prefill of %d tokens into a capacity of %d", n, m.cfg.Capacity)
	case n < least:
		return fmt.Errorf("decode: layer %d (%s) needs a prefill of at least %d tokens (%s), got %d", layer, m.policy[layer], least, why, n)
	case s.filled > 0 && n != s.n:
		return fmt.Errorf("decode: slot %d layer %d: prefill of %d tokens where the slot's other layers hold %d", slot, layer, n, s.n)
	case len(k) != want || len(v) != want:
		return fmt.Errorf("decode: prefill of %d tokens needs %d keys and values (%d KV heads × %d × %d), got %d and %d", n, want, h.KV, n, h.Dim, len(k), len(v))
	}
	if err := errors.Join(kvcache.CheckFinite("k", k), kvcache.CheckFinite("v", v)); err != nil {
		return fmt.Errorf("decode: slot %d layer %d: %w", slot, layer, err)
	}
	if err := sl.cache.Prefill(k, v, n); err != nil {
		return fmt.Errorf("decode: slot %d layer %d: %w", slot, layer, err)
	}
	if pol := m.policy[layer]; pol.Clustered() {
		x, err := m.km.Cluster(sl.cache, pol.opts.Sinks, n-pol.opts.Sinks, pol.opts.KMeans)
		if err == nil {
			// The index keeps its centroids in 8 bits, as the selection reads them.
			if err = errors.Join(sl.cache.Reorder(x), x.Quantize(m.dev)); err != nil {
				err = errors.Join(err, x.Release())
			}
		}
		if err != nil {
			return errors.Join(fmt.Errorf("decode: slot %d layer %d: clustering the prefill (undone): %w", slot, layer, err), sl.cache.Truncate(0))
		}
		sl.clusters = x
	}
	if pol := m.policy[layer]; pol.kind == kindLuKA {
		st, err := sparse.NewLuKAStep(m.dense, sl.cache, pol.luka)
		if err != nil {
			return errors.Join(fmt.Errorf("decode: slot %d layer %d: LuKA's summaries of the prefill (undone): %w", slot, layer, err), sl.cache.Truncate(0))
		}
		sl.luka, sl.appended = st, 0
	}
	sl.filled = true
	s.n = n
	s.filled++
	if s.filled == m.cfg.Layers {
		i, _ := slices.BinarySearch(m.active, slot)
		m.active = slices.Insert(m.active, i, slot)
		return m.invalidate()
	}
	return nil
}

// releaseLayer releases a layer's batch, and with a Δ-layer's the batches
// of the layers that reuse its pick, those first (they hold its index).
func (m *Model) releaseLayer(layer int) error {
	var errs []error
	for l := layer + 1; l < len(m.layers); l++ {
		if p := m.policy[l]; p.kind == kindDeltaReuse && p.source == layer {
			errs = append(errs, m.layers[l].release())
		}
	}
	return errors.Join(append(errs, m.layers[layer].release())...)
}

// invalidate releases every layer's batch (the active slots changed), the
// last layer first: a layer reusing a Δ-layer's pick holds its index.
func (m *Model) invalidate() error {
	var errs []error
	for l := len(m.layers) - 1; l >= 0; l-- {
		errs = append(errs, m.layers[l].release())
	}
	return errors.Join(errs...)
}

// checkToken refuses one token's keys or values for a layer of slot s: the
// wrong length, not finite, or no room left.
func (m *Model) checkToken(s, l int, k, v []uint16) error {
	h := m.cfg.Heads
	if want := h.KV * h.Dim; len(k) != want || len(v) != want {
		return fmt.Errorf("decode: a token of layer %d needs %d keys and values (%d KV heads × %d), got %d and %d", l, want, h.KV, h.Dim, len(k), len(v))
	}
	if err := errors.Join(kvcache.CheckFinite("k", k), kvcache.CheckFinite("v", v)); err != nil {
		return fmt.Errorf("decode: slot %d layer %d: %w", s, l, err)
	}
	if n := m.slots[s].seq[l].cache.Len(); n >= m.cfg.Capacity {
		return fmt.Errorf("decode: slot %d layer %d is full (%d tokens, the capacity)", s, l, n)
	}
	return nil
}

// Append stores one token's keys and values (fp16 bit patterns,
// [KVHeads][Dim] each) in an active slot's layer. Under a clustered
// policy, once Recluster tokens have gathered past the layer's index they
// are clustered, stored in cluster order and join the index.
func (m *Model) Append(slot, layer int, k, v []uint16) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := m.live(); err != nil {
		return err
	}
	if err := errors.Join(m.checkLayer(layer), m.checkActive(slot)); err != nil {
		return err
	}
	if err := m.checkToken(slot, layer, k, v); err != nil {
		return err
	}
	if err := m.slots[slot].seq[layer].cache.Append(k, v); err != nil {
		return fmt.Errorf("decode: slot %d layer %d: %w", slot, layer, err)
	}
	return m.appended(slot, layer)
}

// appended grows the layer's index after an append: the clustered
// policies' (clusterTail) and LuKA's summaries (its segmenter, every
// Every tokens).
func (m *Model) appended(slot, layer int) error {
	if err := m.clusterTail(slot, layer); err != nil {
		return err
	}
	sl := &m.slots[slot].seq[layer]
	if sl.luka == nil {
		return nil
	}
	if sl.appended++; sl.appended < sl.luka.Options().Every {
		return nil
	}
	if _, err := sl.luka.Segment(); err != nil {
		return fmt.Errorf("decode: slot %d layer %d: the token is stored, but LuKA's segmenter failed (tried again at the next append): %w", slot, layer, err)
	}
	sl.appended = 0
	return nil
}

// AppendAll stores one token's keys and values in every layer of an
// active slot: k and v hold [Layers][KVHeads][Dim] fp16 bit patterns. It
// checks every layer's part before storing any.
func (m *Model) AppendAll(slot int, k, v []uint16) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := m.live(); err != nil {
		return err
	}
	if err := m.checkActive(slot); err != nil {
		return err
	}
	h := m.cfg.Heads
	per := h.KV * h.Dim
	if want := m.cfg.Layers * per; len(k) != want || len(v) != want {
		return fmt.Errorf("decode: AppendAll needs %d keys and values (%d layers × %d KV heads × %d), got %d and %d", want, m.cfg.Layers, h.KV, h.Dim, len(k), len(v))
	}
	for l := 0; l < m.cfg.Layers; l++ {
		if err := m.checkToken(slot, l, k[l*per:(l+1)*per], v[l*per:(l+1)*per]); err != nil {
			return err
		}
	}
	seq := m.slots[slot].seq
	for l := range seq {
		if err := seq[l].cache.Append(k[l*per:(l+1)*per], v[l*per:(l+1)*per]); err != nil {
			errs := []error{fmt.Errorf("decode: slot %d layer %d: %w", slot, l, err)}
			for j := range l {
				errs = append(errs, seq[j].cache.Truncate(seq[j].cache.Len()-1))
			}
			return errors.Join(errs...)
		}
	}
	var errs []error
	for l := range seq {
		errs = append(errs, m.appended(slot, l))
	}
	return errors.Join(errs...)
}

// clusterTail clusters the layer's tail, Recluster tokens at a time, while
// it holds that many, and joins each to the index (clustered policies):
// Tactic's step moves onto the new index, another policy's batch is built
// again at the layer's next SetQuery.
func (m *Model) clusterTail(slot, layer int) error {
	pol := m.policy[layer]
	if !pol.Clustered() {
		return nil
	}
	sl := &m.slots[slot].seq[layer]
	fail := func(err error) error {
		return fmt.Errorf("decode: slot %d layer %d: the token is stored, but clustering its tail failed (tried again at the next append): %w", slot, layer, err)
	}
	for {
		end := sl.clusters.First + sl.clusters.Count
		if sl.pending == nil {
			if sl.cache.Len()-end < pol.opts.Recluster {
				return nil
			}
			x, err := m.km.Cluster(sl.cache, end, pol.opts.Recluster, pol.opts.KMeans)
			if err != nil {
				return fail(err)
			}
			if err := sl.cache.Reorder(x); err != nil {
				return errors.Join(fail(err), x.Release())
			}
			sl.pending = x
		}
		// The tail's centroids in 8 bits under the index's dimension
		// scales, so that the two join.
		if err := sl.pending.QuantizeLike(m.dev, sl.clusters); err != nil {
			return fail(err)
		}
		joined, err := sl.clusters.Join(m.dev, sl.pending)
		if err != nil {
			return fail(err)
		}
		if lb := &m.layers[layer]; lb.tactic != nil {
			i, _ := slices.BinarySearch(m.active, slot)
			if j := slices.Index(lb.members, i); j >= 0 {
				if err := lb.tactic.Step(j).SetClusters(joined); err != nil {
					return errors.Join(fail(err), joined.Release())
				}
				if err := lb.share(m.ws); err != nil {
					return errors.Join(fail(err), m.layers[layer].release(), joined.Release())
				}
			}
		} else if err := m.layers[layer].release(); err != nil {
			return errors.Join(fail(err), joined.Release())
		}
		err = errors.Join(sl.pending.Release(), sl.clusters.Release())
		sl.pending, sl.clusters = nil, joined
		if err != nil {
			return err
		}
	}
}

// Free ends the sequence in slot (active or partly prefilled): its layers
// are emptied and the slot is idle, ready for another prefill.
func (m *Model) Free(slot int) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := m.live(); err != nil {
		return err
	}
	if err := m.checkSlot(slot); err != nil {
		return err
	}
	s := &m.slots[slot]
	if s.filled == 0 {
		return fmt.Errorf("decode: slot %d holds no sequence to free", slot)
	}
	var errs []error
	if i, ok := slices.BinarySearch(m.active, slot); ok {
		m.active = slices.Delete(m.active, i, i+1)
		errs = append(errs, m.invalidate())
	}
	for l := range s.seq {
		errs = append(errs, m.empty(&s.seq[l]))
	}
	s.n, s.filled = 0, 0
	return errors.Join(errs...)
}

// empty drops a slot's layer: its index and its tokens.
func (m *Model) empty(sl *seqLayer) error {
	var errs []error
	for _, x := range []*kvcache.Clusters{sl.clusters, sl.pending} {
		if x != nil {
			errs = append(errs, x.Release())
		}
	}
	sl.clusters, sl.pending, sl.share = nil, nil, 0
	if sl.luka != nil {
		errs = append(errs, sl.luka.Release())
		sl.luka, sl.appended = nil, 0
	}
	if sl.filled {
		errs = append(errs, sl.cache.Truncate(0))
	}
	sl.filled = false
	return errors.Join(errs...)
}

// Active returns the active slots in ascending order: the order of the
// sequences in the queries and outputs of Attend, SetQuery and Output.
func (m *Model) Active() []int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return slices.Clone(m.active)
}

// Idle returns the slots that hold no sequence, ascending.
func (m *Model) Idle() []int {
	m.mu.Lock()
	defer m.mu.Unlock()
	var idle []int
	for i := range m.slots {
		if m.slots[i].filled == 0 {
			idle = append(idle, i)
		}
	}
	return idle
}

// SlotState is what a slot holds: how many of its layers are prefilled
// (0: idle; every layer: active) and each layer's tokens.
type SlotState struct {
	Prefilled int
	Active    bool
	Tokens    []int // per layer, 0 where not prefilled
}

// Slot returns what slot holds, or why it cannot say (a slot out of range,
// a released model).
func (m *Model) Slot(slot int) (SlotState, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := errors.Join(m.live(), m.checkSlot(slot)); err != nil {
		return SlotState{}, err
	}
	s := &m.slots[slot]
	st := SlotState{Prefilled: s.filled, Active: s.filled == m.cfg.Layers, Tokens: make([]int, m.cfg.Layers)}
	for l := range s.seq {
		if s.seq[l].filled {
			st.Tokens[l] = s.seq[l].cache.Len()
		}
	}
	return st, nil
}

// Attended returns, for each active slot (Active order), the rows the
// layer's last attention that ran read for a KV head, mean over KV heads:
// every stored token under Dense, else the members of the clusters or
// pages its heads took, the pseudo-tokens, and the tokens outside the
// index (sparse.Step.Attended). Ask after the step has run and before
// appending.
func (m *Model) Attended(layer int) ([]float64, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := errors.Join(m.live(), m.checkLayer(layer)); err != nil {
		return nil, err
	}
	b := &m.layers[layer]
	if !b.queried {
		return nil, fmt.Errorf("decode: layer %d has attended nothing since the active slots changed", layer)
	}
	out := make([]float64, len(m.active))
	for i, s := range m.active {
		out[i] = float64(m.slots[s].seq[layer].cache.Len())
	}
	if b.plan != nil || b.delta != nil {
		return out, nil
	}
	for j, i := range b.members {
		var err error
		if b.luka != nil {
			out[i], err = b.luka[j].Attended()
		} else {
			out[i], err = b.step(j).Attended()
		}
		if err != nil {
			return nil, fmt.Errorf("decode: layer %d: %w", layer, err)
		}
	}
	return out, nil
}

// Len returns the tokens stored in slot's layer: 0 when that layer is not
// prefilled, or slot or layer are out of range.
func (m *Model) Len(slot, layer int) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.live() != nil || m.checkSlot(slot) != nil || m.checkLayer(layer) != nil || !m.slots[slot].seq[layer].filled {
		return 0
	}
	return m.slots[slot].seq[layer].cache.Len()
}

// checkQuery refuses queries for the active slots of the wrong length or
// not finite.
func (m *Model) checkQuery(q []float32) error {
	h := m.cfg.Heads
	b := len(m.active)
	if b == 0 {
		return fmt.Errorf("decode: no active sequence to attend")
	}
	if want := b * h.Query * h.Dim; len(q) != want {
		return fmt.Errorf("decode: queries of %d values for %d active sequences × %d heads × %d (%d)", len(q), b, h.Query, h.Dim, want)
	}
	for i, x := range q {
		if math.IsNaN(float64(x)) || math.IsInf(float64(x), 0) {
			return fmt.Errorf("decode: query value %d is %v", i, x)
		}
	}
	return nil
}

// stale reports whether a positional policy's batch should index its
// layer again: some sequence gathered Recluster tokens past it.
func (m *Model) stale(layer int) bool {
	b, pol := &m.layers[layer], m.policy[layer]
	if b.exists() && pol.kind == kindDeltaReuse {
		return b.source != m.layers[pol.source].gen
	}
	if !b.exists() || !pol.rebuildsIndex() {
		return false
	}
	for i, s := range m.active {
		if m.slots[s].seq[layer].cache.Len()-b.built[i] >= pol.opts.Recluster {
			return true
		}
	}
	return false
}

// build makes the layer's batch over the active slots, if it has none
// (or a stale one).
func (m *Model) build(layer int) error {
	b := &m.layers[layer]
	if err := m.measure(layer); err != nil {
		return err
	}
	choices, err := m.choose(layer)
	if err != nil {
		return err
	}
	if m.stale(layer) || (b.exists() && choices != nil && b.flipped(choices)) {
		if err := m.releaseLayer(layer); err != nil {
			return fmt.Errorf("decode: layer %d: %w", layer, err)
		}
	}
	if b.exists() {
		if choices != nil {
			b.choices = choices // the same choices, at today's costs
		}
		return nil
	}
	// The policy's batch attends the members; the fallback's dense plans
	// the others.
	var caches []*kvcache.Layer
	var indexes []*kvcache.Clusters
	var members []int
	built := make([]int, len(m.active))
	for i, s := range m.active {
		sl := &m.slots[s].seq[layer]
		built[i] = sl.cache.Len()
		if choices == nil || !choices[i].Dense {
			caches, indexes, members = append(caches, sl.cache), append(indexes, sl.clusters), append(members, i)
		}
	}
	b.members, b.choices = members, choices
	switch pol := m.policy[layer]; {
	case len(caches) == 0:
	case pol.IsDense():
		b.plan, err = m.dense.Plan(caches)
	case pol.IsTactic():
		b.tactic, err = sparse.NewTacticBatch(m.dense, caches, indexes, pol.p, pol.opts.Fit)
	case pol.kind == kindDeltaRefresh:
		if b.delta, err = newDeltaBatch(m.dense, m.ws, caches, pol.delta); err == nil {
			m.builds++
			b.gen = m.builds
		}
	case pol.kind == kindLuKA:
		b.luka = make([]*sparse.LuKAStep, len(m.active))
		for i, s := range m.active {
			b.luka[i] = m.slots[s].seq[layer].luka
		}
	case pol.kind == kindDeltaReuse:
		src := &m.layers[pol.source]
		if src.delta == nil {
			err = fmt.Errorf("it reuses the pick of layer %d, which has not attended since the active slots changed: attend the layers in order", pol.source)
			break
		}
		steps := make([]*sparse.Step, 0, len(caches))
		for i := range caches {
			var st *sparse.Step
			if st, err = sparse.NewDeltaReuseStepRuns(m.dense, caches[i], src.delta.picks[i], pol.delta.RunPages); err != nil {
				err = fmt.Errorf("slot %d: %w", m.active[members[i]], err)
				break
			}
			steps = append(steps, st)
		}
		if err == nil {
			b.steps, err = sparse.NewBatch(m.dense, steps)
			b.source = src.gen
		} else {
			for _, st := range steps {
				err = errors.Join(err, st.Release())
			}
		}
	default:
		steps := make([]*sparse.Step, 0, len(caches))
		for i := range caches {
			var st *sparse.Step
			if st, err = pol.newStep(m.dense, caches[i], indexes[i]); err != nil {
				err = fmt.Errorf("slot %d: %w", m.active[members[i]], err)
				break
			}
			steps = append(steps, st)
		}
		if err == nil {
			b.steps, err = sparse.NewBatch(m.dense, steps)
		} else {
			for _, st := range steps {
				err = errors.Join(err, st.Release())
			}
		}
	}
	if len(caches) < len(m.active) {
		b.dense = make([]*sparse.DensePlan, len(m.active))
		for i, s := range m.active {
			if err == nil && choices[i].Dense {
				b.dense[i], err = m.dense.Plan([]*kvcache.Layer{m.slots[s].seq[layer].cache})
			}
		}
	}
	b.built = built
	if err == nil {
		err = b.share(m.ws)
	}
	if err == nil && b.plan == nil {
		err = b.direct(uint64(m.cfg.Heads.Query*m.cfg.Heads.Dim) * 4)
	}
	if err != nil {
		// A batch half made (not moved into the workspace, say) would
		// attend wrongly: it is built again at the next call.
		return fmt.Errorf("decode: layer %d: %w", layer, errors.Join(err, m.releaseLayer(layer)))
	}
	return nil
}

// SetQuery uploads a layer's queries for the active slots, [B][Hq][D]
// float32 in Active order, for the Record that follows; under a sparse
// policy it also divides the layer's attention among workgroups by what
// each head attended in the layer's last step.
func (m *Model) SetQuery(layer int, q []float32) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.setQuery(layer, q)
}

func (m *Model) setQuery(layer int, q []float32) error {
	if err := m.live(); err != nil {
		return err
	}
	if err := m.checkLayer(layer); err != nil {
		return err
	}
	if err := m.checkQuery(q); err != nil {
		return err
	}
	if err := m.build(layer); err != nil {
		return err
	}
	b := &m.layers[layer]
	per := m.cfg.Heads.Query * m.cfg.Heads.Dim
	var err error
	for i, p := range b.dense {
		if p != nil && err == nil {
			err = p.SetQuery(q[i*per : (i+1)*per])
		}
	}
	if b.dense != nil && err == nil && len(b.members) > 0 {
		// The policy's batch takes its members' queries.
		sub := make([]float32, 0, len(b.members)*per)
		for _, i := range b.members {
			sub = append(sub, q[i*per:(i+1)*per]...)
		}
		q = sub
	}
	switch {
	case err != nil || !b.sparse() && b.plan == nil:
	case b.plan != nil:
		err = b.plan.SetQuery(q)
	case b.tactic != nil:
		// The last step of this batch has run (as the package says it
		// must have): its unions divide the next one's attention.
		if err = b.tactic.SetQuery(q); err == nil {
			err = b.tactic.Rebalance()
		}
	case b.delta != nil:
		err = b.delta.setQuery(q, per)
	case b.luka != nil:
		for i, st := range b.luka {
			if err = st.SetQuery(q[i*per : (i+1)*per]); err != nil {
				break
			}
		}
	default:
		if err = b.steps.SetQuery(q); err == nil {
			err = b.steps.Rebalance()
		}
	}
	if err != nil {
		return fmt.Errorf("decode: layer %d: %w", layer, err)
	}
	b.queried = true
	return nil
}

// Record appends the layer's attention for the queries of the last
// SetQuery to c; when c has run, Output holds the result. Record orders
// what it records itself: earlier transfers in c that it reads need a
// c.Barrier() before it, and commands after it that read Output a
// c.Barrier() between. See the package documentation on what must wait
// until c has run.
func (m *Model) Record(layer int, c *vk.Commands) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.record(layer, c)
}

func (m *Model) record(layer int, c *vk.Commands) error {
	if err := m.live(); err != nil {
		return err
	}
	if err := m.checkLayer(layer); err != nil {
		return err
	}
	if c == nil {
		return fmt.Errorf("decode: Record into no command buffer")
	}
	b := &m.layers[layer]
	if !b.queried {
		return fmt.Errorf("decode: Record of layer %d before its SetQuery (queries are set again after the active slots change)", layer)
	}
	// Every layer's partials lie in the one workspace: order this layer's
	// attention after whatever c recorded before.
	c.ComputeBarrier()
	// The fallback's dense attention (one dispatch a sequence, each in
	// regions of its own) runs beside the policy's first stage.
	for _, p := range b.dense {
		if p != nil {
			if err := p.Record(c); err != nil {
				return err
			}
		}
	}
	switch {
	case !b.sparse() && b.plan == nil:
		return nil
	case b.plan != nil:
		return b.plan.Record(c)
	case b.tactic != nil:
		return b.tactic.Record(c)
	case b.delta != nil:
		return b.delta.record(c)
	case b.luka != nil:
		return recordLuKA(b.luka, c)
	}
	return b.steps.Record(c)
}

// recordLuKA appends LuKA's steps of a batch stage by stage: each stage of
// every sequence, then a barrier.
func recordLuKA(steps []*sparse.LuKAStep, c *vk.Commands) error {
	for stage := range sparse.LuKAStages {
		if stage > 0 {
			c.ComputeBarrier()
		}
		for _, st := range steps {
			if err := st.RecordStage(c, stage); err != nil {
				return err
			}
		}
	}
	return nil
}

// Output returns where Record puts the layer's attention output: float32
// [B][Hq][D], the active slots in Active order. It is valid from the
// layer's SetQuery until the active slots change.
func (m *Model) Output(layer int) (vk.Range, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.output(layer)
}

func (m *Model) output(layer int) (vk.Range, error) {
	if err := m.live(); err != nil {
		return vk.Range{}, err
	}
	if err := m.checkLayer(layer); err != nil {
		return vk.Range{}, err
	}
	b := &m.layers[layer]
	if !b.queried {
		return vk.Range{}, fmt.Errorf("decode: layer %d has no output before its SetQuery", layer)
	}
	if b.plan != nil {
		return b.plan.Output().All(), nil
	}
	per := uint64(m.cfg.Heads.Query*m.cfg.Heads.Dim) * 4
	return b.out.Slice(0, uint64(len(b.built))*per), nil
}

// ReadOutput reads the layer's output (Output) back to the host, once the
// commands Record put in a command buffer have run.
func (m *Model) ReadOutput(layer int) ([]float32, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.readOutput(layer)
}

func (m *Model) readOutput(layer int) ([]float32, error) {
	r, err := m.output(layer)
	if err != nil {
		return nil, err
	}
	out := make([]float32, r.Size/4)
	return out, r.Buffer.ReadFloat32(r.Offset, out)
}

// Attend attends a layer's queries q ([B][Hq][D] float32, the active
// slots in Active order) over the slots' caches, runs it and returns the
// output, [B][Hq][D].
func (m *Model) Attend(layer int, q []float32) ([]float32, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := m.setQuery(layer, q); err != nil {
		return nil, err
	}
	c := m.cmd
	if err := c.Begin(); err != nil {
		return nil, err
	}
	if err := m.record(layer, c); err != nil {
		c.End()
		return nil, err
	}
	if err := c.End(); err != nil {
		return nil, err
	}
	if err := c.Submit(); err != nil {
		return nil, err
	}
	return m.readOutput(layer)
}

// Memory is the device memory a Model holds.
type Memory struct {
	// Caches is the keys and values of every layer and slot at capacity.
	Caches uint64 `json:"caches"`
	// Other is everything else: the tokens' positions, the indexes, the
	// batches (plans with their partials, selections), the outputs and
	// the K-means scratch.
	Other uint64 `json:"other"`
}

// Memory returns the device memory the model holds now (batches are made
// at a layer's first SetQuery after the active slots change).
func (m *Model) Memory() (Memory, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := m.live(); err != nil {
		return Memory{}, err
	}
	var mem Memory
	for s := range m.slots {
		for l := range m.slots[s].seq {
			sl := &m.slots[s].seq[l]
			mem.Caches += sl.cache.CacheBytes()
			mem.Other += sl.cache.Bytes() - sl.cache.CacheBytes() + sl.clusters.Bytes() + sl.pending.Bytes()
			if sl.luka != nil {
				mem.Other += sl.luka.Bytes()
			}
		}
	}
	for l := range m.layers {
		b := &m.layers[l]
		mem.Other += vk.Held(b.out)
		switch {
		case b.plan != nil:
			mem.Other += b.plan.Bytes()
		case b.tactic != nil:
			mem.Other += b.tactic.Bytes()
		case b.steps != nil:
			mem.Other += b.steps.Bytes()
		case b.delta != nil:
			mem.Other += b.delta.bytes()
		}
		for _, p := range b.dense {
			if p != nil {
				mem.Other += p.Bytes()
			}
		}
	}
	if m.km != nil {
		mem.Other += m.km.Bytes()
	}
	mem.Other += m.ws.Bytes()
	return mem, nil
}

// Time runs the layer's attention for the queries of its last SetQuery
// warmup+reps times back to back in one submission, a timestamp around
// each, and returns the timed runs' GPU times, sorted. It changes what
// Output holds no more than Record does; H2O's state accumulates each run.
func (m *Model) Time(layer, warmup, reps int) ([]time.Duration, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := errors.Join(m.live(), m.checkLayer(layer)); err != nil {
		return nil, err
	}
	b := &m.layers[layer]
	if !b.queried {
		return nil, fmt.Errorf("decode: Time of layer %d before its SetQuery", layer)
	}
	switch {
	case b.plan != nil:
		return b.plan.Time(warmup, reps)
	case b.dense != nil || b.delta != nil || b.luka != nil:
		return m.timeRecord(layer, warmup, reps)
	case b.tactic != nil:
		return b.tactic.Time(warmup, reps)
	}
	return b.steps.Time(warmup, reps)
}

// timeWarm is Time after untimed runs of at least warm of GPU time in all
// (at most 4096 runs; 3 runs first time a step to count them): a GPU
// idle a while runs slower until its clocks ramp up, and a few short
// warm-up runs would time that, not a model decoding layer after layer.
func (m *Model) timeWarm(layer int, warm time.Duration, reps int) ([]time.Duration, error) {
	t, err := m.Time(layer, 1, 3)
	if err != nil {
		return nil, err
	}
	runs := int(min(4096, max(3, warm/max(t[len(t)/2], time.Microsecond))))
	return m.Time(layer, runs, reps)
}

// Release frees everything the Model holds: batches, indexes, caches and
// kernels (not the device). It works on a lost device too.
func (m *Model) Release() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.dev == nil {
		return vk.ErrReleased
	}
	return m.release()
}

func (m *Model) release() error {
	errs := []error{m.invalidate()}
	for s := range m.slots {
		for l := range m.slots[s].seq {
			sl := &m.slots[s].seq[l]
			errs = append(errs, m.empty(sl))
			if sl.cache != nil {
				errs = append(errs, sl.cache.Release())
				sl.cache = nil
			}
		}
	}
	for l := range m.layers {
		if m.layers[l].out != nil {
			errs = append(errs, m.layers[l].out.Release())
			m.layers[l].out = nil
		}
	}
	if m.cmd != nil {
		errs = append(errs, m.cmd.Release())
	}
	if m.km != nil {
		errs = append(errs, m.km.Release())
	}
	if m.ws != nil {
		errs = append(errs, m.ws.Release())
	}
	if m.dense != nil {
		errs = append(errs, m.dense.Release())
	}
	m.cmd, m.km, m.ws, m.dense, m.dev = nil, nil, nil, nil, nil
	m.slots, m.layers, m.active = nil, nil, nil
	return errors.Join(errs...)
}
