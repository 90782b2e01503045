package evaluate

import (
	"fmt"
	"math"
	"slices"
	"sort"

	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/trace"
	"github.com/vksparse/vksparse/workload"
)

// The policies Compare measures. The adaptive ones choose how many tokens
// each query head needs for a target mass P; the fixed-budget ones are
// given a number of tokens.
const (
	// PolicyTactic is Tactic (sparse.TacticDecodeRef) at target P.
	PolicyTactic = "tactic"
	// PolicyDoubleP is Double-P (sparse.DoublePDecodeRef) with P1 = P and
	// P2 = CompareOptions.DoubleP2.
	PolicyDoubleP = "doublep"
	// PolicyTokenOracle is the exact top-p over tokens
	// (sparse.TokenOracleDecodeRef): the fewest tokens reaching P.
	PolicyTokenOracle = "token-oracle"
	// PolicyClusterOracle takes whole clusters in order of their true mass
	// until P (sparse.ClusterOracleDecodeRef).
	PolicyClusterOracle = "cluster-oracle"
	// PolicyQuest is Quest (sparse.QuestDecodeRef), pages of 16 tokens.
	PolicyQuest = "quest"
	// PolicyStreaming is StreamingLLM (sparse.StreamingDecodeRef).
	PolicyStreaming = "streaming"
	// PolicyH2O is H2O (sparse.H2O), half heavy hitters and half recent.
	PolicyH2O = "h2o"
)

// AdaptivePolicies lists the adaptive policies in the order Compare
// reports them.
func AdaptivePolicies() []string {
	return []string{PolicyTactic, PolicyDoubleP, PolicyTokenOracle, PolicyClusterOracle}
}

// FixedBudgetPolicies lists the fixed-budget policies in the order Compare
// reports them (after the adaptive ones, once per budget source).
func FixedBudgetPolicies() []string {
	return []string{PolicyQuest, PolicyStreaming, PolicyH2O}
}

// CompareOptions configures Compare. Start from DefaultCompareOptions:
// every field is used as given, except those derived from the trace when
// zero or nil.
type CompareOptions struct {
	// Setup's Sinks hold for every policy, and Tactic, Double-P and the
	// oracles attend the prefill's fixed tokens in full; H2O steps
	// through the queries in order of position.
	Setup
	// Window is the recent window of the fixed-budget policies
	// (sparse.BaselineLayout{Sinks, Window}).
	Window int `json:"window"`
	// DoubleP2 is Double-P's second target (the share of the kept
	// clusters' estimated mass attended token by token); its first is P.
	DoubleP2 float64 `json:"doublep_p2"`
	// Policies lists the policies to run (AdaptivePolicies and
	// FixedBudgetPolicies); nil means all of them.
	Policies []string `json:"policies"`
	// BudgetFrom lists the adaptive policies whose token counts the
	// fixed-budget policies are given: each of Quest, StreamingLLM and H2O
	// runs once per entry (see Compare). Each must be in Policies when a
	// fixed-budget policy is.
	BudgetFrom []string `json:"budget_from"`
	// H2OObserve lists the indices of queries H2O observes densely
	// (sparse.H2O.Observe), in order of position, before its first step:
	// the analogue of its prompt phase. nil means every query of the trace
	// that is not evaluated and sits before the first evaluated one; an
	// empty list means none.
	H2OObserve []int `json:"h2o_observe"`
}

// DefaultCompareOptions returns P = 0.5, 0.7, 0.9, 0.95 (0.95 is Double-P's
// own setting), 4 sinks and a recent window of 64 tokens (the Double-P
// paper's comparison), Tactic's clustering (clusters of 16 on average, 10
// K-means iterations over the whole prefill, DefaultSeed) and fit
// (sparse.DefaultTacticFit), Double-P's P2 of 0.7, every policy, budgets
// from Tactic and from Double-P, and Prefill, Queries and H2OObserve
// derived from the trace.
func DefaultCompareOptions() CompareOptions {
	return CompareOptions{
		Setup: Setup{
			P:              []float64{0.5, 0.7, 0.9, 0.95},
			Sinks:          sparse.BaselineSinks,
			AvgClusterSize: sparse.KMeansDefaultAvgClusterSize,
			KMeansIters:    sparse.KMeansDefaultIters,
			Seed:           DefaultSeed,
			Fit:            sparse.DefaultTacticFit(),
		},
		Window:     sparse.BaselineWindow,
		DoubleP2:   sparse.DefaultDoubleP().P2,
		BudgetFrom: []string{PolicyTactic, PolicyDoubleP},
	}
}

