package decode

import (
	"errors"
	"fmt"

	"github.com/vksparse/vksparse/sparse"
)

// Fallback is when a layer under a sparse policy attends a sequence
// densely instead (see the package documentation, "Dense fallback").
type Fallback int

const (
	// FallbackAuto attends a sequence densely whenever the policy's step
	// would cost more than dense attention by the model's cost model.
	FallbackAuto Fallback = iota
	// FallbackNever always runs the policy.
	FallbackNever
	// FallbackAlways always attends densely.
	FallbackAlways
)

// String names the fallback.
func (f Fallback) String() string {
	switch f {
	case FallbackAuto:
		return "auto"
	case FallbackNever:
		return "policy"
	case FallbackAlways:
		return "dense"
	}
	return fmt.Sprintf("fallback %d", int(f))
}

// check refuses an unknown fallback.
func (f Fallback) check() error {
	if f < FallbackAuto || f > FallbackAlways {
		return fmt.Errorf("decode: unknown %v", f)
	}
	return nil
}

// WithFallback returns the policy with its layers' fallback set to f, in
// place of Config.Fallback.
func (p Policy) WithFallback(f Fallback) Policy {
	p.fallback, p.fallbackSet = f, true
	return p
}

// FallsBack reports whether the policy's layers may attend densely
// instead (Tactic, Double-P, Quest, StreamingLLM, H2O). The oracles, kept
// for measurement, DELTA's and LuKA's layers, whose state spans layers
// and steps, always run their policy.
func (p Policy) FallsBack() bool {
	switch p.kind {
	case kindTactic, kindDoubleP, kindQuest, kindStreaming, kindH2O:
		return true
	}
	return false
}

// Choice is how a layer attends one sequence, and why: the costs of the
// policy's step (estimated, see Policy.Cost) and of dense attention over
// the sequence's tokens at the batch's build, priced by the model's cost
// model (zero times when it has none: FallbackNever and FallbackAlways
// need none).
type Choice struct {
	Slot     int      `json:"slot"`
	Fallback Fallback `json:"fallback"`
	// Dense reports whether the sequence is attended densely.
	Dense  bool `json:"dense"`
	Tokens int  `json:"tokens"`
	// Share is the part of its index the policy's last step took, that
	// the policy's cost counts (Policy.Cost; 0 before its first step).
	Share      float64     `json:"share"`
	PolicyCost sparse.Cost `json:"policy_cost"`
	DenseCost  sparse.Cost `json:"dense_cost"`
	PolicyUs   float64     `json:"policy_us"`
	DenseUs    float64     `json:"dense_us"`
	// Measured reports whether the two were priced by the layer's
	// measured step costs (Model.StepCosts), not the device's model.
	Measured bool `json:"measured"`
}

// Cost returns about what one step of the policy costs over a sequence of
// tokens tokens of heads' geometry: its dependent dispatches and the bytes
// its selection and attention read (as sparse.Step.Cost counts them).
// Attention reads the tokens outside the policy's index in full, and of
// the indexed ones a share: share, where positive (the last step's,
// sparse.Step.IndexedShare: the union of a KV head's query heads), else
// the least the policy takes (its budget; nothing for a clustered one).
// A positional policy indexes the middle of sparse.DefaultBaselineLayout;
// a clustered one's index holds indexed tokens (those past the sinks that
// have been clustered) in clusters clusters, ignored for the others.
// Tactic's fit adds its key rows (sparse.TacticFit.SampledRows). Policies
// without a fallback report an error.
func (p Policy) Cost(h sparse.Heads, tokens, indexed, clusters int, share float64) (sparse.Cost, error) {
	lo, hi := sparse.DefaultBaselineLayout().Middle(tokens)
	middle := max(hi-lo, 0)
	outside := float64(tokens - middle)
	row := float64(2 * h.Dim)
	// taken returns the indexed rows attended out of indexed, least of
	// them where no share was measured.
	taken := func(indexed, least int) float64 {
		if share > 0 {
			return share * float64(indexed)
		}
		return float64(min(least, indexed))
	}
	switch p.kind {
	case kindQuest:
		pages := (middle + sparse.QuestPageSize - 1) / sparse.QuestPageSize
		k := p.budget / sparse.QuestPageSize
		if p.budget >= middle {
			k = pages
		}
		bounds := 2*float64(pages*h.KV)*row + float64(4*h.Query*pages)
		return sparse.Cost{Dispatches: len(sparse.SelectStages) + 1, Bytes: bounds + h.AttentionBytes(outside+taken(middle, k*sparse.QuestPageSize)), Tokens: tokens}, nil
	case kindStreaming:
		return sparse.Cost{Dispatches: 1, Bytes: h.AttentionBytes(outside + taken(middle, p.budget)), Tokens: tokens}, nil
	case kindH2O:
		logits := float64(2 * 4 * h.Query * middle)
		return sparse.Cost{Dispatches: len(sparse.H2OStages) + 1, Bytes: logits + h.AttentionBytes(outside+taken(middle, p.budget)), Tokens: tokens}, nil
	case kindTactic, kindDoubleP:
		if indexed < 0 || indexed > tokens || clusters < 0 || clusters > indexed {
			return sparse.Cost{}, fmt.Errorf("decode: %s's cost over %d tokens, %d of them in %d clusters", p, tokens, indexed, clusters)
		}
		rows := float64(tokens-indexed) + taken(indexed, 0)
		if p.kind == kindTactic {
			c := h.TacticCost(p.opts.Fit, indexed, clusters, rows)
			c.Tokens = tokens
			return c, nil
		}
		return sparse.Cost{Dispatches: len(sparse.DoublePStages) + 1, Bytes: sparse.CentroidBytes(h, clusters) + h.AttentionBytes(rows), Tokens: tokens}, nil
	}
	return sparse.Cost{}, fmt.Errorf("decode: %s never falls back to dense attention: no cost to weigh", p)
}

