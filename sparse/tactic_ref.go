package sparse

import (
	"fmt"
	"math"
	"sort"
)

// Tactic (adaptive sparse decode attention with clustering and distribution
// fitting), float64 reference.
//
// Token layout for one KV head at a decode step of a query at position pos:
//
//	[0, sinks)            sink tokens: always attended, not clustered
//	[sinks, clusteredEnd) the prefill, K-means clustered (a ClusterIndex)
//	[clusteredEnd, pos]   the recent tail (decoded tokens): always attended
//
// The sinks and the tail form the fixed set F (TacticFixedTokens). Per query
// head, TacticBudgetRef estimates how many clusters reach the target mass P
// (Alg. 1 of the paper, at cluster granularity, with F counted exactly), and
// TacticSelectRef takes the union over the query heads sharing the KV head.

// TacticFit holds the distribution-fitting parameters. Fractions are of n,
// the number of clustered tokens.
type TacticFit struct {
	// InitialFrac sets the exact part: the first clusters in score order
	// whose exp scores are computed exactly, as few as cover at least
	// ceil(InitialFrac·n) tokens, at most MaxInitial (0: no limit).
	InitialFrac float64 `json:"initial_frac"`
	MaxInitial  int     `json:"max_initial,omitempty"`
	// Window1 and Window2 are the centres of the two sampling windows, as
	// fractions of n (positions in the cluster-ordered token list).
	Window1 float64 `json:"window1"`
	Window2 float64 `json:"window2"`
	// WindowFrac is the nominal width of each window as a fraction of n,
	// at most MaxWindow tokens (0: no limit). The sample is the whole
	// clusters overlapping the nominal window.
	WindowFrac float64 `json:"window_frac"`
	MaxWindow  int     `json:"max_window"`
	// WindowStride, above 1, thins the windows where their nominal width
	// holds at least 4·WindowStride clusters of the mean size: of their
	// clusters outside the exact part, only those whose index is a
	// multiple of it are scored, and a window's mean is over the tokens
	// scored. 0 and 1 score every cluster. The index is the cluster's, not
	// its rank, so that a GPU ordering clusters by bins picks the same ones.
	WindowStride int `json:"window_stride,omitempty"`
	// Moments, when set, estimates each cluster's exp sum from its
	// centroid score and the spread of its keys instead of scoring an
	// exact part and two windows and fitting a/x + b (the fields above are
	// then unused): cluster c of n_c tokens contributes
	//   ê_c = n_c·exp(min(s_c + κ_c − m, MomentExpCap)),
	//   κ_c = ½·σ²_c·Σ_i (scale·q_i)²·w_i,
	// s_c its centroid score, m the best one, σ²_c and w_i the index's
	// Spreads and DimWeights (ClusterIndex.SetSpreadsRef): the mean of
	// exp(scale·q·k) over keys spread normally about the centroid, with
	// each dimension's share of the spread pooled over the head. The fit
	// then reads no key rows but the fixed tokens'.
	Moments bool `json:"moments,omitempty"`
}

// MomentExpCap bounds the exponent of a cluster's moment estimate
// (TacticFit.Moments), so that float32 sums of up to millions of tokens
// stay finite.
const MomentExpCap = 60

// MomentShift returns κ's factor for query q: Σ_i (scale·q_i)²·w_i, so
// that κ_c = ½·σ²_c·MomentShift (TacticFit.Moments).
func MomentShift(q []float64, scale float64, weights []float64) float64 {
	s := 0.0
	for i, v := range q {
		s += (scale * v) * (scale * v) * weights[i]
	}
	return s
}

// windowStride returns the stride of the windows over n clustered tokens
// in C clusters: WindowStride where the nominal width w holds at least
// 4·WindowStride clusters of the mean size n/C (w·C ≥ 4·WindowStride·n),
// otherwise 1.
func (f TacticFit) windowStride(n, C int) int {
	if f.WindowStride > 1 && f.windowWidth(n)*C >= 4*f.WindowStride*n {
		return f.WindowStride
	}
	return 1
}

// thinned returns whether windows of stride k score cluster c (outside
// the exact part): c is a multiple of k.
func thinned(c int32, k int) bool { return int(c)%k == 0 }