// Comparison is the result of Compare.
type Comparison struct {
	Tokens  int `json:"tokens"`
	QHeads  int `json:"q_heads"`
	KVHeads int `json:"kv_heads"`
	HeadDim int `json:"head_dim"`
	// Options are the options used, Prefill, Queries and H2OObserve
	// filled in (Queries in order of position).
	Options CompareOptions `json:"options"`
	// Kinds gives each query head's kind from the trace metadata
	// (workload.KindsOf), nil when the trace records none.
	Kinds []string `json:"kinds,omitempty"`
	// Results holds one entry per target mass, in the order of Options.P.
	Results []CompareResult `json:"results"`
}

// CompareResult is every policy's figures at one target mass P: first the
// adaptive policies (AdaptivePolicies), then the fixed-budget ones
// (FixedBudgetPolicies) for each entry of Options.BudgetFrom in turn.
type CompareResult struct {
	P        float64        `json:"p"`
	Policies []PolicyResult `json:"policies"`
}

// Policy returns the figures of policy given the budget of budgetFrom
// ("" for an adaptive policy), or nil.
func (r *CompareResult) Policy(policy, budgetFrom string) *PolicyResult {
	for i := range r.Policies {
		if r.Policies[i].Policy == policy && r.Policies[i].BudgetFrom == budgetFrom {
			return &r.Policies[i]
		}
	}
	return nil
}

// PolicyResult is one policy's figures at one P, over every evaluated
// (query, query head) case and per query head.
type PolicyResult struct {
	Policy string `json:"policy"`
	// BudgetFrom names the adaptive policy whose mean own selection at
	// this P the fixed-budget policy was given, and Budget is that mean
	// (tokens per query head, the always-attended ones included); both
	// empty for an adaptive policy.
	BudgetFrom string  `json:"budget_from,omitempty"`
	Budget     float64 `json:"budget,omitempty"`
	PolicyStats
	Heads []PolicyHead `json:"heads"`
}

// PolicyHead is one query head's figures over the evaluated queries.
type PolicyHead struct {
	Head   int    `json:"head"`
	KVHead int    `json:"kv_head"`
	Kind   string `json:"kind,omitempty"`
	PolicyStats
}

// PolicyStats aggregates (query, query head) cases; means are arithmetic
// means over the cases. A query head's own selection is the tokens it
// chose, the always-attended ones included; the union is what its KV head
// attends exactly (the union over the query heads sharing it). Double-P
// also attends some clusters through one pseudo-token each (their value
// means); they are not tokens here.
type PolicyStats struct {
	Cases int `json:"cases"`
	// Attended is the mean number of tokens a query could attend (pos+1).
	Attended float64 `json:"attended"`
	// Own and Union are the mean sizes of the own selection and of the
	// union; OwnFrac and UnionFrac the means of those sizes over pos+1.
	Own       float64 `json:"own"`
	Union     float64 `json:"union"`
	OwnFrac   float64 `json:"own_frac"`
	UnionFrac float64 `json:"union_frac"`
	// Approximated is the mean number of clusters a head attends through a
	// pseudo-token (Double-P; 0 for the others).
	Approximated float64 `json:"approximated"`
	// Mass is the mean attention mass p(I) of the union I (the exact
	// softmax of the query over every token it could attend), MinMass the
	// least and OwnMass the mean over the own selections.
	Mass    float64 `json:"mass"`
	MinMass float64 `json:"min_mass"`
	OwnMass float64 `json:"own_mass"`
	// Covered is the mean of p(I) plus the true mass of the clusters the
	// head approximates: the mass its output accounts for (Mass, for the
	// pure selections).
	Covered float64 `json:"covered"`
	// SuccessRate is the share of cases whose covered mass reaches P (up
	// to sparse.SuccessTolerance).
	SuccessRate float64 `json:"success_rate"`
	// RelErr is the mean and MaxRelErr the largest ‖o − ô‖/‖o‖ of the
	// policy's output ô against dense attention o.
	RelErr    float64 `json:"rel_err"`
	MaxRelErr float64 `json:"max_rel_err"`
	// BoundApplies says whether the policy attends a pure selection I, for
	// which ‖o − ô‖ ≤ 2(1 − p(I))·max‖v_i‖ holds (v_i the values of every
	// token the query could attend); not for Double-P, whose pseudo-tokens
	// change the output. BoundWorst is then the largest ‖o − ô‖ /
	// (2(1 − p(I))·max‖v_i‖ + ε), ε = 1e-12·max‖v_i‖ for rounding, ≤ 1.
	BoundApplies bool    `json:"bound_applies"`
	BoundWorst   float64 `json:"bound_worst"`
}

