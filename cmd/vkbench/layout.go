package main

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/vksparse/vksparse/decode"
	"github.com/vksparse/vksparse/sparse"
)

// layoutSpec is one layout of vkbench generate: a policy for some layers,
// dense attention for the others. A fixed-budget policy's budget is given,
// or matched per layer to the tokens another layout attended (budgetFrom).
type layoutSpec struct {
	Name   string `json:"name"`
	Policy string `json:"policy"` // dense, tactic, doublep, oracle, cluster-oracle, quest, streaming, h2o
	P      float64
	// Curve is set for tactic:P/curve, Tactic with the paper's fitted
	// curve (sparse.TacticCurveFit) instead of the default fit.
	Curve       bool `json:"curve,omitempty"`
	Targets     sparse.DoubleP
	Budget      int    `json:"budget,omitempty"`
	BudgetFrom  string `json:"budget_from,omitempty"` // tactic or doublep: matched to that layout over the same layers
	Layers      []bool `json:"-"`
	LayerSpec   string `json:"layers"`
	Delta       sparse.Delta
	LuKA        sparse.LuKA
	Mixed       bool `json:"mixed,omitempty"`        // luka: LuKA's mixed mode (H2O at both ends)
	LinedBudget int  `json:"lined_budget,omitempty"` // luka mixed: the H2O layers' budget
	// Tokens is the prefill, for matching LuKA's refinement to a budget.
	Tokens int `json:"-"`
}

// matchSpec is the layers whose budgets a matched layout takes: its own,
// or all for layouts that span the model (DELTA, LuKA's mixed mode).
func (l layoutSpec) matchSpec() string {
	if l.Policy == "delta" || (l.Policy == "luka" && l.Mixed) {
		return "all"
	}
	return l.LayerSpec
}

// parseLayouts reads layouts separated by ";", each POLICY[:ARGS][@LAYERS]:
// dense, tactic:P (tactic:P/curve: the paper's fitted curve),
// doublep:P1/P2, oracle:P (tokens), cluster-oracle:P, quest:B,
// streaming:B, h2o:B with B a budget of middle tokens or tactic or
// doublep (that layout's tokens over the same layers), delta:K/L
// (pages and recent pages; 64/8 by default) whose LAYERS are its Δ-layers
// (2 by default; the first ends the dense warm-up) and K may be tactic or
// doublep (the mean of that layout's tokens over all layers, in pages),
// luka:OPT/OPT/… with OPT one of topN, epsX, rhoX (the refinement rule;
// top3 by default), mean, weighted or random (the compressor; weighted
// by default), tactic or doublep (top-K with K matched per layer to that
// layout's tokens), logsize (summaries weigh ln P more: sparse.LuKA.LogSize),
// mixed (LuKA's mixed mode: H2O in the first and last layers, LAYERS
// ignored) and h2o=B (the mixed mode's H2O budget, 2 048
// by default); LAYERS is all (the default), a range a-b or a list a,b,c
// of layers in [0, layers).
func parseLayouts(s string, layers int) ([]layoutSpec, error) {
	var out []layoutSpec
	for _, item := range strings.Split(s, ";") {
		item = strings.TrimSpace(item)
		if item == "" {
			continue
		}
		l, err := parseLayout(item, layers)
		if err != nil {
			return nil, fmt.Errorf("layout %q: %w", item, err)
		}
		out = append(out, l)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("no layout in %q", s)
	}
	return out, nil
}