// initialTokens returns the tokens the exact part covers at least over n
// tokens: ceil(InitialFrac·n), at most MaxInitial where it is positive.
func (f TacticFit) initialTokens(n int) int {
	need := int(math.Ceil(f.InitialFrac * float64(n)))
	if f.MaxInitial > 0 {
		need = min(need, f.MaxInitial)
	}
	return need
}

// windowWidth returns the nominal width of a sampling window over n
// tokens: max(1, min(round(WindowFrac·n), MaxWindow)), no limit for
// MaxWindow 0.
func (f TacticFit) windowWidth(n int) int {
	w := int(math.Round(f.WindowFrac * float64(n)))
	if f.MaxWindow > 0 {
		w = min(w, f.MaxWindow)
	}
	return max(1, w)
}

// DefaultTacticFit returns the moment estimate (Moments), with the fitted
// curve's parameters of TacticCurveFit beside it, so that clearing Moments
// gives the paper's fit. The moment estimate reads no key rows but the
// fixed tokens': on the generator's llama layer at 131 072 tokens the
// selection reads 0.28 of what attention over the unions reads, against
// 0.89 for the curve; its success rates on the real traces and the
// generator are within a point of the curve's or above, with at most 5 %
// more tokens; and its steps are 8–19 % faster on an H200
// (bench/README.md, "Tactic's moment estimate").
func DefaultTacticFit() TacticFit {
	f := TacticCurveFit()
	f.Moments = true
	return f
}

// TacticCurveFit returns the paper's fit of a/x + b, with InitialFrac
// 0.02 and windows centred at 0.10 and 0.40 of nominal width 0.02, tuned
// on the real traces and the generator's layer (package workload). The
// paper places the windows at 0.10 and 0.60; for P ≤ 0.9 the budgets
// land before 0.60, and in heads whose logits are spread like a Gaussian
// (the generator's retrieval heads) the cluster-ordered scores keep
// falling past 0.30 while a/x + b levels off at b, so a second window at
// 0.60 underestimates the middle and one at 0.30 overestimates the tail
// (the estimated total came out 1.3× the true one there, doubling those
// heads' budgets). On a grid of
// first windows 0.08, 0.10, 0.12 and second windows 0.35, 0.40, 0.45,
// the real traces and the generator meet the targets of
// TestTacticRealTraces and TestTacticGeneratedWorkload (package evaluate)
// everywhere but at the corners (0.08, 0.35) and (0.12, 0.45); 0.10/0.40
// is its centre.
// The width (about 20 clusters of 16 at 16k tokens) keeps a few outlier
// tokens in a window from inflating the fitted tail in sharply peaked
// heads; capped at 512 tokens, it stops growing past 25 600 tokens, so
// that sampling reads less of long contexts. The cap changes neither
// the traces (2 % of 16 384 is below it) nor the success rates and token
// counts of the generator's layer at 32 768 tokens by more than a point.
// The windows score every 4th cluster (WindowStride) where they hold at
// least 16 clusters of the mean size (from about 12 800 tokens on with
// clusters of 16): the fit then reads about 990 key rows a head instead of
// 1 740 at 32 768 tokens, and the success rates of the traces and the
// generator at P 0.5, 0.7 and 0.9 stay within 1.2 points of scoring every
// cluster (narrower windows of 128 tokens, which read about as little,
// cost 7.6 points on a trace at P 0.5).
// The exact part is not capped (MaxInitial 0): on the generator's llama
// layer at 131 072 tokens (P 0.9, spans of 2 048, 8 queries, 8-bit
// centroids) the selection reads 74 % of what attention over the unions
// reads (centroids about 9 MB, the fit's rows 24 MB, unions 44 MB a
// step); a cap of 1 024 tokens brings that to 45 %, but success falls from
// 97.7 to 96.1 %.
func TacticCurveFit() TacticFit {
	return TacticFit{InitialFrac: 0.02, Window1: 0.10, Window2: 0.40, WindowFrac: 0.02, MaxWindow: 512, WindowStride: 4}
}

// MaxWindowStride is the largest TacticFit.WindowStride.
const MaxWindowStride = 64