// compareCase is the measurement of one (P, policy, query, query head).
type compareCase struct {
	attended, own, union, approx int
	mass, ownMass, covered       float64
	relErr, bound                float64
}

// compareRef is what the measurements need of one query head at one
// query: its exact softmax over every token it could attend and dense
// attention.
type compareRef struct {
	probs, dense []float64
}

// comparer holds the state of one Compare.
type comparer struct {
	t        *trace.Trace
	opts     CompareOptions
	queries  []int
	prefill  int
	group    int
	layout   sparse.BaselineLayout
	entries  []PolicyResult // policy and budget source of each entry
	heads    []kvHead
	refs     [][]compareRef // [query a][query head]
	vmax     [][]float64    // [query a][KV head]
	cases    [][][][]compareCase
	budgets  [][]float64 // [P index][entry]: the budget a fixed-budget entry gets
	progress func()
}

// Compare measures every policy on a trace with the float64 references, at
// matched budgets. Each KV head's prefill (tokens [Sinks, Prefill)) is
// clustered once. For each evaluated query, KV head and P, the adaptive
// policies run on the query heads sharing the KV head: Tactic at P,
// Double-P at (P, DoubleP2) and the two oracles at P, all with the fixed
// tokens sparse.TacticFixedTokens(Sinks, Prefill, pos). Then, for each
// budget source S of BudgetFrom and each P, the mean size T of S's own
// selections over every case at P (the always-attended tokens included)
// is the budget of Quest, StreamingLLM and H2O at P: at a query attending
// n tokens each of their heads gets max(0, round(T) − f) middle tokens,
// f the number of tokens their layout always attends (Sinks and the
// Window recent ones), so that a head's own selection has T tokens as the
// adaptive policy's has on average (Quest takes ⌊budget/16⌋ pages, up to
// 15 fewer). H2O steps through the evaluated queries in order of
// position, per KV head, after observing H2OObserve. Every output is
// compared with dense attention over [0, pos]. Work is spread over
// goroutines; results are summed in a fixed order, so they are
// deterministic.
func Compare(t *trace.Trace, opts CompareOptions) (*Comparison, error) {
	if t == nil {
		return nil, fmt.Errorf("evaluate: Compare: no trace")
	}
	if err := t.Validate(); err != nil {
		return nil, err
	}
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	c := &comparer{t: t, opts: opts, group: t.QHeads / t.KVHeads}
	var err error
	if c.queries, c.prefill, err = opts.resolve(t, "Compare"); err != nil {
		return nil, err
	}
	c.layout = sparse.BaselineLayout{Sinks: opts.Sinks, Window: opts.Window}
	// H2O walks the queries in order of position.
	slices.SortStableFunc(c.queries, func(a, b int) int { return int(t.QPos[a]) - int(t.QPos[b]) })
	observe, err := h2oObserved(t, c.queries, opts.H2OObserve)
	if err != nil {
		return nil, err
	}
	out := &Comparison{Tokens: t.Tokens, QHeads: t.QHeads, KVHeads: t.KVHeads, HeadDim: t.HeadDim, Options: opts}
	out.Options.Prefill, out.Options.Queries, out.Options.H2OObserve = c.prefill, slices.Clone(c.queries), observe
	out.Options.BudgetFrom, out.Options.P = slices.Clone(opts.BudgetFrom), slices.Clone(opts.P)
	out.Options.Policies = opts.policies()
	out.Options.Progress = nil
	if kinds, err := workload.KindsOf(t); err == nil {
		for _, k := range kinds {
			out.Kinds = append(out.Kinds, k.String())
		}
	}
	h2o := c.listEntries()
	nq, np := len(c.queries), len(opts.P)
	c.allocate()
	workers := opts.workers()
	c.progress = opts.counter(t.KVHeads * (1 + 2*nq + np*len(h2o)))

	// Cluster every KV head's prefill once.
	rows := 0
	for _, qi := range append(slices.Clone(c.queries), observe...) {
		rows = max(rows, int(t.QPos[qi])+1)
	}
	if c.heads, err = opts.clusterHeads(t, rows, c.prefill, c.progress); err != nil {
		return nil, err
	}
	// The adaptive policies, and the references of every (query, head).
	err = parallelFor(nq*t.KVHeads, workers, func(i int) error {
		err := c.adaptive(i/t.KVHeads, i%t.KVHeads)
		c.progress()
		return err
	})
	if err != nil {
		return nil, err
	}
	c.matchBudgets()
	// Quest and StreamingLLM per (query, KV head); H2O per (KV head, P,
	// budget source), stepping through the queries.
	err = parallelFor(nq*t.KVHeads, workers, func(i int) error {
		err := c.fixedBudget(i/t.KVHeads, i%t.KVHeads)
		c.progress()
		return err
	})
	if err != nil {
		return nil, err
	}
	err = parallelFor(t.KVHeads*np*len(h2o), workers, func(i int) error {
		g, rest := i/(np*len(h2o)), i%(np*len(h2o))
		err := c.runH2O(g, rest/len(h2o), h2o[rest%len(h2o)], observe)
		c.progress()
		return err
	})
	if err != nil {
		return nil, err
	}
	out.Results = c.results(out.Kinds)
	return out, nil
}