// fallbackOf returns the layer's fallback: the policy's own
// (WithFallback), else the config's.
func (cfg Config) fallbackOf(p Policy) Fallback {
	if p.fallbackSet {
		return p.fallback
	}
	return cfg.Fallback
}

// needsCostModel reports whether some layer of cfg weighs costs.
func (cfg Config) needsCostModel(policies []Policy) bool {
	for _, p := range policies {
		if p.FallsBack() && cfg.fallbackOf(p) == FallbackAuto {
			return true
		}
	}
	return false
}

// choose returns how the layer attends each active slot (Active order),
// nil for a layer that never falls back. A slot's choice depends on that
// sequence alone (its tokens, index and last measured share) and the cost
// model, never on the other sequences of the batch.
func (m *Model) choose(layer int) ([]Choice, error) {
	pol := m.policy[layer]
	if !pol.FallsBack() {
		return nil, nil
	}
	mode := m.fallback[layer]
	out := make([]Choice, len(m.active))
	for i, s := range m.active {
		sl := &m.slots[s].seq[layer]
		c := Choice{Slot: s, Fallback: mode, Tokens: sl.cache.Len(), Dense: mode == FallbackAlways}
		c.DenseCost = m.cfg.Heads.DenseCost(c.Tokens)
		indexed, clusters := 0, 0
		if sl.clusters != nil {
			indexed, clusters = sl.clusters.Count, sl.clusters.C
		}
		c.Share = sl.share
		var err error
		if c.PolicyCost, err = pol.Cost(m.cfg.Heads, c.Tokens, indexed, clusters, sl.share); err != nil {
			return nil, fmt.Errorf("decode: layer %d slot %d: %w", layer, s, err)
		}
		if policyModel, denseModel, measured, ok := m.pricing(layer); ok {
			c.PolicyUs, c.DenseUs, c.Measured = policyModel.Us(c.PolicyCost), denseModel.Us(c.DenseCost), measured
			if mode == FallbackAuto {
				c.Dense = c.PolicyUs > c.DenseUs
			}
		}
		out[i] = c
	}
	return out, nil
}

// pricing returns the cost models the layer's choices are priced by, a
// sequence's part in a batch of Config.PriceBatch: its measured step
// costs where it has them (measured at that batch), else the device's
// model for both, its floor shared by the batch; ok is false where the
// model has neither.
func (m *Model) pricing(layer int) (policy, dense sparse.CostModel, measured, ok bool) {
	if sc := m.steps[layer]; sc != nil {
		return sc.Policy, sc.Dense, true, true
	}
	if m.costs != nil {
		c := m.costs.PerSequence(m.cfg.priceBatch())
		return c, c, false, true
	}
	return sparse.CostModel{}, sparse.CostModel{}, false, false
}

// measure keeps, for each sequence the layer's policy attended in its
// last step, the share of its index the step took (the estimate of its
// next steps' cost).
func (m *Model) measure(layer int) error {
	b := &m.layers[layer]
	if !b.queried || !m.policy[layer].FallsBack() || (b.tactic == nil && b.steps == nil) {
		return nil
	}
	for j, i := range b.members {
		share, err := b.step(j).IndexedShare()
		if err != nil {
			return fmt.Errorf("decode: layer %d: %w", layer, err)
		}
		m.slots[m.active[i]].seq[layer].share = share
	}
	return nil
}