// TacticDefaultSinks is the number of leading sink tokens kept outside the
// clusters and always attended. On the real traces 4 and 16 sinks give the
// same success rates; 4 keeps the forced set small.
const TacticDefaultSinks = 4

func (f TacticFit) validate() error {
	ok := func(x float64) bool { return x >= 0 && x <= 1 }
	if !ok(f.InitialFrac) || !ok(f.Window1) || !ok(f.Window2) || !ok(f.WindowFrac) {
		return fmt.Errorf("sparse: TacticFit %+v: fractions must lie in [0, 1]", f)
	}
	if f.MaxWindow < 0 || f.MaxInitial < 0 {
		return fmt.Errorf("sparse: TacticFit %+v: MaxWindow and MaxInitial must not be negative", f)
	}
	if f.WindowStride < 0 || f.WindowStride > MaxWindowStride {
		return fmt.Errorf("sparse: TacticFit %+v: WindowStride must lie in [0, %d]", f, MaxWindowStride)
	}
	return nil
}

// TacticBudget is the result of TacticBudgetRef for one query head. Exp
// sums are in shifted units: e_i = exp(s_i − Shift), s_i = scale·q·k_i.
// Token positions x = 1 … N refer to the cluster-ordered token list: the
// clusters in Order, each cluster's members in ascending token id.
type TacticBudget struct {
	// N is the number of clustered tokens, n.
	N int
	// Scores[c] = scale·q·centroid_c, by cluster index.
	Scores []float64
	// Order lists the cluster indices by descending score, ties by
	// ascending cluster index.
	Order []int32
	// Offsets[j] = Σ sizes of Order[0:j]; len(Offsets) = C+1. The cluster of
	// rank j holds positions Offsets[j]+1 … Offsets[j+1].
	Offsets []int
	// ExactClusters = J0, the least j with Offsets[j] ≥ ceil(InitialFrac·n);
	// ExactTokens = Offsets[J0] = N'. Positions 1 … N' are exact.
	ExactClusters, ExactTokens int
	// Win1, Win2 are the rank ranges [lo, hi) of the window clusters.
	Win1, Win2 [2]int
	// Mu1, Mu2 are the window means of e over the tokens scored; H1, H2
	// the window means of 1/x over all their positions.
	Mu1, Mu2, H1, H2 float64
	// Scored1, Scored2 are the windows' tokens scored: all of them unless
	// TacticFit.WindowStride thins them.
	Scored1, Scored2 int
	// A, B are the fitted curve y = A/x + B (shifted units).
	A, B float64
	// Shift is the subtracted maximum score m.
	Shift float64
	// FixedSum = Σ_{F} e_i; ExactSum = Σ_{x ≤ N'} e_x.
	FixedSum, ExactSum float64
	// Total = S(N), the estimated total exp sum over F and all clustered
	// tokens (true estimate: Total·exp(Shift)).
	Total float64
	// Budget is K, the least k in [0, N] with S(k) ≥ P·S(N) (N when P = 1).
	Budget int
	// Selected = J, the least j with Offsets[j] ≥ K: the head selects the
	// clusters Order[0:J], SelectedTokens = Offsets[J] tokens of them.
	Selected, SelectedTokens int

	// exactCum[k] = Σ_{x ≤ k} e_x over the exact part, k ≤ N'.
	exactCum []float64
	// sampled is SampledTokens.
	sampled int
}

// Estimate returns S(k), the estimated exp sum (shifted units) over F and
// the clustered positions 1 … k, 0 ≤ k ≤ N: exact up to N', then the
// fitted curve.
func (b *TacticBudget) Estimate(k int) float64 {
	if k <= b.ExactTokens {
		return b.FixedSum + b.exactCum[k]
	}
	return b.FixedSum + b.ExactSum + tacticCurveSum(b.A, b.B, b.ExactTokens+1, k)
}

// Clusters returns the selected cluster indices, Order[0:Selected].
func (b *TacticBudget) Clusters() []int32 { return b.Order[:b.Selected] }

// SampledTokens returns how many clustered tokens the fit scores exactly:
// the members of the clusters of ranks [0, ExactClusters) and those of
// Win1 and Win2 that the windows score, each cluster counted once where the
// ranges overlap.
func (b *TacticBudget) SampledTokens() int { return b.sampled }