// h2oObserved returns the queries H2O observes before the evaluated ones
// (sorted by position), in order of position: observe, or where it is
// nil every query not evaluated that comes before the first evaluated
// one. It refuses a query outside the trace or after the first evaluated.
func h2oObserved(t *trace.Trace, queries, observe []int) ([]int, error) {
	if observe == nil {
		observe = []int{}
		evaluated := map[int]bool{}
		for _, qi := range queries {
			evaluated[qi] = true
		}
		for qi := 0; qi < t.Queries(); qi++ {
			if !evaluated[qi] && t.QPos[qi] < t.QPos[queries[0]] {
				observe = append(observe, qi)
			}
		}
	}
	observe = slices.Clone(observe)
	slices.SortStableFunc(observe, func(a, b int) int { return int(t.QPos[a]) - int(t.QPos[b]) })
	for _, qi := range observe {
		if qi < 0 || qi >= t.Queries() || t.QPos[qi] > t.QPos[queries[0]] {
			return nil, fmt.Errorf("evaluate: Compare: H2O observes query %d, outside [0, %d) or after the first evaluated one", qi, t.Queries())
		}
	}
	return observe, nil
}

// listEntries lists the entries the options ask for: the adaptive
// policies, then the fixed-budget policies for each budget source. It
// returns the entries of H2O.
func (c *comparer) listEntries() (h2o []int) {
	run := c.opts.policies()
	for _, p := range AdaptivePolicies() {
		if slices.Contains(run, p) {
			c.entries = append(c.entries, PolicyResult{Policy: p})
		}
	}
	for _, from := range c.opts.BudgetFrom {
		for _, p := range FixedBudgetPolicies() {
			if slices.Contains(run, p) {
				c.entries = append(c.entries, PolicyResult{Policy: p, BudgetFrom: from})
			}
		}
	}
	for e, en := range c.entries {
		if en.Policy == PolicyH2O {
			h2o = append(h2o, e)
		}
	}
	return h2o
}