func parseLayout(item string, layers int) (layoutSpec, error) {
	l := layoutSpec{Name: item, LayerSpec: "all"}
	pol, where, hasLayers := strings.Cut(item, "@")
	if hasLayers {
		l.LayerSpec = where
	} else if strings.HasPrefix(pol, "delta") {
		l.LayerSpec = "2"
	}
	var err error
	if l.Layers, err = parseLayers(l.LayerSpec, layers); err != nil {
		return l, err
	}
	name, args, _ := strings.Cut(pol, ":")
	l.Policy = name
	prob := func() (float64, error) {
		p, err := strconv.ParseFloat(args, 64)
		if err != nil {
			return 0, fmt.Errorf("%s needs a target mass, not %q", name, args)
		}
		return p, sparse.CheckP(p)
	}
	switch name {
	case "dense":
		if args != "" {
			return l, fmt.Errorf("dense takes no argument")
		}
	case "tactic":
		var fit string
		var hasFit bool
		args, fit, hasFit = strings.Cut(args, "/")
		switch {
		case !hasFit || fit == "moments":
		case fit == "curve":
			l.Curve = true
		default:
			return l, fmt.Errorf("tactic's fit %q: want moments or curve", fit)
		}
		l.P, err = prob()
	case "oracle", "cluster-oracle":
		l.P, err = prob()
	case "doublep":
		a, b, ok := strings.Cut(args, "/")
		if args == "" {
			a, b, ok = "0.95", "0.7", true
		}
		if !ok {
			return l, fmt.Errorf("doublep needs P1/P2, not %q", args)
		}
		var errA, errB error
		l.Targets.P1, errA = strconv.ParseFloat(a, 64)
		l.Targets.P2, errB = strconv.ParseFloat(b, 64)
		if errA != nil || errB != nil || sparse.CheckP(l.Targets.P1) != nil || sparse.CheckP(l.Targets.P2) != nil {
			return l, fmt.Errorf("doublep targets %q: each in (0, 1]", args)
		}
	case "delta":
		k, r, ok := strings.Cut(args, "/")
		if args == "" {
			k, r, ok = "64", "8", true
		}
		var errK, errR error
		if k == "tactic" || k == "doublep" {
			l.BudgetFrom, k = k, "64"
		}
		l.Delta.Pages, errK = strconv.Atoi(k)
		l.Delta.Recent, errR = strconv.Atoi(r)
		if !ok || errK != nil || errR != nil {
			return l, fmt.Errorf("delta needs K/L pages, not %q", args)
		}
		for i, on := range l.Layers {
			if on {
				l.Delta.Refresh = append(l.Delta.Refresh, i)
			}
		}
		l.Delta.Warmup = l.Delta.Refresh[0]
		if _, err := decode.DeltaLayout(layers, l.Delta); err != nil {
			return l, err
		}
	case "luka":
		err = l.parseLuKA(args, layers)
	case "quest", "streaming", "h2o":
		switch args {
		case "tactic", "doublep":
			l.BudgetFrom = args
		default:
			l.Budget, err = strconv.Atoi(args)
			if err == nil && l.Budget <= 0 {
				err = fmt.Errorf("the budget %d must be positive", l.Budget)
			} else if err != nil {
				err = fmt.Errorf("%s needs a budget or tactic or doublep, not %q", name, args)
			}
		}
	default:
		return l, fmt.Errorf("unknown policy %q", name)
	}
	return l, err
}

// parseLuKA reads luka's options.
func (l *layoutSpec) parseLuKA(args string, layers int) error {
	l.LuKA = sparse.DefaultLuKA()
	l.LinedBudget = 2048
	for _, opt := range strings.Split(args, "/") {
		var err error
		switch {
		case opt == "":
		case opt == "mean":
			l.LuKA.Compressor = sparse.LuKAMean
		case opt == "weighted":
			l.LuKA.Compressor = sparse.LuKAWeighted
		case opt == "random":
			l.LuKA.Compressor = sparse.LuKARandom
		case opt == "tactic" || opt == "doublep":
			l.BudgetFrom = opt
			l.LuKA.Rule = sparse.RefineTopK
		case opt == "logsize":
			l.LuKA.LogSize = true
		case opt == "mixed":
			l.Mixed = true
			l.LayerSpec = "all"
		case strings.HasPrefix(opt, "top"):
			l.LuKA.Rule = sparse.RefineTopK
			l.LuKA.K, err = strconv.Atoi(opt[3:])
		case strings.HasPrefix(opt, "eps"):
			l.LuKA.Rule = sparse.RefineThreshold
			l.LuKA.Epsilon, err = strconv.ParseFloat(opt[3:], 64)
		case strings.HasPrefix(opt, "rho"):
			l.LuKA.Rule = sparse.RefineFraction
			l.LuKA.Rho, err = strconv.ParseFloat(opt[3:], 64)
		case strings.HasPrefix(opt, "h2o="):
			l.LinedBudget, err = strconv.Atoi(opt[4:])
			if err == nil && l.LinedBudget <= 0 {
				err = fmt.Errorf("the H2O budget %d must be positive", l.LinedBudget)
			}
		default:
			return fmt.Errorf("luka option %q: topN, epsX, rhoX, mean, weighted, random, tactic, doublep, logsize, mixed or h2o=B", opt)
		}
		if err == nil && (l.LuKA.K < 1 || !(l.LuKA.Epsilon > 0) || !(l.LuKA.Rho > 0)) {
			err = fmt.Errorf("K, ε and ρ must be positive")
		}
		if err != nil {
			return fmt.Errorf("luka option %q: %w", opt, err)
		}
	}
	if _, err := l.LuKA.Resolve(); err != nil {
		return err
	}
	if l.Mixed {
		_, err := decode.LuKALayout(layers, decode.LuKAMixed, l.LuKA, decode.H2O(l.LinedBudget))
		return err
	}
	return nil
}