// EulerGamma is the Euler–Mascheroni constant.
const EulerGamma = 0.57721566490153286060651209008240243

// TacticHarmonic returns the harmonic number H_m = Σ_{i=1}^m 1/i (0 for
// m ≤ 0): summed in ascending i for m < 32, otherwise by the expansion
// ln m + γ + 1/(2m) − 1/(12m²) + 1/(120m⁴) − 1/(252m⁶), whose error is
// below 1/(240m⁸) < 4e-15 there.
func TacticHarmonic(m int) float64 {
	if m <= 0 {
		return 0
	}
	if m < 32 {
		h := 0.0
		for i := 1; i <= m; i++ {
			h += 1 / float64(i)
		}
		return h
	}
	x := float64(m)
	x2 := x * x
	return math.Log(x) + EulerGamma + 1/(2*x) - 1/(12*x2) + 1/(120*x2*x2) - 1/(252*x2*x2*x2)
}

// tacticCurveSum returns Σ_{x=lo}^{hi} max(0, a/x + b) in closed form, 0 when
// lo > hi. In exact arithmetic a/x + b > 0 holds on an interval of x: for
// b > 0, x > −a/b (all x if a ≥ 0); for b = 0, all x if a > 0; for b < 0,
// x < −a/b if a > 0. On the part [l, r] of [lo, hi] inside it the sum is
// a·(H_r − H_{l−1}) + b·(r − l + 1), clamped at ≥ 0.
func tacticCurveSum(a, b float64, lo, hi int) float64 {
	if lo < 1 {
		lo = 1
	}
	if lo > hi {
		return 0
	}
	switch {
	case b > 0 && a < 0:
		x0 := -a / b
		if x0 >= float64(hi) {
			return 0
		}
		lo = max(lo, int(math.Floor(x0))+1)
	case b == 0 && a <= 0, b < 0 && a <= 0:
		return 0
	case b < 0:
		x0 := -a / b
		if x0 <= float64(lo) {
			return 0
		}
		if x0 < float64(hi) {
			hi = int(math.Ceil(x0)) - 1
		}
	}
	if lo > hi {
		return 0
	}
	s := a*(TacticHarmonic(hi)-TacticHarmonic(lo-1)) + b*float64(hi-lo+1)
	return math.Max(0, s)
}