// flipped reports whether some active slot's choice differs from the one
// the layer's batch was built with.
func (b *layerBatch) flipped(now []Choice) bool {
	if len(now) != len(b.choices) {
		return true
	}
	for i := range now {
		if now[i].Dense != b.choices[i].Dense {
			return true
		}
	}
	return false
}

// SetFallback sets the layer's fallback from its next SetQuery or Attend
// on (a change of choice builds the layer's batch again there). A layer
// that never falls back refuses it; FallbackAuto on a model without a cost
// model calibrates the device (sparse.Calibrate).
func (m *Model) SetFallback(layer int, f Fallback) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := errors.Join(m.live(), m.checkLayer(layer), f.check()); err != nil {
		return err
	}
	if pol := m.policy[layer]; !pol.FallsBack() {
		return fmt.Errorf("decode: layer %d (%s) never falls back to dense attention", layer, pol)
	}
	if f == FallbackAuto && m.costs == nil {
		c, err := sparse.Calibrate(m.dev)
		if err != nil {
			return fmt.Errorf("decode: the dense fallback's cost model: %w", err)
		}
		m.costs = &c
	}
	prev := m.fallback[layer]
	m.fallback[layer] = f
	if err := m.measureLayer(layer); err != nil {
		m.fallback[layer] = prev
		return err
	}
	return nil
}

// measures reports whether a layer under FallbackAuto measures its
// policy's step (Config.Measure) on this device.
func (m *Model) measures() bool {
	switch m.cfg.Measure {
	case MeasureAlways:
		return true
	case MeasureOnGPU:
		return m.cfg.Costs == nil && m.dev.Info().Type != "cpu"
	}
	return false
}

// measureLayer gives a layer under FallbackAuto its measured step costs
// where the model measures them and has none yet for it.
func (m *Model) measureLayer(layer int) error {
	pol := m.policy[layer]
	if m.steps[layer] != nil || !pol.FallsBack() || m.fallback[layer] != FallbackAuto || !m.measures() {
		return nil
	}
	lengths, ok := MeasureLengths(m.cfg.Capacity)
	if !ok {
		return nil
	}
	sc, err := MeasureSteps(m.dev, m.cfg.Heads, pol, lengths, m.cfg.priceBatch(), *m.costs)
	if err != nil {
		return fmt.Errorf("decode: layer %d's dense fallback: %w", layer, err)
	}
	m.steps[layer] = &sc
	return nil
}

// StepCosts returns the measured step costs the layer's fallback weighs
// its choices by, and whether it has them (a layer under FallbackAuto on
// a model that measures, Config.Measure).
func (m *Model) StepCosts(layer int) (StepCosts, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.checkLayer(layer) != nil || m.steps == nil || m.steps[layer] == nil {
		return StepCosts{}, false
	}
	return *m.steps[layer], true
}

// Fallback returns the layer's fallback (FallbackNever for a layer that
// never falls back).
func (m *Model) Fallback(layer int) (Fallback, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := errors.Join(m.live(), m.checkLayer(layer)); err != nil {
		return 0, err
	}
	return m.fallback[layer], nil
}

// Choices returns how the layer attends each active slot (Active order),
// as chosen at the last SetQuery or Attend, with the costs that decided
// it; a layer that never falls back (Dense, the oracles,
// DELTA, LuKA) reports an error.
func (m *Model) Choices(layer int) ([]Choice, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := errors.Join(m.live(), m.checkLayer(layer)); err != nil {
		return nil, err
	}
	if pol := m.policy[layer]; !pol.FallsBack() {
		return nil, fmt.Errorf("decode: layer %d (%s) never falls back to dense attention", layer, pol)
	}
	b := &m.layers[layer]
	if !b.queried {
		return nil, fmt.Errorf("decode: layer %d has chosen nothing since the active slots changed: SetQuery first", layer)
	}
	return append([]Choice(nil), b.choices...), nil
}

// CostModel returns the cost model the model weighs its layers' steps by,
// and whether it has one (only where some layer's fallback is
// FallbackAuto, unless Config.Costs gave one).
func (m *Model) CostModel() (sparse.CostModel, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.costs == nil {
		return sparse.CostModel{}, false
	}
	return *m.costs, true
}