// allocate makes the cases ([P][entry][query][query head]), the budgets
// ([P][entry]), the references ([query][query head]) and the value
// maxima ([query][KV head]).
func (c *comparer) allocate() {
	t, nq, np := c.t, len(c.queries), len(c.opts.P)
	c.cases = make([][][][]compareCase, np)
	c.budgets = make([][]float64, np)
	for pi := range c.cases {
		c.cases[pi] = make([][][]compareCase, len(c.entries))
		c.budgets[pi] = make([]float64, len(c.entries))
		for e := range c.cases[pi] {
			c.cases[pi][e] = make([][]compareCase, nq)
			for a := range c.cases[pi][e] {
				c.cases[pi][e][a] = make([]compareCase, t.QHeads)
			}
		}
	}
	c.refs = make([][]compareRef, nq)
	c.vmax = make([][]float64, nq)
	for a := range c.refs {
		c.refs[a] = make([]compareRef, t.QHeads)
		c.vmax[a] = make([]float64, t.KVHeads)
	}
}

// matchBudgets sets each fixed-budget entry's budget at each P: the mean
// size of its budget source's own selections over every case at P.
func (c *comparer) matchBudgets() {
	for pi := range c.opts.P {
		for e, en := range c.entries {
			if en.BudgetFrom == "" {
				continue
			}
			src := slices.IndexFunc(c.entries, func(x PolicyResult) bool { return x.Policy == en.BudgetFrom && x.BudgetFrom == "" })
			sum, n := 0.0, 0
			for _, row := range c.cases[pi][src] {
				for _, cs := range row {
					sum += float64(cs.own)
					n++
				}
			}
			c.budgets[pi][e] = sum / float64(n)
		}
	}
}

// results gathers the cases into a result per P: per entry, its
// statistics over every case and per query head (of kind kinds[h] where
// kinds is not nil).
func (c *comparer) results(kinds []string) []CompareResult {
	var out []CompareResult
	for pi, p := range c.opts.P {
		r := CompareResult{P: p}
		for e, en := range c.entries {
			pr := PolicyResult{Policy: en.Policy, BudgetFrom: en.BudgetFrom, Budget: c.budgets[pi][e]}
			bound := en.Policy != PolicyDoubleP
			var all []compareCase
			for h := 0; h < c.t.QHeads; h++ {
				var hc []compareCase
				for a := range c.queries {
					hc = append(hc, c.cases[pi][e][a][h])
				}
				all = append(all, hc...)
				head := PolicyHead{Head: h, KVHead: h / c.group, PolicyStats: compareStats(hc, p, bound)}
				if kinds != nil {
					head.Kind = kinds[h]
				}
				pr.Heads = append(pr.Heads, head)
			}
			pr.PolicyStats = compareStats(all, p, bound)
			r.Policies = append(r.Policies, pr)
		}
		out = append(out, r)
	}
	return out
}

// Validate reports the first problem with the options that does not
// depend on the trace (Compare checks the rest).
func (o *CompareOptions) Validate() error {
	if err := o.validate("Compare"); err != nil {
		return err
	}
	switch {
	case o.Window < 0:
		return fmt.Errorf("evaluate: Compare: a window of %d", o.Window)
	case !(o.DoubleP2 > 0 && o.DoubleP2 <= 1):
		return fmt.Errorf("evaluate: Compare: Double-P's P2 = %v outside (0, 1]", o.DoubleP2)
	}
	all := append(AdaptivePolicies(), FixedBudgetPolicies()...)
	run := o.policies()
	seen := map[string]bool{}
	fixed := false
	for _, p := range run {
		if !slices.Contains(all, p) || seen[p] {
			return fmt.Errorf("evaluate: Compare: policy %q repeated or not one of %v", p, all)
		}
		seen[p] = true
		fixed = fixed || slices.Contains(FixedBudgetPolicies(), p)
	}
	clear(seen)
	for _, from := range o.BudgetFrom {
		if !slices.Contains(AdaptivePolicies(), from) || seen[from] {
			return fmt.Errorf("evaluate: Compare: budget source %q repeated or not one of %v", from, AdaptivePolicies())
		}
		if fixed && !slices.Contains(run, from) {
			return fmt.Errorf("evaluate: Compare: budget source %q is not among the policies run %v", from, run)
		}
		seen[from] = true
	}
	return nil
}