// TacticBudgetRef estimates the token budget of one query head q (length d)
// and the clusters it selects. keys holds the key rows of every token id
// used (the members of idx and fixed); fixed lists the always-attended
// tokens F, disjoint from the clustered ones. 0 < p ≤ 1. Dot products sum
// over the dimension in index order.
//
// Steps (n = idx.Tokens(), positions x as in TacticBudget):
//
//  1. Scores s_c = scale·q·centroid_c; Order sorts clusters by descending
//     s_c, ties by ascending index; Offsets is the exclusive prefix sum of
//     the ordered sizes.
//  2. Exact part: N = ceil(InitialFrac·n), or min(N, MaxInitial) for
//     MaxInitial > 0; J0 the least j with Offsets[j] ≥ N
//     (0 if N = 0), N' = Offsets[J0]. Token scores are s = scale·q·k. The
//     shift m is the maximum score over F and positions 1 … N' (the maximum
//     centroid score if both are empty, 0 if there are no clusters either);
//     e = exp(s − m). FixedSum (in the order of fixed), ExactSum and the
//     exact prefix sums E(k), k ≤ N' (in list order) follow. The shift
//     cancels in every comparison below.
//  3. Windows (skipped if N' = n): width w = max(1, round(WindowFrac·n)),
//     or max(1, min(round(WindowFrac·n), MaxWindow)) for MaxWindow > 0; for
//     centre fraction f, c = min(n, max(1, round(f·n))), the nominal window
//     is positions [lo, hi] with lo = min(max(1, c − ⌊w/2⌋), max(1, n−w+1)),
//     hi = min(n, lo+w−1); the sample is the whole clusters of ranks rlo …
//     rhi that hold positions lo and hi, i.e. positions u+1 … v with
//     u = Offsets[rlo], v = Offsets[rhi+1]. The window scores the members
//     of its clusters of ranks below J0 and of those whose index is a
//     multiple of the stride k (TacticFit.WindowStride where
//     w·C ≥ 4·WindowStride·n, otherwise 1: every cluster), s tokens in
//     all, in rank order. Its means are μ = Σ e / s over those
//     tokens and h = (H_v − H_u) / (v−u), the mean of 1/x over all its
//     positions (TacticHarmonic). Round is half away from zero.
//  4. Fit y = a/x + b through (h1, μ1), (h2, μ2) in the 1/x coordinate:
//     a = (μ1−μ2)/(h1−h2), b = μ1 − a·h1; if h1 = h2 or a window scored no
//     token, a = 0 and b is the pooled mean of both samples (0 if neither
//     scored any). Fitted values are max(0, a/x + b).
//  5. Estimated cumulative sum S(k) = FixedSum + E(k) for k ≤ N', and
//     FixedSum + ExactSum + Σ_{x=N'+1}^{k} max(0, a/x + b) beyond
//     (tacticCurveSum). S is non-decreasing. Total = S(n). Counting F
//     here (as tokens placed before the list, whose values are known) is
//     what keeps sharply peaked heads, where the sinks and the recent tail
//     hold most of the mass, from selecting far more than they need.
//  6. Budget K: for p = 1, K = n; otherwise the bisection lo = −1, hi = n;
//     while hi − lo > 1 { mid = ⌊(lo+hi)/2⌋; if S(mid) ≥ p·Total then
//     hi = mid else lo = mid }; K = hi.
//  7. Selection: J = the least j with Offsets[j] ≥ K; clusters Order[0:J].
//     (For p < 1, equivalently the least j with S(Offsets[j]) ≥ p·Total,
//     so an implementation may bisect over cluster boundaries directly.)
func TacticBudgetRef(q []float64, scale float64, keys []float64, idx *ClusterIndex, fixed []int32, p float64, fit TacticFit) (*TacticBudget, error) {
	return tacticBudget(q, scale, keys, idx, fixed, p, fit, nil, nil)
}

// tacticBudget is TacticBudgetRef, with the cluster order given by order
// when it is not nil (a permutation of the clusters) instead of step 1's,
// and scored(c), when not nil, the members a window scores of cluster c
// outside the exact part (nil: those of step 3).
func tacticBudget(q []float64, scale float64, keys []float64, idx *ClusterIndex, fixed []int32, p float64, fit TacticFit, order []int32, scored func(c int32) []int32) (*TacticBudget, error) {
	if err := checkBudgetInputs(q, keys, idx, fixed, p, fit); err != nil {
		return nil, err
	}
	d := len(q)
	score := func(t int32) float64 { return scale * dot(q, keys[int(t)*d:int(t+1)*d]) }
	// 1. Order clusters.
	b, err := orderClusters(q, scale, idx, order)
	if err != nil {
		return nil, err
	}
	n := b.N
	if scored == nil {
		k := fit.windowStride(n, len(idx.Sizes))
		scored = func(c int32) []int32 {
			if thinned(c, k) {
				return idx.Members[c]
			}
			return nil
		}
	}
	if fit.Moments {
		b.momentPart(q, scale, idx, fixed, score)
		b.cutAt(p)
		return b, nil
	}
	// 2. Exact part and shift.
	b.exactPart(idx, fixed, fit.initialTokens(n), score)
	// 3–4. Windows and fit.
	b.sampled = b.ExactTokens
	if b.ExactTokens < n {
		b.fitWindows(idx, fit, score, scored)
	}
	b.cutAt(p)
	return b, nil
}

// cutAt does steps 5–7: the estimated total S(N), the budget K at p and
// the clusters covering K tokens.
func (b *TacticBudget) cutAt(p float64) {
	b.Total = b.Estimate(b.N)
	b.Budget = budgetFor(b.Estimate, b.Total, p, b.N)
	b.Selected = sort.SearchInts(b.Offsets, b.Budget)
	b.SelectedTokens = b.Offsets[b.Selected]
}

