package sparse

import (
	"cmp"
	"fmt"
	"slices"
)

// The fixed-budget baselines (StreamingLLM here, Quest in quest_ref.go, H2O
// in h2o_ref.go) share one token layout, the one the Double-P paper's
// comparison uses (its section 5.1): for a query attending tokens [0, n),
//
//	[0, Sinks)           attention sinks: always attended exactly
//	[Sinks, n − Window)  the middle: each policy spends its budget here
//	[n − Window, n)      the recent window: always attended exactly
//
// (the sinks win where the two overlap, for n < Sinks + Window). The budget
// of a policy is a number of middle tokens; a budget at least the size of
// the middle attends every token. Under GQA every query head selects, and
// the KV head attends the union of its query heads' selections
// (UnionTokens), as TacticSelectRef does for Tactic.

// BaselineSinks and BaselineWindow are the sinks and recent window of the
// Double-P paper's comparison (4 and 64 tokens).
const (
	BaselineSinks  = 4
	BaselineWindow = 64
)

// BaselineLayout is the token layout the fixed-budget baselines share: the
// first Sinks and the last Window tokens are attended exactly, the budget
// is spent on the middle between them.
type BaselineLayout struct {
	Sinks  int `json:"sinks"`
	Window int `json:"window"`
}

// DefaultBaselineLayout returns BaselineSinks sinks and a recent window of
// BaselineWindow tokens.
func DefaultBaselineLayout() BaselineLayout {
	return BaselineLayout{Sinks: BaselineSinks, Window: BaselineWindow}
}

// Validate reports an error unless Sinks ≥ 0 and Window ≥ 0.
func (l BaselineLayout) Validate() error {
	if l.Sinks < 0 || l.Window < 0 {
		return fmt.Errorf("sparse: BaselineLayout %+v: sinks and window must not be negative", l)
	}
	return nil
}

// Middle returns the middle [lo, hi) of n tokens: lo = min(Sinks, n),
// hi = max(lo, n − Window).
func (l BaselineLayout) Middle(n int) (lo, hi int) {
	lo = min(l.Sinks, n)
	hi = max(lo, n-l.Window)
	return lo, hi
}

// Fixed returns the always-attended tokens of n tokens, [0, lo) ∪ [hi, n)
// with [lo, hi) = Middle(n), ascending.
func (l BaselineLayout) Fixed(n int) []int32 {
	lo, hi := l.Middle(n)
	out := make([]int32, 0, lo+n-hi)
	for t := 0; t < lo; t++ {
		out = append(out, int32(t))
	}
	for t := hi; t < n; t++ {
		out = append(out, int32(t))
	}
	return out
}

// UnionTokens returns the union of token sets, ascending, without repeats:
// the tokens a KV head attends when each of its query heads selects one
// set.
func UnionTokens(sets ...[]int32) []int32 {
	size := 0
	for _, s := range sets {
		size += len(s)
	}
	out := make([]int32, 0, size)
	for _, s := range sets {
		out = append(out, s...)
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// sortDescending sorts ids by descending score, ties by ascending id (a
// total order for scores that are not NaN, so the result does not depend
// on the sort).
func sortDescending[T int | int32](ids []T, score func(T) float64) {
	slices.SortFunc(ids, func(a, b T) int {
		sa, sb := score(a), score(b)
		switch {
		case sa > sb:
			return -1
		case sa < sb:
			return 1
		}
		return cmp.Compare(a, b)
	})
}

// checkHeads validates the query heads qs (at least one, all of one
// length d > 0) against keys and values (n×d each, n ≥ 1) and returns n.
func checkHeads(name string, qs [][]float64, keys, values []float64) (int, error) {
	if len(qs) == 0 {
		return 0, fmt.Errorf("sparse: %s: no query heads", name)
	}
	for j, q := range qs {
		if len(q) != len(qs[0]) {
			return 0, fmt.Errorf("sparse: %s: query head %d has length %d, head 0 %d", name, j, len(q), len(qs[0]))
		}
	}
	n, err := checkKV(qs[0], keys, values)
	if err != nil {
		return 0, err
	}
	if values == nil {
		return 0, fmt.Errorf("sparse: %s: no values", name)
	}
	if n == 0 {
		return 0, fmt.Errorf("sparse: %s: no keys", name)
	}
	return n, nil
}

// checkBudget validates a budget of middle tokens and a layout.
func checkBudget(name string, layout BaselineLayout, budget int) error {
	if err := layout.Validate(); err != nil {
		return err
	}
	if budget < 0 {
		return fmt.Errorf("sparse: %s: budget %d is negative", name, budget)
	}
	return nil
}

// attendHeads returns AttendSubsetRef of every query head over tokens.
func attendHeads(qs [][]float64, keys, values []float64, tokens []int32, scale float64) ([][]float64, error) {
	outs := make([][]float64, len(qs))
	for j, q := range qs {
		var err error
		if outs[j], err = AttendSubsetRef(q, keys, values, tokens, scale); err != nil {
			return nil, err
		}
	}
	return outs, nil
}

// StreamingSelectRef returns StreamingLLM's selection for a query attending
// n tokens: the fixed tokens of layout (sinks and recent window) and the
// min(budget, hi − lo) most recent middle tokens [hi − budget, hi), with
// [lo, hi) = layout.Middle(n); that is, the sinks and the last
// Window + budget tokens. Ascending. It does not depend on the query.
func StreamingSelectRef(n int, layout BaselineLayout, budget int) ([]int32, error) {
	if err := checkBudget("StreamingSelectRef", layout, budget); err != nil {
		return nil, err
	}
	if n < 0 || n > 1<<31-1 {
		return nil, fmt.Errorf("sparse: StreamingSelectRef: %d tokens", n)
	}
	lo, hi := layout.Middle(n)
	from := max(lo, hi-budget)
	out := make([]int32, 0, lo+n-from)
	for t := 0; t < lo; t++ {
		out = append(out, int32(t))
	}
	for t := from; t < n; t++ {
		out = append(out, int32(t))
	}
	return out, nil
}

// StreamingDecodeRef runs StreamingLLM for the query heads qs sharing one
// KV head (keys and values n×d, the tokens [0, n) the query attends): every
// head selects StreamingSelectRef(n, layout, budget), so the union is that
// set, and each head's output is AttendSubsetRef over it.
func StreamingDecodeRef(qs [][]float64, keys, values []float64, scale float64, layout BaselineLayout, budget int) (outs [][]float64, tokens []int32, err error) {
	n, err := checkHeads("StreamingDecodeRef", qs, keys, values)
	if err != nil {
		return nil, nil, err
	}
	if tokens, err = StreamingSelectRef(n, layout, budget); err != nil {
		return nil, nil, err
	}
	if outs, err = attendHeads(qs, keys, values, tokens, scale); err != nil {
		return nil, nil, err
	}
	return outs, tokens, nil
}
