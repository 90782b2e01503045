package decode

import (
	"fmt"
	"slices"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/sparse"
)

// kind is a Policy's selection.
type kind int

const (
	kindDense kind = iota
	kindTactic
	kindDoubleP
	kindClusterOracle
	kindQuest
	kindStreaming
	kindH2O
	kindTokenOracle
	kindDeltaRefresh // a Δ-layer: dense, then the pick of pages
	kindDeltaReuse   // after a Δ-layer: its pages
	kindLuKA         // LuKA's clustered attention: summaries, refined
)

// Policy chooses how a layer attends. The zero Policy is Dense.
//
// Clustered policies (Tactic, Double-P, the cluster oracle) keep each
// sequence's layer in K-means clusters past its sinks, stored in cluster
// order: the prefill is clustered, and every Recluster appended tokens
// are clustered and join the index; the tokens not yet clustered are
// attended in full. Positional policies (Quest, StreamingLLM, H2O, the
// token oracle) index the middle of sparse.DefaultBaselineLayout (pages
// of sparse.QuestPageSize for Quest, single tokens otherwise) when a
// layer's batch is built; Quest, StreamingLLM and the token oracle build
// it again once some sequence has gathered Recluster tokens past it, H2O
// keeps it (and the attention it accumulated) until the active slots
// change, attending the tokens past it in full.
type Policy struct {
	kind    kind
	p       float64                     // Tactic, oracles
	targets sparse.DoubleP              // Double-P
	budget  int                         // Quest, StreamingLLM, H2O: middle tokens a head takes
	opts    sparse.TacticDecoderOptions // sinks, recluster interval, K-means, Tactic's fit
	delta   sparse.Delta                // DELTA's budget and pages
	source  int                         // DELTA: the Δ-layer whose pick a layer reuses
	luka    sparse.LuKA                 // LuKA's clustered attention
	// fallback, where fallbackSet, replaces Config.Fallback for the
	// policy's layers (WithFallback).
	fallback    Fallback
	fallbackSet bool
}

// Dense attends every stored token.
func Dense() Policy { return Policy{} }

// Tactic attends, for each query head, the fewest clusters of keys whose
// attention mass reaches p (0 < p ≤ 1), with the sinks and the
// unclustered tail; opts' zero values take sparse's defaults.
func Tactic(p float64, opts sparse.TacticDecoderOptions) Policy {
	return Policy{kind: kindTactic, p: p, opts: opts}
}

// DoubleP attends clusters by the two-level top-p of sparse's Double-P
// selector (targets P1 and P2; sparse.DefaultDoubleP is the paper's),
// over the clustering opts gives (its Fit is unused).
func DoubleP(targets sparse.DoubleP, opts sparse.TacticDecoderOptions) Policy {
	return Policy{kind: kindDoubleP, targets: targets, opts: opts}
}

// ClusterOracle attends, for each query head, the fewest clusters whose
// true attention mass reaches p: an upper bound on what a cluster policy
// can select, for measurement.
func ClusterOracle(p float64, opts sparse.TacticDecoderOptions) Policy {
	return Policy{kind: kindClusterOracle, p: p, opts: opts}
}

// TokenOracle attends, for each query head, the fewest tokens of the
// middle whose true attention mass reaches p, with the sinks and the
// recent window: exact top-p, for measurement.
func TokenOracle(p float64) Policy { return Policy{kind: kindTokenOracle, p: p} }

// Quest attends, for each query head, the pages of the middle with the
// greatest upper bounds on their scores, budget tokens' worth, with the
// sinks and the recent window.
func Quest(budget int) Policy { return Policy{kind: kindQuest, budget: budget} }

// StreamingLLM attends the sinks, the recent window and the last budget
// tokens of the middle.
func StreamingLLM(budget int) Policy { return Policy{kind: kindStreaming, budget: budget} }

// H2O attends the sinks, the recent window and, of the middle, budget
// tokens split between the most recent and the heavy hitters of the
// attention accumulated over the steps (sparse.H2OSplit).
func H2O(budget int) Policy { return Policy{kind: kindH2O, budget: budget} }

// DeltaLayout returns DELTA's policies for a model of layers layers (seed
// 002, Algorithms 1–2): Dense for the warm-up layers, a Δ-layer (dense
// attention, then the pick of pages by the greatest attention weight of
// any head, summed a page, with the recent pages always) at each refresh
// layer, and for every other layer the pages its last Δ-layer picked at
// the same step. opts' zero values take sparse.DefaultDelta's. Pages are
// indexed every Recluster tokens (WithRecluster; tokens past them are
// attended in full).
func DeltaLayout(layers int, opts sparse.Delta) ([]Policy, error) {
	d, err := opts.Resolve(layers)
	if err != nil {
		return nil, err
	}
	out := make([]Policy, layers)
	src := -1
	for l := d.Warmup; l < layers; l++ {
		if slices.Contains(d.Refresh, l) {
			src = l
			out[l] = Policy{kind: kindDeltaRefresh, delta: d}
			continue
		}
		out[l] = Policy{kind: kindDeltaReuse, delta: d, source: src}
	}
	return out, nil
}