// checkBudgetInputs refuses what TacticBudgetRef cannot take: p outside
// (0, 1], an invalid fit, an index of another dimension or of inconsistent
// sizes, keys not a whole number of rows, and fixed tokens or members
// repeated, outside the keys or in both.
func checkBudgetInputs(q, keys []float64, idx *ClusterIndex, fixed []int32, p float64, fit TacticFit) error {
	if err := checkP(p); err != nil {
		return err
	}
	if err := fit.validate(); err != nil {
		return err
	}
	d := len(q)
	if idx == nil || idx.D != d || len(idx.Centroids) != d*len(idx.Sizes) || len(idx.Members) != len(idx.Sizes) {
		return fmt.Errorf("sparse: TacticBudgetRef: cluster index does not match head dimension %d", d)
	}
	if fit.Moments && (len(idx.Spreads) != len(idx.Sizes) || len(idx.DimWeights) != d) {
		return fmt.Errorf("sparse: TacticBudgetRef: the moment estimate needs the index's spreads (ClusterIndex.SetSpreadsRef)")
	}
	nk, err := checkKV(q, keys, nil)
	if err != nil {
		return err
	}
	inF := make([]bool, nk)
	for _, t := range fixed {
		if t < 0 || int(t) >= nk || inF[t] {
			return fmt.Errorf("sparse: TacticBudgetRef: fixed token %d repeated or outside [0, %d)", t, nk)
		}
		inF[t] = true
	}
	for c, mem := range idx.Members {
		if len(mem) != idx.Sizes[c] {
			return fmt.Errorf("sparse: TacticBudgetRef: cluster %d has %d members, size %d", c, len(mem), idx.Sizes[c])
		}
		for _, t := range mem {
			if t < 0 || int(t) >= nk || inF[t] {
				return fmt.Errorf("sparse: TacticBudgetRef: cluster %d token %d is fixed or outside [0, %d)", c, t, nk)
			}
		}
	}
	return nil
}

// orderClusters returns a budget with step 1 done: the centroid scores,
// the clusters' order (order when not nil, else by descending score, ties
// in index order), the rank offsets and N.
func orderClusters(q []float64, scale float64, idx *ClusterIndex, order []int32) (*TacticBudget, error) {
	d, C := len(q), len(idx.Sizes)
	b := &TacticBudget{Scores: make([]float64, C), Order: make([]int32, C), Offsets: make([]int, C+1)}
	for c := range b.Scores {
		b.Scores[c] = scale * dot(q, idx.Centroids[c*d:(c+1)*d])
		b.Order[c] = int32(c)
	}
	if order != nil {
		if len(order) != C {
			return nil, fmt.Errorf("sparse: an order of %d clusters for %d", len(order), C)
		}
		copy(b.Order, order)
	} else {
		sort.SliceStable(b.Order, func(i, j int) bool { return b.Scores[b.Order[i]] > b.Scores[b.Order[j]] })
	}
	for j, c := range b.Order {
		b.Offsets[j+1] = b.Offsets[j] + idx.Sizes[c]
	}
	b.N = b.Offsets[C]
	return b, nil
}

// momentPart does the moment estimate's steps (TacticFit.Moments): the
// shift m, the best centroid score (0 without clusters); F = Σ_{t∈F}
// exp(s_t − m) exactly; each cluster's ê_c (MomentEstimate) as the exact
// part (momentSums).
func (b *TacticBudget) momentPart(q []float64, scale float64, idx *ClusterIndex, fixed []int32, score func(int32) float64) {
	m := b.bestScore()
	shift := MomentShift(q, scale, idx.DimWeights)
	b.momentSums(m, fixed, score, idx.Sizes, func(c int32) float64 {
		return MomentEstimate(idx.Sizes[c], b.Scores[c], idx.Spreads[c], shift, m)
	})
}

// bestScore returns the greatest centroid score, 0 without clusters.
func (b *TacticBudget) bestScore() float64 {
	m := 0.0
	for c, s := range b.Scores {
		if c == 0 || s > m {
			m = s
		}
	}
	return m
}

// MomentEstimate returns ê of a cluster of n tokens with centroid score s
// and spread σ² for a query of MomentShift shift and shift m:
// n·exp(min(s + ½·σ²·shift − m, MomentExpCap)), 0 for an empty cluster.
func MomentEstimate(n int, s, spread, shift, m float64) float64 {
	if n == 0 {
		return 0
	}
	return float64(n) * math.Exp(math.Min(s+0.5*spread*shift-m, MomentExpCap))
}