// policies returns the policies to run: Policies, or every one.
func (o *CompareOptions) policies() []string {
	if o.Policies != nil {
		return slices.Clone(o.Policies)
	}
	return append(AdaptivePolicies(), FixedBudgetPolicies()...)
}

// groupQueries returns the query heads of KV head g at trace query qi in
// float64.
func (c *comparer) groupQueries(qi, g int) [][]float64 {
	d := c.t.HeadDim
	row := c.t.Query(qi)
	qs := make([][]float64, c.group)
	for j := range qs {
		qs[j] = make([]float64, d)
		for k := range qs[j] {
			qs[j][k] = float64(row[(g*c.group+j)*d+k])
		}
	}
	return qs
}

// rows returns KV head g's keys and values of the tokens [0, pos].
func (c *comparer) rows(g, pos int) (keys, values []float64) {
	d := c.t.HeadDim
	return c.heads[g].keys[:(pos+1)*d], c.heads[g].values[:(pos+1)*d]
}

// measure records the case of query a, query head h for entry e at P
// index pi: union is what the KV head attends exactly, own what h chose,
// out its output and approxMass the true mass of the clusters it
// approximates; bound says whether the error bound applies.
func (c *comparer) measure(pi, e, a, h int, union, own []int32, out []float64, approx int, approxMass float64, bound bool) error {
	ref := &c.refs[a][h]
	cs := compareCase{attended: len(ref.probs), own: len(own), union: len(union), approx: approx}
	var err error
	if cs.mass, err = sparse.SubsetMass(ref.probs, union); err != nil {
		return err
	}
	if cs.ownMass, err = sparse.SubsetMass(ref.probs, own); err != nil {
		return err
	}
	cs.covered = cs.mass + approxMass
	if cs.relErr, err = sparse.RelativeError(out, ref.dense); err != nil {
		return err
	}
	if bound {
		diff := make([]float64, len(out))
		for i := range out {
			diff[i] = out[i] - ref.dense[i]
		}
		if v := c.vmax[a][h/c.group]; v > 0 { // with vmax = 0 both sides are 0
			cs.bound = norm(diff) / (2*(1-cs.mass)*v + 1e-12*v)
		}
	}
	c.cases[pi][e][a][h] = cs
	return nil
}

// entry returns the index of the entry of policy given the budget of from.
func (c *comparer) entry(policy, from string) int {
	return slices.IndexFunc(c.entries, func(x PolicyResult) bool { return x.Policy == policy && x.BudgetFrom == from })
}

// adaptive computes the references of query a on KV head g and runs the
// adaptive policies at every P.
func (c *comparer) adaptive(a, g int) error {
	qi := c.queries[a]
	pos := int(c.t.QPos[qi])
	keys, values := c.rows(g, pos)
	d, scale := c.t.HeadDim, c.t.Scale
	idx := c.heads[g].idx
	fixed, err := sparse.TacticFixedTokens(c.opts.Sinks, c.prefill, pos)
	if err != nil {
		return err
	}
	for i := 0; i <= pos; i++ {
		c.vmax[a][g] = math.Max(c.vmax[a][g], norm(values[i*d:(i+1)*d]))
	}
	qs := c.groupQueries(qi, g)
	for j, q := range qs {
		r := &c.refs[a][g*c.group+j]
		if r.probs, err = sparse.SoftmaxRef(q, keys, scale); err != nil {
			return err
		}
		if r.dense, err = sparse.AttendRef(q, keys, values, scale); err != nil {
			return err
		}
	}
	// Double-P's per-head logits and ranks do not depend on P.
	logits := make([][]float64, len(qs))
	ranks := make([][]int, len(qs))
	for j, q := range qs {
		if logits[j], err = sparse.DoublePLogitsRef(q, scale, idx); err != nil {
			return err
		}
		ranks[j] = sparse.DoublePOrderRanks(logits[j])
	}
	for pi, p := range c.opts.P {
		if err := c.tactic(pi, a, g, p, qs, keys, values, fixed); err != nil {
			return err
		}
		if e := c.entry(PolicyDoubleP, ""); e >= 0 {
			if err := c.doubleP(pi, e, a, g, p, qs, keys, values, fixed, logits, ranks); err != nil {
				return err
			}
		}
		if err := c.oracles(pi, a, g, p, qs, keys, values, fixed); err != nil {
			return err
		}
	}
	return nil
}