// LuKA attends each sequence's layer by LuKA's clustered attention
// (sparse.LuKAStep): whole segments of the tokens before the last Recent
// are compressed into summaries, at the prefill and then every Every
// appended tokens; a query attends the summaries and the raw tokens after
// them, and refines some summaries into their tokens, mass-preserving.
// opts' zero values take sparse.DefaultLuKA's.
func LuKA(opts sparse.LuKA) Policy { return Policy{kind: kindLuKA, luka: opts} }

// LuKAMode is how LuKALayout spreads LuKA's two attentions over the layers.
type LuKAMode int

const (
	// LuKAMixed gives the first and last layers lined attention (H2O) and
	// those between clustered attention: ⌈layers·8/36⌉ at each end, the
	// paper's 8 of 36.
	LuKAMixed LuKAMode = iota
	// LuKAClusteredOnly gives every layer clustered attention.
	LuKAClusteredOnly
	// LuKALinedOnly gives every layer lined attention.
	LuKALinedOnly
)

// String names the mode.
func (m LuKAMode) String() string {
	switch m {
	case LuKAMixed:
		return "mixed"
	case LuKAClusteredOnly:
		return "clustered"
	case LuKALinedOnly:
		return "lined"
	}
	return fmt.Sprintf("LuKA mode %d", int(m))
}

// LuKALayout returns LuKA's layout of a model of layers layers in mode:
// lined layers take lined (an H2O policy: LuKA's lined attention is H2O),
// clustered layers LuKA(opts).
func LuKALayout(layers int, mode LuKAMode, opts sparse.LuKA, lined Policy) ([]Policy, error) {
	if layers <= 0 {
		return nil, fmt.Errorf("decode: LuKA over %d layers", layers)
	}
	if mode != LuKAClusteredOnly && lined.kind != kindH2O {
		return nil, fmt.Errorf("decode: LuKA's lined layers are H2O, not %s", lined)
	}
	if _, err := opts.Resolve(); err != nil {
		return nil, err
	}
	edge := 0
	switch mode {
	case LuKAMixed:
		edge = min((layers*8+35)/36, layers/2)
	case LuKALinedOnly:
		edge = layers
	case LuKAClusteredOnly:
	default:
		return nil, fmt.Errorf("decode: unknown %v", mode)
	}
	out := make([]Policy, layers)
	for l := range out {
		out[l] = LuKA(opts)
		if l < edge || l >= layers-edge {
			out[l] = lined
		}
	}
	return out, nil
}

// WithRecluster returns the policy with its index grown every n appended
// tokens (Recluster of its options; 0 = sparse.TacticDefaultRecluster).
func (p Policy) WithRecluster(n int) Policy {
	p.opts.Recluster = n
	return p
}

// IsDense reports whether the policy attends every token.
func (p Policy) IsDense() bool { return p.kind == kindDense }

// IsTactic reports whether the policy is Tactic.
func (p Policy) IsTactic() bool { return p.kind == kindTactic }

// Clustered reports whether the policy keeps its layers in K-means
// clusters (Tactic, Double-P, the cluster oracle).
func (p Policy) Clustered() bool {
	return p.kind == kindTactic || p.kind == kindDoubleP || p.kind == kindClusterOracle
}

// P returns the target mass of Tactic and the oracles (0 otherwise).
func (p Policy) P() float64 { return p.p }

// Budget returns the middle tokens of Quest, StreamingLLM and H2O (0
// otherwise).
func (p Policy) Budget() int { return p.budget }

// Targets returns Double-P's targets (zero otherwise).
func (p Policy) Targets() sparse.DoubleP { return p.targets }

// Options returns the clustering options as given.
func (p Policy) Options() sparse.TacticDecoderOptions { return p.opts }

// String names the policy.
func (p Policy) String() string {
	switch p.kind {
	case kindTactic:
		if f := p.opts.Fit; f != (sparse.TacticFit{}) && !f.Moments {
			return fmt.Sprintf("Tactic P = %g (fitted curve)", p.p)
		}
		return fmt.Sprintf("Tactic P = %g", p.p)
	case kindDoubleP:
		return fmt.Sprintf("Double-P (%g, %g)", p.targets.P1, p.targets.P2)
	case kindClusterOracle:
		return fmt.Sprintf("cluster oracle P = %g", p.p)
	case kindTokenOracle:
		return fmt.Sprintf("token oracle P = %g", p.p)
	case kindQuest:
		return fmt.Sprintf("Quest %d", p.budget)
	case kindStreaming:
		return fmt.Sprintf("StreamingLLM %d", p.budget)
	case kindH2O:
		return fmt.Sprintf("H2O %d", p.budget)
	case kindDeltaRefresh:
		return fmt.Sprintf("DELTA Δ-layer (K %d, L %d)", p.delta.Pages, p.delta.Recent)
	case kindDeltaReuse:
		return fmt.Sprintf("DELTA (the pick of layer %d)", p.source)
	case kindLuKA:
		return p.luka.String()
	}
	return "dense"
}