// momentSums sets the shift m, F = Σ_{t∈F} exp(s_t − m) and, as the exact
// part's running sums, the estimate est(c) of each cluster c in Order
// (sizes[c] tokens) spread evenly over its positions, so that S at a
// cluster boundary j is F + Σ_{r<j} est(Order[r]). Every clustered
// position counts as exact (ExactClusters = C) and no key row is sampled.
func (b *TacticBudget) momentSums(m float64, fixed []int32, score func(int32) float64, sizes []int, est func(c int32) float64) {
	b.Shift = m
	for _, t := range fixed {
		b.FixedSum += math.Exp(score(t) - m)
	}
	b.ExactClusters, b.ExactTokens = len(b.Order), b.N
	b.exactCum = make([]float64, b.N+1)
	x := 0
	for _, c := range b.Order {
		n := sizes[c]
		e := est(c)
		for i := 1; i <= n; i++ {
			b.exactCum[x+i] = b.exactCum[x] + e*float64(i)/float64(n)
		}
		x += n
	}
	b.ExactSum = b.exactCum[b.N]
}

// exactPart does step 2: the leading clusters holding at least need
// tokens, the shift m (the greatest exact or fixed score, else the best
// centroid score), and the fixed and exact sums of e = exp(score − m)
// with the exact part's running sums.
func (b *TacticBudget) exactPart(idx *ClusterIndex, fixed []int32, need int, score func(int32) float64) {
	C := len(idx.Sizes)
	for b.ExactClusters < C && b.Offsets[b.ExactClusters] < need {
		b.ExactClusters++
	}
	b.ExactTokens = b.Offsets[b.ExactClusters]
	fixedS := make([]float64, len(fixed))
	exactS := make([]float64, 0, b.ExactTokens)
	m := math.Inf(-1)
	for i, t := range fixed {
		fixedS[i] = score(t)
		m = math.Max(m, fixedS[i])
	}
	for _, c := range b.Order[:b.ExactClusters] {
		for _, t := range idx.Members[c] {
			s := score(t)
			exactS = append(exactS, s)
			m = math.Max(m, s)
		}
	}
	if math.IsInf(m, -1) {
		m = b.bestScore()
	}
	b.Shift = m
	for _, s := range fixedS {
		b.FixedSum += math.Exp(s - m)
	}
	b.exactCum = make([]float64, len(exactS)+1)
	for i, s := range exactS {
		b.exactCum[i+1] = b.exactCum[i] + math.Exp(s-m)
	}
	b.ExactSum = b.exactCum[len(exactS)]
}

// fitWindows does steps 3 and 4 over the tokens past the exact part: each
// window's sample and means, the tokens it scored beyond the exact part
// counted once into sampled, and the fit's a and b.
func (b *TacticBudget) fitWindows(idx *ClusterIndex, fit TacticFit, score func(int32) float64, scored func(int32) []int32) {
	n, C, m := b.N, len(idx.Sizes), b.Shift
	w := fit.windowWidth(n)
	var sum [2]float64
	var cnt [2]int
	counted := map[int]bool{} // window ranks beyond J0 in sampled
	for k, f := range [2]float64{fit.Window1, fit.Window2} {
		c := min(n, max(1, int(math.Round(f*float64(n)))))
		lo := min(max(1, c-w/2), max(1, n-w+1))
		hi := min(n, lo+w-1)
		rank := func(x int) int { // rank of the cluster holding position x
			return sort.Search(C, func(j int) bool { return b.Offsets[j+1] >= x })
		}
		rlo, rhi := rank(lo), rank(hi)
		u, v := b.Offsets[rlo], b.Offsets[rhi+1]
		for j := rlo; j <= rhi; j++ {
			cl := b.Order[j]
			mem := idx.Members[cl]
			if j >= b.ExactClusters {
				mem = scored(cl)
				if !counted[j] {
					counted[j] = true
					b.sampled += len(mem)
				}
			}
			for _, t := range mem {
				sum[k] += math.Exp(score(t) - m)
			}
			cnt[k] += len(mem)
		}
		mu := 0.0
		if cnt[k] > 0 {
			mu = sum[k] / float64(cnt[k])
		}
		h := (TacticHarmonic(v) - TacticHarmonic(u)) / float64(v-u)
		if k == 0 {
			b.Win1, b.Mu1, b.H1, b.Scored1 = [2]int{rlo, rhi + 1}, mu, h, cnt[k]
		} else {
			b.Win2, b.Mu2, b.H2, b.Scored2 = [2]int{rlo, rhi + 1}, mu, h, cnt[k]
		}
	}
	switch {
	case b.H1 != b.H2 && cnt[0] > 0 && cnt[1] > 0:
		b.A = (b.Mu1 - b.Mu2) / (b.H1 - b.H2)
		b.B = b.Mu1 - b.A*b.H1
	case cnt[0]+cnt[1] > 0:
		b.B = (sum[0] + sum[1]) / float64(cnt[0]+cnt[1])
	}
}