// tactic runs Tactic for query a on KV head g at P index pi, if it is
// among the policies.
func (c *comparer) tactic(pi, a, g int, p float64, qs [][]float64, keys, values []float64, fixed []int32) error {
	e := c.entry(PolicyTactic, "")
	if e < 0 {
		return nil
	}
	idx := c.heads[g].idx
	outs, union, budgets, err := sparse.TacticDecodeRef(qs, keys, values, c.t.Scale, idx, fixed, p, c.opts.Fit)
	if err != nil {
		return err
	}
	for j := range qs {
		own := sparse.TacticSelectRef(idx, fixed, budgets[j])
		if err := c.measure(pi, e, a, g*c.group+j, union, own, outs[j], 0, 0, true); err != nil {
			return err
		}
	}
	return nil
}

// doubleP runs Double-P at (P1, P2) = (p, DoubleP2) for query a on KV head
// g at P index pi, entry e, given every head's cluster logits and ranks. A
// head's own selection is the fixed tokens and the clusters before its
// exact cut; the clusters it approximates count towards its covered mass.
func (c *comparer) doubleP(pi, e, a, g int, p float64, qs [][]float64, keys, values []float64, fixed []int32, logits [][]float64, ranks [][]int) error {
	idx := c.heads[g].idx
	clusterMass := func(h int, cl int32) float64 {
		m := 0.0
		for _, t := range idx.Members[cl] {
			m += c.refs[a][h].probs[t]
		}
		return m
	}
	dp := sparse.DoubleP{P1: p, P2: c.opts.DoubleP2}
	outs, union, approx, err := sparse.DoublePDecodeRef(qs, keys, values, c.t.Scale, idx, fixed, dp)
	if err != nil {
		return err
	}
	for j := range qs {
		exact, _ := sparse.DoublePCutsRef(logits[j], ranks[j], idx.Clusters(), dp)
		own := slices.Clone(fixed)
		for cl, r := range ranks[j] {
			if r < exact {
				own = append(own, idx.Members[cl]...)
			}
		}
		own = sparse.UnionTokens(own)
		am := 0.0
		for _, cl := range approx[j] {
			am += clusterMass(g*c.group+j, cl)
		}
		if err := c.measure(pi, e, a, g*c.group+j, union, own, outs[j], len(approx[j]), am, false); err != nil {
			return err
		}
	}
	return nil
}

// oracles runs the oracles among the policies for query a on KV head g at
// P index pi.
func (c *comparer) oracles(pi, a, g int, p float64, qs [][]float64, keys, values []float64, fixed []int32) error {
	idx, scale := c.heads[g].idx, c.t.Scale
	for _, o := range []struct {
		policy string
		run    func() ([][]float64, []int32, [][]int32, error)
	}{
		{PolicyTokenOracle, func() ([][]float64, []int32, [][]int32, error) {
			return sparse.TokenOracleDecodeRef(qs, keys, values, scale, fixed, p)
		}},
		{PolicyClusterOracle, func() ([][]float64, []int32, [][]int32, error) {
			return sparse.ClusterOracleDecodeRef(qs, keys, values, scale, idx, fixed, p)
		}},
	} {
		e := c.entry(o.policy, "")
		if e < 0 {
			continue
		}
		outs, union, own, err := o.run()
		if err != nil {
			return err
		}
		for j := range qs {
			if err := c.measure(pi, e, a, g*c.group+j, union, own[j], outs[j], 0, 0, true); err != nil {
				return err
			}
		}
	}
	return nil
}

// middleBudget returns the middle tokens a fixed-budget policy gets at a
// query attending n tokens for a mean own selection of budget tokens.
func (c *comparer) middleBudget(budget float64, n int) int {
	return max(0, int(math.Round(budget))-len(c.layout.Fixed(n)))
}

