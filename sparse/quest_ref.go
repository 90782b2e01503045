package sparse

import (
	"fmt"
	"math"
	"sort"
)

// QuestPageSize is Quest's default page size, the one the Double-P and
// Tactic papers compare against: 16 consecutive tokens.
const QuestPageSize = 16

// QuestPages holds Quest's page metadata over the tokens [Start, End): page
// j covers tokens [Start + j·PageSize, min(Start + (j+1)·PageSize, End)) (the
// last page may be shorter), and for every channel i its least and
// greatest key element, Min[j·D+i] and Max[j·D+i].
type QuestPages struct {
	D, PageSize int
	Start, End  int
	Min, Max    []float64
}

// Pages returns the number of pages, ⌈(End − Start)/PageSize⌉.
func (p *QuestPages) Pages() int { return (p.End - p.Start + p.PageSize - 1) / p.PageSize }

// Page returns the tokens [lo, hi) of page j.
func (p *QuestPages) Page(j int) (lo, hi int) {
	lo = p.Start + j*p.PageSize
	return lo, min(lo+p.PageSize, p.End)
}

// QuestPagesRef builds the page metadata of the tokens [start, end) of keys
// (rows of dimension d), pages of pageSize tokens starting at start.
func QuestPagesRef(keys []float64, d, start, end, pageSize int) (*QuestPages, error) {
	if d <= 0 || pageSize <= 0 || start < 0 || end < start || end*d > len(keys) || len(keys)%d != 0 {
		return nil, fmt.Errorf("sparse: QuestPagesRef: tokens [%d, %d) in pages of %d not inside %d key elements of dimension %d", start, end, pageSize, len(keys), d)
	}
	p := &QuestPages{D: d, PageSize: pageSize, Start: start, End: end}
	np := p.Pages()
	p.Min = make([]float64, np*d)
	p.Max = make([]float64, np*d)
	for j := 0; j < np; j++ {
		lo, hi := p.Page(j)
		mn, mx := p.Min[j*d:(j+1)*d], p.Max[j*d:(j+1)*d]
		copy(mn, keys[lo*d:(lo+1)*d])
		copy(mx, keys[lo*d:(lo+1)*d])
		for t := lo + 1; t < hi; t++ {
			k := keys[t*d : (t+1)*d]
			for i, x := range k {
				mn[i] = math.Min(mn[i], x)
				mx[i] = math.Max(mx[i], x)
			}
		}
	}
	return p, nil
}

// BoundsRef returns, for every page j, Quest's upper bound on q·k over the
// page's keys: U_j = Σ_i max(q_i·Min_ji, q_i·Max_ji), summed over i in
// index order (unscaled: the score bound is scale·U_j for scale > 0).
func (p *QuestPages) BoundsRef(q []float64) ([]float64, error) {
	if len(q) != p.D {
		return nil, fmt.Errorf("sparse: QuestPages.BoundsRef: query of length %d for dimension %d", len(q), p.D)
	}
	u := make([]float64, p.Pages())
	for j := range u {
		s := 0.0
		for i, x := range q {
			s += math.Max(x*p.Min[j*p.D+i], x*p.Max[j*p.D+i])
		}
		u[j] = s
	}
	return u, nil
}

// QuestSelectRef returns the middle tokens one query head selects under
// Quest with a budget of budget tokens: the pages of the k greatest bounds
// (BoundsRef), ties broken by the lower page index, with k = ⌊budget /
// PageSize⌋, or every page when budget ≥ End − Start (the budget covers the
// paged tokens). Their tokens, ascending.
func QuestSelectRef(q []float64, pages *QuestPages, budget int) ([]int32, error) {
	if pages == nil {
		return nil, fmt.Errorf("sparse: QuestSelectRef: no pages")
	}
	if budget < 0 {
		return nil, fmt.Errorf("sparse: QuestSelectRef: budget %d is negative", budget)
	}
	u, err := pages.BoundsRef(q)
	if err != nil {
		return nil, err
	}
	k := min(budget/pages.PageSize, len(u))
	if budget >= pages.End-pages.Start {
		k = len(u)
	}
	order := make([]int, len(u))
	for j := range order {
		order[j] = j
	}
	sortDescending(order, func(j int) float64 { return u[j] })
	top := order[:k]
	sort.Ints(top)
	var out []int32
	for _, j := range top {
		lo, hi := pages.Page(j)
		for t := lo; t < hi; t++ {
			out = append(out, int32(t))
		}
	}
	return out, nil
}

// QuestDecodeRef runs Quest for the query heads qs sharing one KV head
// (keys and values n×d, the tokens [0, n) the query attends; scale > 0).
// The middle [lo, hi) = layout.Middle(n) is paged from lo in pages of
// QuestPageSize (QuestPagesRef); each head j selects own[j] = the fixed
// tokens of layout plus QuestSelectRef(q_j, pages, budget); tokens is the
// union of the own selections (UnionTokens), and each head's output is
// AttendSubsetRef over the union.
func QuestDecodeRef(qs [][]float64, keys, values []float64, scale float64, layout BaselineLayout, budget int) (outs [][]float64, tokens []int32, own [][]int32, err error) {
	n, err := checkHeads("QuestDecodeRef", qs, keys, values)
	if err != nil {
		return nil, nil, nil, err
	}
	if err := checkBudget("QuestDecodeRef", layout, budget); err != nil {
		return nil, nil, nil, err
	}
	if !(scale > 0) || math.IsInf(scale, 1) {
		return nil, nil, nil, fmt.Errorf("sparse: QuestDecodeRef: scale %v is not a positive number", scale)
	}
	d := len(qs[0])
	lo, hi := layout.Middle(n)
	pages, err := QuestPagesRef(keys, d, lo, hi, QuestPageSize)
	if err != nil {
		return nil, nil, nil, err
	}
	fixed := layout.Fixed(n)
	own = make([][]int32, len(qs))
	for j, q := range qs {
		mid, err := QuestSelectRef(q, pages, budget)
		if err != nil {
			return nil, nil, nil, err
		}
		own[j] = UnionTokens(fixed, mid)
	}
	tokens = UnionTokens(own...)
	if outs, err = attendHeads(qs, keys, values, tokens, scale); err != nil {
		return nil, nil, nil, err
	}
	return outs, tokens, own, nil
}
