package sparse

import (
	"fmt"
	"math"
)

// H2OSplit divides a budget of middle tokens between H2O's two parts the
// way the H2O paper's usual setting does, half heavy hitters and half
// recent tokens: heavy = ⌊budget/2⌋, recent = budget − heavy (the recent
// part takes the odd token).
func H2OSplit(budget int) (heavy, recent int) {
	heavy = budget / 2
	return heavy, budget - heavy
}

// H2O is the float64 reference of H2O (heavy-hitter oracle) as a decode
// policy over a full KV cache, in the layout of BaselineLayout, for the
// query heads that share one KV head. Its state is, per query head h, the
// attention each token has accumulated, A_h[t]: the sum, over the steps
// the head has attended, of the softmax weight the head gave token t at
// that step (0 for a token never attended).
//
// A step of a query attending n tokens with a budget B of middle tokens
// (Middle [lo, hi) = Layout.Middle(n)) selects, per head h (Select):
//
//   - the fixed tokens of Layout (sinks and recent window);
//   - the recent part: the R most recent middle tokens [max(lo, hi−R), hi),
//     with (H, R) = H2OSplit(B);
//   - the heavy part: the H tokens of [lo, hi−R) with the greatest A_h,
//     ties broken by the lower token id;
//   - every middle token instead when B ≥ hi − lo.
//
// The KV head attends the union I of the heads' selections; each head's
// output is AttendSubsetRef over I, and then every head adds its softmax
// weights over I, w_t = exp(s_t − m) / Σ_{u∈I} exp(s_u − m) (s = scale·q·k,
// m = max over I, sums in ascending token order), to A_h[t] for t in I.
// A selection uses the state before its own step's accumulation.
//
// Observe is the analogue of H2O's prompt phase, whose attention is dense:
// every head adds its softmax over all n tokens (SoftmaxRef) to A_h without
// selecting. Without it, the first steps rank unattended tokens by id.
//
// Tokens only come after those already known: a step or observation over
// n tokens needs n ≥ the most tokens seen so far, and new tokens start at
// A = 0.
type H2O struct {
	Layout BaselineLayout
	acc    [][]float64
	steps  int
}

// NewH2O returns the state of H2O for heads query heads, nothing
// accumulated.
func NewH2O(heads int, layout BaselineLayout) (*H2O, error) {
	if heads <= 0 {
		return nil, fmt.Errorf("sparse: NewH2O: %d query heads", heads)
	}
	if err := layout.Validate(); err != nil {
		return nil, err
	}
	return &H2O{Layout: layout, acc: make([][]float64, heads)}, nil
}

// Heads returns the number of query heads.
func (h *H2O) Heads() int { return len(h.acc) }

// Steps returns the number of steps taken (observations not counted).
func (h *H2O) Steps() int { return h.steps }

// Accumulated returns a copy of head j's accumulated attention A_j, one
// entry per token seen so far.
func (h *H2O) Accumulated(j int) []float64 { return append([]float64(nil), h.acc[j]...) }

// grow extends every head's accumulation to n tokens, or reports an error
// if n is below the tokens already seen or the query heads do not match.
func (h *H2O) grow(name string, qs [][]float64, n int) error {
	if len(qs) != len(h.acc) {
		return fmt.Errorf("sparse: H2O.%s: %d query heads, the state has %d", name, len(qs), len(h.acc))
	}
	if n < len(h.acc[0]) {
		return fmt.Errorf("sparse: H2O.%s: %d tokens, fewer than the %d already seen", name, n, len(h.acc[0]))
	}
	for j := range h.acc {
		h.acc[j] = append(h.acc[j], make([]float64, n-len(h.acc[j]))...)
	}
	return nil
}