// fixedBudget runs Quest and StreamingLLM for query a on KV head g at every
// P and budget source.
func (c *comparer) fixedBudget(a, g int) error {
	qi := c.queries[a]
	pos := int(c.t.QPos[qi])
	keys, values := c.rows(g, pos)
	qs := c.groupQueries(qi, g)
	for pi := range c.opts.P {
		for e, en := range c.entries {
			if en.BudgetFrom == "" {
				continue
			}
			b := c.middleBudget(c.budgets[pi][e], pos+1)
			switch en.Policy {
			case PolicyQuest:
				outs, union, own, err := sparse.QuestDecodeRef(qs, keys, values, c.t.Scale, c.layout, b)
				if err != nil {
					return err
				}
				for j := range qs {
					if err := c.measure(pi, e, a, g*c.group+j, union, own[j], outs[j], 0, 0, true); err != nil {
						return err
					}
				}
			case PolicyStreaming:
				outs, union, err := sparse.StreamingDecodeRef(qs, keys, values, c.t.Scale, c.layout, b)
				if err != nil {
					return err
				}
				for j := range qs {
					if err := c.measure(pi, e, a, g*c.group+j, union, union, outs[j], 0, 0, true); err != nil {
						return err
					}
				}
			}
		}
	}
	return nil
}

// runH2O runs H2O on KV head g for entry e at P index pi: it observes the
// queries observe, then steps through the evaluated queries in order.
func (c *comparer) runH2O(g, pi, e int, observe []int) error {
	h, err := sparse.NewH2O(c.group, c.layout)
	if err != nil {
		return err
	}
	for _, qi := range observe {
		keys, _ := c.rows(g, int(c.t.QPos[qi]))
		if err := h.Observe(c.groupQueries(qi, g), keys, c.t.Scale); err != nil {
			return err
		}
	}
	for a, qi := range c.queries {
		pos := int(c.t.QPos[qi])
		keys, values := c.rows(g, pos)
		outs, union, own, err := h.Step(c.groupQueries(qi, g), keys, values, c.t.Scale, c.middleBudget(c.budgets[pi][e], pos+1))
		if err != nil {
			return err
		}
		for j := range outs {
			if err := c.measure(pi, e, a, g*c.group+j, union, own[j], outs[j], 0, 0, true); err != nil {
				return err
			}
		}
	}
	return nil
}

// compareStats aggregates cases at target mass p; bound says whether the
// error bound applies.
func compareStats(cases []compareCase, p float64, bound bool) PolicyStats {
	s := PolicyStats{Cases: len(cases), MinMass: math.Inf(1), BoundApplies: bound}
	if len(cases) == 0 {
		s.MinMass = 0
		return s
	}
	for _, c := range cases {
		s.Attended += float64(c.attended)
		s.Own += float64(c.own)
		s.Union += float64(c.union)
		s.OwnFrac += float64(c.own) / float64(c.attended)
		s.UnionFrac += float64(c.union) / float64(c.attended)
		s.Approximated += float64(c.approx)
		s.Mass += c.mass
		s.MinMass = math.Min(s.MinMass, c.mass)
		s.OwnMass += c.ownMass
		s.Covered += c.covered
		if c.covered >= p-sparse.SuccessTolerance {
			s.SuccessRate++
		}
		s.RelErr += c.relErr
		s.MaxRelErr = math.Max(s.MaxRelErr, c.relErr)
		if bound {
			s.BoundWorst = math.Max(s.BoundWorst, c.bound)
		}
	}
	n := float64(len(cases))
	for _, x := range []*float64{&s.Attended, &s.Own, &s.Union, &s.OwnFrac, &s.UnionFrac, &s.Approximated, &s.Mass, &s.OwnMass, &s.Covered, &s.SuccessRate, &s.RelErr} {
		*x /= n
	}
	return s
}

// Curve returns the figures of policy (given the budget of from, "" for
// an adaptive policy) at every P, in ascending order of the union size:
// the policy's curve of tokens attended against mass and error.
func (c *Comparison) Curve(policy, from string) []PolicyResult {
	var out []PolicyResult
	for i := range c.Results {
		if r := c.Results[i].Policy(policy, from); r != nil {
			out = append(out, *r)
		}
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].Union < out[j].Union })
	return out
}
