package sparse

import (
	"fmt"
	"math"
	"sort"
)

// The float64 references of the selections by bins of a score
// (shaders/select_bins.comp: QuestSelector, OracleSelector). Given the
// GPU's float32 scores they state the kernel's ranks and cut exactly; the
// scores themselves are checked against QuestPages.BoundsRef and
// ClusterLogMassRef.

// BinnedTopKRef returns each cluster's bin and the top-k cut as the GPU
// computes them for Quest: rank = DoublePBinRanks(scores) (ScoreBin of the
// score with ScoreBinScale over the finite scores, ScoreBins for −∞),
// and cut, the least r such that at least k clusters have rank < r: whole
// bins are taken, so a head takes at least k clusters, and more where the
// bin of the k-th best holds others. 0 for k = 0; ScoreBins where fewer
// than k clusters are finite. The clusters of rank < cut include the k of
// the greatest scores (ties aside): bins are monotone in the score.
func BinnedTopKRef(scores []float32, k int) (rank []int, cut int) {
	rank = DoublePBinRanks(scores)
	if k <= 0 {
		return rank, 0
	}
	count := make([]int, ScoreBins)
	for _, r := range rank {
		if r < ScoreBins {
			count[r]++
		}
	}
	run := 0
	for b, n := range count {
		if run += n; run >= k {
			return rank, b + 1
		}
	}
	return rank, ScoreBins
}

// BinnedTopPRef returns each cluster's bin and the top-p cut as the GPU
// computes them for the oracles: rank = DoublePBinRanks(scores), and cut,
// the least r such that the clusters of rank < r, with the tokens outside
// the index (of log mass fixed: log Σ_{t∈F} exp(scale·q·k_t), −∞ for
// none), hold at least p of all the mass: F + T_r ≥ p·(F + M), M =
// Σ_c exp(score_c), T_r the mass of the clusters of rank < r; that is
// T_r ≥ p·M − (1 − p)·F. Whole bins are taken; 0 when F alone reaches the
// target or no score is finite; ScoreBins when rounding keeps the target
// out of reach. Masses are summed in float64 relative to the best score.
// The target is TokenOracleRef's and ClusterOracleRef's.
func BinnedTopPRef(scores []float32, fixed, p float64) (rank []int, cut int) {
	rank = DoublePBinRanks(scores)
	best := math.Inf(-1)
	for _, x := range scores {
		best = max(best, float64(x))
	}
	mass := make([]float64, ScoreBins)
	total := 0.0
	for c, x := range scores {
		if rank[c] < ScoreBins {
			w := math.Exp(float64(x) - best)
			mass[rank[c]] += w
			total += w
		}
	}
	target := BinnedTopPTarget(total, math.Exp(fixed-best), p)
	if total == 0 || !(target > 0) {
		return rank, 0
	}
	run := 0.0
	for b, w := range mass {
		if run += w; run >= target {
			return rank, b + 1
		}
	}
	return rank, ScoreBins
}

// BinnedTopPTarget returns the mass the clusters taken must reach for all
// the mass taken, fixed included, to reach p of index + fixed:
// p·index − (1 − p)·fixed (index for p = 1, however large fixed is).
func BinnedTopPTarget(index, fixed, p float64) float64 {
	if p >= 1 {
		return index
	}
	return p*index - (1-p)*fixed
}

// ClusterLogMassRef returns every cluster's log true mass for the query q:
// l_c = log Σ_{t∈c} exp(scale·q·k_t) over the members of cluster c of idx
// (keys holds the row of every token id), −∞ for an empty cluster. Over a
// single-token index it is each token's logit.
func ClusterLogMassRef(q, keys []float64, scale float64, idx *ClusterIndex) ([]float64, error) {
	d := len(q)
	if d == 0 || len(keys)%d != 0 {
		return nil, fmt.Errorf("sparse: ClusterLogMassRef: a query of %d for %d key elements", d, len(keys))
	}
	out := make([]float64, len(idx.Members))
	for c, mem := range idx.Members {
		for _, t := range mem {
			if t < 0 || int(t) >= len(keys)/d {
				return nil, fmt.Errorf("sparse: ClusterLogMassRef: cluster %d token %d outside [0, %d)", c, t, len(keys)/d)
			}
		}
		m := math.Inf(-1)
		xs := make([]float64, len(mem))
		for i, t := range mem {
			xs[i] = scale * dot(q, keys[int(t)*d:int(t+1)*d])
			m = max(m, xs[i])
		}
		s := 0.0
		for _, x := range xs {
			s += math.Exp(x - m)
		}
		out[c] = m + math.Log(s)
		if len(mem) == 0 {
			out[c] = math.Inf(-1)
		}
	}
	return out, nil
}

// SelectionGroupRef is the attention of a Selection for the query heads
// qs sharing one KV head: the KV head attends the tokens fixed and the
// members of every cluster c of idx with ranks[h][c] < cuts[h] for some
// head h (the union), each head's output AttendSubsetRef over them. It
// returns the outputs and the tokens, ascending.
func SelectionGroupRef(qs [][]float64, keys, values []float64, scale float64, idx *ClusterIndex, fixed []int32, ranks [][]int, cuts []int) (outs [][]float64, tokens []int32, err error) {
	if len(ranks) != len(qs) || len(cuts) != len(qs) {
		return nil, nil, fmt.Errorf("sparse: SelectionGroupRef: %d heads with %d ranks and %d cuts", len(qs), len(ranks), len(cuts))
	}
	set := map[int32]bool{}
	for _, t := range fixed {
		set[t] = true
	}
	for c, mem := range idx.Members {
		for h := range qs {
			if ranks[h][c] < cuts[h] {
				for _, t := range mem {
					set[t] = true
				}
				break
			}
		}
	}
	for t := range set {
		tokens = append(tokens, t)
	}
	sort.Slice(tokens, func(i, j int) bool { return tokens[i] < tokens[j] })
	if outs, err = attendHeads(qs, keys, values, tokens, scale); err != nil {
		return nil, nil, err
	}
	return outs, tokens, nil
}