// resolve checks the policy for a capacity and returns it with the
// clustering defaults in place (every policy's Recluster is resolved: the
// positional ones rebuild their index at that interval).
func (p Policy) resolve(capacity int) (Policy, error) {
	opts, err := p.opts.Resolve()
	if err != nil {
		return p, err
	}
	p.opts = opts
	switch p.kind {
	case kindDense:
	case kindTactic, kindClusterOracle, kindTokenOracle:
		if err := sparse.CheckP(p.p); err != nil {
			return p, err
		}
	case kindDoubleP:
		if t := p.targets; !(t.P1 > 0 && t.P1 <= 1) || !(t.P2 > 0 && t.P2 <= 1) {
			return p, fmt.Errorf("Double-P targets (%v, %v): each must lie in (0, 1]", t.P1, t.P2)
		}
	case kindQuest, kindStreaming, kindH2O:
		if p.budget <= 0 || p.budget > capacity {
			return p, fmt.Errorf("%s: the budget must lie in [1, %d] (the capacity)", p, capacity)
		}
	case kindLuKA:
		if p.luka, err = p.luka.Resolve(); err != nil {
			return p, err
		}
	case kindDeltaRefresh, kindDeltaReuse:
		d := p.delta
		if d.Pages < 1 || d.PageSize < 1 || d.Recent < 0 || d.Recent >= d.Pages {
			return p, fmt.Errorf("%s: pages of %d tokens, a budget of %d keeping %d recent: use DeltaLayout", p, d.PageSize, d.Pages, d.Recent)
		}
	default:
		return p, fmt.Errorf("an unknown policy (%d): use the constructors", p.kind)
	}
	if p.Clustered() && p.opts.Sinks >= capacity {
		return p, fmt.Errorf("%s: %d sinks leave no token to cluster in a capacity of %d", p, p.opts.Sinks, capacity)
	}
	return p, nil
}

// minPrefill is the fewest tokens a prefill needs under the policy, and
// why: one past the sinks to cluster, one past a page for DELTA, one past
// the baseline layout's sinks and window for a middle to index.
func (p Policy) minPrefill() (int, string) {
	switch {
	case p.Clustered():
		return p.opts.Sinks + 1, fmt.Sprintf("one past its %d sinks to cluster", p.opts.Sinks)
	case p.kind == kindDense || p.kind == kindLuKA:
		return 1, "one to attend"
	case p.isDelta():
		return p.delta.PageSize + 1, fmt.Sprintf("a page of %d and one", p.delta.PageSize)
	}
	return sparse.BaselineSinks + sparse.BaselineWindow + 1,
		fmt.Sprintf("one past the %d sinks and the window of %d to index", sparse.BaselineSinks, sparse.BaselineWindow)
}

// newStep makes one sequence's step over cache, indexed by index
// (clustered policies; nil otherwise).
func (p Policy) newStep(dense *sparse.Dense, cache *kvcache.Layer, index *kvcache.Clusters) (*sparse.Step, error) {
	switch p.kind {
	case kindDoubleP:
		return sparse.NewDoublePStep(dense, cache, index, p.targets)
	case kindClusterOracle:
		return sparse.NewClusterOracleStep(dense, cache, index, p.p)
	case kindTokenOracle:
		return sparse.NewTokenOracleStep(dense, cache, p.p)
	case kindQuest:
		return sparse.NewQuestStep(dense, cache, p.budget)
	case kindStreaming:
		return sparse.NewStreamingStep(dense, cache, p.budget)
	case kindH2O:
		return sparse.NewH2OStep(dense, cache, p.budget)
	}
	return nil, fmt.Errorf("decode: %s has no generic step", p)
}

// rebuildsIndex reports whether a positional policy builds its index
// again once a sequence has gathered Recluster tokens past it.
func (p Policy) rebuildsIndex() bool {
	return p.kind == kindQuest || p.kind == kindStreaming || p.kind == kindTokenOracle || p.kind == kindDeltaRefresh
}

// isDelta reports whether the layer is one of DELTA's sparse layers.
func (p Policy) isDelta() bool { return p.kind == kindDeltaRefresh || p.kind == kindDeltaReuse }
