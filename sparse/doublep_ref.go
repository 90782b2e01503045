package sparse

import (
	"fmt"
	"math"
	"sort"
)

// DoubleP holds the two targets of Double-P (the Double-P paper, section 4): P1, the share
// of the clusters' estimated attention mass that the kept clusters reach,
// and P2, the share of the kept clusters' estimated mass that the clusters
// attended token by token reach; the other kept clusters enter attention
// as one pseudo-token each.
type DoubleP struct{ P1, P2 float64 }

// DefaultDoubleP returns the paper's setting for Llama-3.1-8B: P1 0.95,
// P2 0.7.
func DefaultDoubleP() DoubleP { return DoubleP{P1: 0.95, P2: 0.7} }

func (o DoubleP) validate() error {
	if !(o.P1 > 0 && o.P1 <= 1) || !(o.P2 > 0 && o.P2 <= 1) {
		return fmt.Errorf("sparse: Double-P targets p1 %v and p2 %v: each must lie in (0, 1]", o.P1, o.P2)
	}
	return nil
}

// ClusterValueMeansRef returns V̄_c = (1/s_c)·Σ_{t∈c} v_t for every cluster
// c of idx, C×d row-major, with a zero row for an empty cluster; values
// holds the row of every token id of idx.
func ClusterValueMeansRef(values []float64, d int, idx *ClusterIndex) []float64 {
	out := make([]float64, idx.Clusters()*d)
	for c, members := range idx.Members {
		row := out[c*d : (c+1)*d]
		for _, t := range members {
			for i, v := range values[int(t)*d : int(t+1)*d] {
				row[i] += v
			}
		}
		for i := range row {
			if len(members) > 0 {
				row[i] /= float64(len(members))
			}
		}
	}
	return out
}

// DoublePLogitsRef returns the logit of every cluster's pseudo-token (Eq. 5):
// ℓ_c = scale·q·C_c + ln s_c, −∞ for an empty cluster.
func DoublePLogitsRef(q []float64, scale float64, idx *ClusterIndex) ([]float64, error) {
	if len(q) != idx.D {
		return nil, fmt.Errorf("sparse: a query of %d for centroids of %d", len(q), idx.D)
	}
	out := make([]float64, idx.Clusters())
	for c, s := range idx.Sizes {
		if s == 0 {
			out[c] = math.Inf(-1)
			continue
		}
		out[c] = scale*dot(q, idx.Centroids[c*idx.D:(c+1)*idx.D]) + math.Log(float64(s))
	}
	return out, nil
}

// DoublePOrderRanks returns each cluster's place in the order of descending
// logits (ties by ascending cluster id): the ranks of the exact top-p of
// Eq. 7; an empty cluster (ℓ = −∞) gets len(logits), past every cut.
func DoublePOrderRanks(logits []float64) []int {
	order := make([]int, len(logits))
	for i := range order {
		order[i] = i
	}
	sort.SliceStable(order, func(i, j int) bool { return logits[order[i]] > logits[order[j]] })
	rank := make([]int, len(logits))
	for r, c := range order {
		rank[c] = r
		if math.IsInf(logits[c], -1) {
			rank[c] = len(logits)
		}
	}
	return rank
}

// DoublePBinRanks returns each cluster's bin, as the GPU ranks clusters:
// ScoreBin of its logit with ScoreBinScale over the finite logits (bin 0
// holds the best), and ScoreBins, past every cut, for an empty cluster
// (ℓ = −∞).
func DoublePBinRanks(logits []float32) []int {
	finite := make([]float32, 0, len(logits))
	for _, x := range logits {
		if !math.IsInf(float64(x), -1) {
			finite = append(finite, x)
		}
	}
	m, u := ScoreBinScale(finite)
	rank := make([]int, len(logits))
	for c, x := range logits {
		rank[c] = ScoreBins
		if !math.IsInf(float64(x), -1) {
			rank[c] = ScoreBin(m, u, x)
		}
	}
	return rank
}

// DoublePCutsRef returns the two cuts of Double-P over ranked clusters,
// clusters of equal rank taken together in ascending rank: keep, the least
// r such that the clusters of rank < r hold at least P1 of the estimated
// mass Σ_c exp(ℓ_c) (stage 1, Eq. 6–7), and exact ≤ keep, the least r such
// that those of rank < r hold at least P2 of the kept clusters' estimated
// mass (stage 2). Masses are summed in float64 relative to the best logit;
// ranks ≥ bound are never taken.
func DoublePCutsRef(logits []float64, rank []int, bound int, opts DoubleP) (exact, keep int) {
	best := math.Inf(-1)
	for _, x := range logits {
		best = max(best, x)
	}
	mass := make([]float64, bound)
	total := 0.0
	for c, x := range logits {
		if rank[c] < bound && !math.IsInf(x, -1) {
			w := math.Exp(x - best)
			mass[rank[c]] += w
			total += w
		}
	}
	if total == 0 {
		return 0, 0
	}
	first := func(target float64) int {
		run := 0.0
		for r, w := range mass {
			run += w
			if run >= target {
				return r + 1
			}
		}
		return bound
	}
	keep = first(opts.P1 * total)
	kept := 0.0
	for _, w := range mass[:keep] {
		kept += w
	}
	return min(first(opts.P2*kept), keep), keep
}