// Observe adds, for every query head j, its dense softmax over the n rows
// of keys (SoftmaxRef(qs[j], keys, scale)) to A_j, selecting nothing.
func (h *H2O) Observe(qs [][]float64, keys []float64, scale float64) error {
	n, err := checkHeads("H2O.Observe", qs, keys, keys)
	if err != nil {
		return err
	}
	probs := make([][]float64, len(qs))
	for j, q := range qs {
		if probs[j], err = SoftmaxRef(q, keys, scale); err != nil {
			return err
		}
	}
	if err := h.grow("Observe", qs, n); err != nil {
		return err
	}
	for j, p := range probs {
		for t, w := range p {
			h.acc[j][t] += w
		}
	}
	return nil
}

// Select returns query head j's selection at a step over n tokens with a
// budget of middle tokens, from the current state (see H2O), ascending. n
// must be at least the tokens seen so far.
func (h *H2O) Select(j, n, budget int) ([]int32, error) {
	if j < 0 || j >= len(h.acc) {
		return nil, fmt.Errorf("sparse: H2O.Select: query head %d outside [0, %d)", j, len(h.acc))
	}
	if err := checkBudget("H2O.Select", h.Layout, budget); err != nil {
		return nil, err
	}
	if n < len(h.acc[j]) || n > 1<<31-1 {
		return nil, fmt.Errorf("sparse: H2O.Select: %d tokens, fewer than the %d already seen", n, len(h.acc[j]))
	}
	lo, hi := h.Layout.Middle(n)
	out := h.Layout.Fixed(n)
	if budget >= hi-lo {
		for t := lo; t < hi; t++ {
			out = append(out, int32(t))
		}
		return UnionTokens(out), nil
	}
	heavy, recent := H2OSplit(budget)
	split := max(lo, hi-recent)
	for t := split; t < hi; t++ {
		out = append(out, int32(t))
	}
	acc := h.acc[j]
	score := func(t int) float64 {
		if t < len(acc) {
			return acc[t]
		}
		return 0
	}
	cand := make([]int32, 0, split-lo)
	for t := lo; t < split; t++ {
		cand = append(cand, int32(t))
	}
	sortDescending(cand, func(t int32) float64 { return score(int(t)) })
	out = append(out, cand[:min(heavy, len(cand))]...)
	return UnionTokens(out), nil
}

// Step runs one decode step of the query heads qs over keys and values
// (n×d each, the tokens [0, n) the query attends) with a budget of middle
// tokens: it returns each head's output, the union of the selections and
// each head's own selection (Select), and then accumulates the step's
// weights (see H2O).
func (h *H2O) Step(qs [][]float64, keys, values []float64, scale float64, budget int) (outs [][]float64, tokens []int32, own [][]int32, err error) {
	n, err := checkHeads("H2O.Step", qs, keys, values)
	if err != nil {
		return nil, nil, nil, err
	}
	if len(qs) != len(h.acc) {
		return nil, nil, nil, fmt.Errorf("sparse: H2O.Step: %d query heads, the state has %d", len(qs), len(h.acc))
	}
	own = make([][]int32, len(qs))
	for j := range qs {
		if own[j], err = h.Select(j, n, budget); err != nil {
			return nil, nil, nil, err
		}
	}
	tokens = UnionTokens(own...)
	if outs, err = attendHeads(qs, keys, values, tokens, scale); err != nil {
		return nil, nil, nil, err
	}
	if err := h.grow("Step", qs, n); err != nil {
		return nil, nil, nil, err
	}
	d := len(qs[0])
	s := make([]float64, len(tokens))
	for j, q := range qs {
		m := math.Inf(-1)
		for i, t := range tokens {
			s[i] = scale * dot(q, keys[int(t)*d:int(t+1)*d])
			m = math.Max(m, s[i])
		}
		z := 0.0
		for i := range s {
			s[i] = math.Exp(s[i] - m)
			z += s[i]
		}
		for i, t := range tokens {
			h.acc[j][t] += s[i] / z
		}
	}
	h.steps++
	return outs, tokens, own, nil
}