// budgetFor does step 6: n for p = 1, otherwise the fewest leading tokens
// k whose estimate S(k) reaches p·total, by bisection over [0, n].
func budgetFor(S func(int) float64, total, p float64, n int) int {
	if p == 1 {
		return n
	}
	target := p * total
	lo, hi := -1, n
	for hi-lo > 1 {
		mid := (lo + hi) / 2
		if S(mid) >= target {
			hi = mid
		} else {
			lo = mid
		}
	}
	return hi
}

// TacticFixedTokens returns the fixed set F of a query at position pos:
// tokens [0, sinks) and [clusteredEnd, pos], ascending. It needs
// 0 ≤ sinks ≤ clusteredEnd ≤ pos+1.
func TacticFixedTokens(sinks, clusteredEnd, pos int) ([]int32, error) {
	if sinks < 0 || sinks > clusteredEnd || clusteredEnd > pos+1 || pos >= 1<<31-1 {
		return nil, fmt.Errorf("sparse: TacticFixedTokens(sinks=%d, clusteredEnd=%d, pos=%d): want 0 ≤ sinks ≤ clusteredEnd ≤ pos+1", sinks, clusteredEnd, pos)
	}
	out := make([]int32, 0, sinks+pos+1-clusteredEnd)
	for t := 0; t < sinks; t++ {
		out = append(out, int32(t))
	}
	for t := clusteredEnd; t <= pos; t++ {
		out = append(out, int32(t))
	}
	return out, nil
}

// TacticSelectRef returns the tokens a KV head attends: the union of fixed
// and the members of the clusters selected by each budget (one per query
// head sharing the KV head), sorted ascending, without repeats.
func TacticSelectRef(idx *ClusterIndex, fixed []int32, budgets ...*TacticBudget) []int32 {
	set := map[int32]struct{}{}
	for _, t := range fixed {
		set[t] = struct{}{}
	}
	for _, b := range budgets {
		for _, c := range b.Clusters() {
			for _, t := range idx.Members[c] {
				set[t] = struct{}{}
			}
		}
	}
	out := make([]int32, 0, len(set))
	for t := range set {
		out = append(out, t)
	}
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out
}

// TacticDecodeRef runs a Tactic decode step for the query heads qs that
// share one KV head: TacticBudgetRef per head, TacticSelectRef over all of
// them, then AttendSubsetRef of every head over the union. keys and values
// hold the rows of every token id used. It returns one output per head, the
// union and the per-head budgets.
func TacticDecodeRef(qs [][]float64, keys, values []float64, scale float64, idx *ClusterIndex, fixed []int32, p float64, fit TacticFit) (outs [][]float64, tokens []int32, budgets []*TacticBudget, err error) {
	if len(qs) == 0 {
		return nil, nil, nil, fmt.Errorf("sparse: TacticDecodeRef: no query heads")
	}
	for _, q := range qs {
		b, err := TacticBudgetRef(q, scale, keys, idx, fixed, p, fit)
		if err != nil {
			return nil, nil, nil, err
		}
		budgets = append(budgets, b)
	}
	tokens = TacticSelectRef(idx, fixed, budgets...)
	for _, q := range qs {
		o, err := AttendSubsetRef(q, keys, values, tokens, scale)
		if err != nil {
			return nil, nil, nil, err
		}
		outs = append(outs, o)
	}
	return outs, tokens, budgets, nil
}