// DoublePGroupRef is the attention of Double-P for the query heads qs
// sharing one KV head, given each head's cluster logits and ranks and its
// two cuts: the KV head attends exactly the tokens fixed and the members
// of every cluster c with ranks[h][c] < exact[h] for some head h; head h
// also attends, as one pseudo-token of logit logits[h][c] and value
// means[c] (C×d), every cluster with exact[h] ≤ ranks[h][c] < keep[h] that
// no head attends exactly (Eq. 8–9):
// o_h = (Σ_t e^{x_t} v_t + Σ_c e^{ℓ_c} V̄_c) / (Σ_t e^{x_t} + Σ_c e^{ℓ_c}),
// x_t = scale·q_h·k_t. It returns the outputs, the exact tokens (ascending)
// and each head's approximated clusters.
func DoublePGroupRef(qs [][]float64, keys, values []float64, scale float64, idx *ClusterIndex, fixed []int32, means []float64, logits [][]float64, ranks [][]int, exact, keep []int) (outs [][]float64, tokens []int32, approx [][]int32, err error) {
	c := idx.Clusters()
	if len(logits) != len(qs) || len(ranks) != len(qs) || len(exact) != len(qs) || len(keep) != len(qs) || len(means) != c*idx.D {
		return nil, nil, nil, fmt.Errorf("sparse: DoublePGroupRef: %d heads with %d logits, %d ranks, %d and %d cuts, %d mean elements for %d clusters", len(qs), len(logits), len(ranks), len(exact), len(keep), len(means), c)
	}
	taken := make([]bool, c)
	for h := range qs {
		for cl := 0; cl < c; cl++ {
			taken[cl] = taken[cl] || ranks[h][cl] < exact[h]
		}
	}
	set := map[int32]bool{}
	for _, t := range fixed {
		set[t] = true
	}
	for cl, ok := range taken {
		if ok {
			for _, t := range idx.Members[cl] {
				set[t] = true
			}
		}
	}
	for t := range set {
		tokens = append(tokens, t)
	}
	sort.Slice(tokens, func(i, j int) bool { return tokens[i] < tokens[j] })
	for h, q := range qs {
		var mine []int32
		for cl := 0; cl < c; cl++ {
			if !taken[cl] && ranks[h][cl] >= exact[h] && ranks[h][cl] < keep[h] && idx.Sizes[cl] > 0 {
				mine = append(mine, int32(cl))
			}
		}
		o, err := doublePAttendRef(q, keys, values, scale, tokens, means, logits[h], mine)
		if err != nil {
			return nil, nil, nil, err
		}
		outs = append(outs, o)
		approx = append(approx, mine)
	}
	return outs, tokens, approx, nil
}

// doublePAttendRef returns Eq. 9 for one head: softmax over the exact
// tokens' logits scale·q·k_t and the approximated clusters' logits[c],
// weighting values[t] and means[c].
func doublePAttendRef(q, keys, values []float64, scale float64, tokens []int32, means, logits []float64, approx []int32) ([]float64, error) {
	d := len(q)
	if _, err := checkKV(q, keys, values); err != nil {
		return nil, err
	}
	if err := checkTokens(tokens, len(keys)/d); err != nil {
		return nil, err
	}
	xs := make([]float64, 0, len(tokens)+len(approx))
	rows := make([][]float64, 0, cap(xs))
	for _, t := range tokens {
		xs = append(xs, scale*dot(q, keys[int(t)*d:int(t+1)*d]))
		rows = append(rows, values[int(t)*d:int(t+1)*d])
	}
	for _, c := range approx {
		xs = append(xs, logits[c])
		rows = append(rows, means[int(c)*d:int(c+1)*d])
	}
	if len(xs) == 0 {
		return nil, fmt.Errorf("sparse: Double-P attends nothing")
	}
	m := math.Inf(-1)
	for _, x := range xs {
		m = max(m, x)
	}
	out := make([]float64, d)
	sum := 0.0
	for i, x := range xs {
		w := math.Exp(x - m)
		sum += w
		for j, v := range rows[i] {
			out[j] += w * v
		}
	}
	for j := range out {
		out[j] /= sum
	}
	return out, nil
}

// DoublePDecodeRef runs Double-P exactly as the paper states it for the
// query heads qs sharing one KV head: per head the logits of Eq. 5
// (DoublePLogitsRef), clusters ranked by them (DoublePOrderRanks), the cuts
// of DoublePCutsRef, then DoublePGroupRef (the GQA union of the exact
// clusters, each head's other kept clusters as pseudo-tokens). keys and
// values hold the rows of every token id used. It returns one output per
// head, the exactly attended tokens and each head's approximated clusters.
func DoublePDecodeRef(qs [][]float64, keys, values []float64, scale float64, idx *ClusterIndex, fixed []int32, opts DoubleP) (outs [][]float64, tokens []int32, approx [][]int32, err error) {
	if len(qs) == 0 {
		return nil, nil, nil, fmt.Errorf("sparse: DoublePDecodeRef: no query heads")
	}
	if err := opts.validate(); err != nil {
		return nil, nil, nil, err
	}
	c := idx.Clusters()
	logits := make([][]float64, len(qs))
	ranks := make([][]int, len(qs))
	exact, keep := make([]int, len(qs)), make([]int, len(qs))
	for h, q := range qs {
		if logits[h], err = DoublePLogitsRef(q, scale, idx); err != nil {
			return nil, nil, nil, err
		}
		ranks[h] = DoublePOrderRanks(logits[h])
		exact[h], keep[h] = DoublePCutsRef(logits[h], ranks[h], c, opts)
	}
	return DoublePGroupRef(qs, keys, values, scale, idx, fixed, ClusterValueMeansRef(values, idx.D, idx), logits, ranks, exact, keep)
}
