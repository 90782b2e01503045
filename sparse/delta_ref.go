package sparse

import (
	"fmt"
	"math"
	"slices"
	"sort"
)

// Delta holds DELTA's parameters (the DELTA paper, section 4 and Algorithms 1–2): the
// first Warmup layers attend densely; each layer of Refresh (a Δ-layer)
// attends densely and picks the pages that the layers after it, up to the
// next Δ-layer, attend: the last Recent pages, and the Pages − Recent
// older pages of the greatest summed token scores, pages of PageSize
// tokens. Zero values take the paper's defaults (DefaultDelta).
type Delta struct {
	Warmup   int   // dense layers first; 0 = 2
	Refresh  []int // Δ-layers, ascending, each ≥ Warmup; nil = {Warmup}
	Pages    int   // K: pages the sparse layers attend; 0 = 64
	Recent   int   // L: of them, the most recent; 0 = 8
	PageSize int   // P: tokens a page; 0 = 16
	// RunPages is the picked pages a workgroup of a reusing layer's
	// attention takes (how the work is divided, not what is attended);
	// 0 = 8.
	RunPages int
}

// DefaultDelta returns the paper's setting: warm-up depth 2, Δ-layer {2},
// K = 64 pages of 16 tokens (1 024 tokens), L = 8.
func DefaultDelta() Delta {
	return Delta{Warmup: 2, Refresh: []int{2}, Pages: 64, Recent: 8, PageSize: QuestPageSize}
}

// Resolve returns d with the defaults in place of zero values, or why it
// cannot serve a model of layers layers.
func (d Delta) Resolve(layers int) (Delta, error) {
	def := DefaultDelta()
	if d.Warmup == 0 {
		d.Warmup = def.Warmup
	}
	if d.Refresh == nil {
		d.Refresh = []int{d.Warmup}
	}
	if d.Pages == 0 {
		d.Pages = def.Pages
	}
	if d.Recent == 0 {
		d.Recent = def.Recent
	}
	if d.PageSize == 0 {
		d.PageSize = def.PageSize
	}
	if d.RunPages == 0 {
		d.RunPages = deltaRunPages
	}
	switch {
	case d.RunPages < 0:
		return d, fmt.Errorf("sparse: DELTA's reusing layers with %d pages a workgroup", d.RunPages)
	case d.Warmup < 0 || d.Warmup >= layers:
		return d, fmt.Errorf("sparse: DELTA's warm-up depth %d outside [0, %d)", d.Warmup, layers)
	case d.Pages < 1 || d.Recent < 0 || d.PageSize < 1:
		return d, fmt.Errorf("sparse: DELTA's budget of %d pages, %d recent, pages of %d: each must be positive", d.Pages, d.Recent, d.PageSize)
	case d.Recent >= d.Pages:
		return d, fmt.Errorf("sparse: DELTA keeps %d recent pages of a budget of %d: L must be below K", d.Recent, d.Pages)
	case len(d.Refresh) == 0:
		return d, fmt.Errorf("sparse: DELTA needs at least one Δ-layer")
	case d.Refresh[0] != d.Warmup:
		return d, fmt.Errorf("sparse: DELTA's first Δ-layer %d must be the first layer after the warm-up (%d): a sparse layer needs a selection before it", d.Refresh[0], d.Warmup)
	}
	for i, l := range d.Refresh {
		if l < d.Warmup || l >= layers || (i > 0 && l <= d.Refresh[i-1]) {
			return d, fmt.Errorf("sparse: DELTA's Δ-layers %v: ascending, in [%d, %d)", d.Refresh, d.Warmup, layers)
		}
	}
	d.Refresh = slices.Clone(d.Refresh)
	return d, nil
}

// DeltaTokenScoresRef returns every token's importance at a Δ-layer:
// s_t = max over query heads h of the attention weight
// softmax_t(scale·q_h·k_{g(h),t}) that head h (over KV head g(h) =
// h / heads.Group()) gives token t. qs is [Hq][D], keys [KV][n][D].
func DeltaTokenScoresRef(heads Heads, qs, keys []float64, n int, scale float64) ([]float64, error) {
	d := heads.Dim
	if err := heads.Validate(); err != nil {
		return nil, err
	}
	if n <= 0 || len(qs) != heads.Query*d || len(keys) != heads.KV*n*d {
		return nil, fmt.Errorf("sparse: DELTA scores of %d queries and %d keys for %d query heads, %d KV heads of %d, %d tokens", len(qs), len(keys), heads.Query, heads.KV, d, n)
	}
	scores := make([]float64, n)
	for h := 0; h < heads.Query; h++ {
		g := h / heads.Group()
		p, err := SoftmaxRef(qs[h*d:(h+1)*d], keys[g*n*d:(g+1)*n*d], scale)
		if err != nil {
			return nil, err
		}
		for t, w := range p {
			scores[t] = math.Max(scores[t], w)
		}
	}
	return scores, nil
}

// DeltaPageScoresRef returns S_u = Σ s_t over the tokens t of page u,
// pages of pageSize consecutive tokens from token 0 (the last one shorter
// when pageSize does not divide len(scores)).
func DeltaPageScoresRef(scores []float64, pageSize int) []float64 {
	out := make([]float64, (len(scores)+pageSize-1)/pageSize)
	for t, s := range scores {
		out[t/pageSize] += s
	}
	return out
}

// DeltaSelectRef returns the pages a Δ-layer picks, ascending: the last
// recent pages, and of the others the budget − recent of the greatest
// scores (ties to the lower page); every page when they number at most
// budget.
func DeltaSelectRef(pageScores []float64, budget, recent int) ([]int, error) {
	if recent < 0 || recent >= budget {
		return nil, fmt.Errorf("sparse: DELTA selection of %d pages keeping %d recent: L must lie in [0, K)", budget, recent)
	}
	n := len(pageScores)
	if n <= budget {
		all := make([]int, n)
		for i := range all {
			all[i] = i
		}
		return all, nil
	}
	older := make([]int, n-recent)
	for i := range older {
		older[i] = i
	}
	sort.SliceStable(older, func(a, b int) bool { return pageScores[older[a]] > pageScores[older[b]] })
	picked := slices.Clone(older[:budget-recent])
	for u := n - recent; u < n; u++ {
		picked = append(picked, u)
	}
	sort.Ints(picked)
	return picked, nil
}

// DeltaTokensRef returns the tokens of the picked pages, ascending, over n
// tokens in pages of pageSize.
func DeltaTokensRef(pages []int, pageSize, n int) []int32 {
	var out []int32
	for _, u := range pages {
		for t := u * pageSize; t < min(n, (u+1)*pageSize); t++ {
			out = append(out, int32(t))
		}
	}
	return out
}

// AttentionShiftRef returns 1 − cos(a, b) between two attention
// distributions over the same tokens: the shift between consecutive
// layers that DELTA's calibration averages over steps and heads (the DELTA
// paper, section 4 and Appendix D) to propose the Δ-layers.
func AttentionShiftRef(a, b []float64) (float64, error) {
	if len(a) != len(b) || len(a) == 0 {
		return 0, fmt.Errorf("sparse: attention shift between distributions of %d and %d tokens", len(a), len(b))
	}
	var ab, aa, bb float64
	for i := range a {
		ab += a[i] * b[i]
		aa += a[i] * a[i]
		bb += b[i] * b[i]
	}
	if aa == 0 || bb == 0 {
		return 0, fmt.Errorf("sparse: attention shift of a zero distribution")
	}
	return 1 - ab/math.Sqrt(aa*bb), nil
}