// lukaMatched returns LuKA's options with top-K refinement matched to
// attend about tokens rows per KV head over a prefill of n tokens: the
// cover (summaries and the raw tail), then K summaries of P tokens for
// each of the group's query heads.
func lukaMatched(o sparse.LuKA, tokens float64, n, group int) sparse.LuKA {
	o, _ = o.Resolve()
	s := o.Summaries(n)
	cover := float64(s + n - s*o.Segment)
	o.Rule = sparse.RefineTopK
	o.K = max(1, min(s, int((tokens-cover)/float64(group*o.Segment)+0.5)))
	return o
}

// parseLayers reads all, a-b or a,b,c into a mask of layers.
func parseLayers(s string, layers int) ([]bool, error) {
	mask := make([]bool, layers)
	if s == "all" {
		for i := range mask {
			mask[i] = true
		}
		return mask, nil
	}
	set := func(i int) error {
		if i < 0 || i >= layers {
			return fmt.Errorf("layer %d outside [0, %d)", i, layers)
		}
		mask[i] = true
		return nil
	}
	if a, b, ok := strings.Cut(s, "-"); ok {
		lo, errA := strconv.Atoi(a)
		hi, errB := strconv.Atoi(b)
		if errA != nil || errB != nil || lo > hi {
			return nil, fmt.Errorf("layers %q: a range a-b with a ≤ b", s)
		}
		for i := lo; i <= hi; i++ {
			if err := set(i); err != nil {
				return nil, err
			}
		}
		return mask, nil
	}
	for _, f := range strings.Split(s, ",") {
		i, err := strconv.Atoi(f)
		if err != nil {
			return nil, fmt.Errorf("layers %q: all, a-b or a,b,c", s)
		}
		if err := set(i); err != nil {
			return nil, err
		}
	}
	return mask, nil
}

// policies returns the layout's decode policies, budgets[l] standing in
// for a matched budget at layer l.
func (l layoutSpec) policies(budgets []int, group int) []decode.Policy {
	middle := sparse.BaselineSinks + sparse.BaselineWindow // matched budgets count the middle only
	switch {
	case l.Policy == "delta":
		d := l.Delta
		if l.BudgetFrom != "" {
			sum := 0
			for _, b := range budgets {
				sum += b + middle
			}
			size := d.PageSize
			if size == 0 {
				size = sparse.DefaultDelta().PageSize
			}
			d.Pages = max(d.Recent+1, int(float64(sum)/float64(len(budgets)*size)+0.5))
		}
		out, _ := decode.DeltaLayout(len(l.Layers), d) // checked when parsed
		return out
	case l.Policy == "luka" && l.Mixed:
		out, _ := decode.LuKALayout(len(l.Layers), decode.LuKAMixed, l.LuKA, decode.H2O(l.LinedBudget)) // checked when parsed
		if l.BudgetFrom != "" {
			for i, p := range out {
				if p.Budget() == 0 {
					out[i] = decode.LuKA(lukaMatched(l.LuKA, float64(budgets[i]+middle), l.Tokens, group))
				}
			}
		}
		return out
	}
	out := make([]decode.Policy, len(l.Layers))
	for i, on := range l.Layers {
		if !on {
			continue
		}
		b := l.Budget
		if l.BudgetFrom != "" {
			b = max(budgets[i], 16)
		}
		switch l.Policy {
		case "tactic":
			var opts sparse.TacticDecoderOptions
			if l.Curve {
				opts.Fit = sparse.TacticCurveFit()
			}
			out[i] = decode.Tactic(l.P, opts)
		case "doublep":
			out[i] = decode.DoubleP(l.Targets, sparse.TacticDecoderOptions{})
		case "oracle":
			out[i] = decode.TokenOracle(l.P)
		case "cluster-oracle":
			out[i] = decode.ClusterOracle(l.P, sparse.TacticDecoderOptions{})
		case "quest":
			out[i] = decode.Quest(b)
		case "streaming":
			out[i] = decode.StreamingLLM(b)
		case "h2o":
			out[i] = decode.H2O(b)
		case "luka":
			o := l.LuKA
			if l.BudgetFrom != "" {
				o = lukaMatched(o, float64(budgets[i]+middle), l.Tokens, group)
			}
			out[i] = decode.LuKA(o)
		}
	}
	return out
}

// sparseLayers counts the layers the layout attends sparsely.
func (l layoutSpec) sparseLayers() int {
	if l.Policy == "delta" {
		return len(l.Layers) - l.Delta.Warmup
	}
	if l.Policy == "luka" && l.Mixed {
		return len(l.Layers)
	}
	n := 0
	for _, on := range l.Layers {
		if on && l.Policy != "dense" {
			n++
		}
	}
	return n
}
