package sparse

import "fmt"

// The two oracles of the Tactic paper's Table 3, as selections rather than
// counts: what an exact top-p over tokens and over whole clusters would
// attend, given the true attention probabilities. Both force a fixed token
// set F (the sinks and the recent tokens every policy here attends
// exactly; may be empty) and add the fewest tokens, or clusters, that
// bring the mass to the target. The target is the one of TopPCount and
// ClusterTopPCount: mass ≥ p·Σ probs, Σ probs summed in index order.

// TokenOracleRef returns the exact top-p selection over tokens: F (forced)
// and then the other tokens in descending order of probs (ties: lower
// token id first), as few as bring Σ_{F} probs + Σ taken ≥ p·Σ probs (sums
// in the order the tokens are taken; no token beyond F if F reaches the
// target; every token if rounding keeps it out of reach). Ascending. With
// F empty its size is TopPCount(probs, p). 0 < p ≤ 1.
func TokenOracleRef(probs []float64, fixed []int32, p float64) ([]int32, error) {
	if err := checkP(p); err != nil {
		return nil, err
	}
	n := len(probs)
	if err := checkTokens(fixed, n); err != nil {
		return nil, err
	}
	inF := make([]bool, n)
	got := 0.0
	for _, t := range fixed {
		inF[t] = true
		got += probs[t]
	}
	total := 0.0
	for _, x := range probs {
		total += x
	}
	out := append([]int32(nil), fixed...)
	if got < p*total {
		rest := make([]int32, 0, n-len(fixed))
		for t := range probs {
			if !inF[t] {
				rest = append(rest, int32(t))
			}
		}
		sortDescending(rest, func(t int32) float64 { return probs[t] })
		for _, t := range rest {
			out = append(out, t)
			got += probs[t]
			if got >= p*total {
				break
			}
		}
	}
	return UnionTokens(out), nil
}

// ClusterOracleRef returns the cluster-optimal selection: F (forced) and
// then whole clusters of idx in descending order of their true mass
// m_c = Σ probs over the members outside F (ties: lower cluster index
// first), as few as bring Σ_{F} probs + Σ m_c ≥ p·Σ probs (no cluster if F
// reaches the target; every cluster if rounding keeps it out of reach).
// Ascending; its size is ClusterTopPCount(probs, idx.Members, fixed, p).
// Tokens neither in F nor in a cluster are never selected. 0 < p ≤ 1.
func ClusterOracleRef(probs []float64, idx *ClusterIndex, fixed []int32, p float64) ([]int32, error) {
	if err := checkP(p); err != nil {
		return nil, err
	}
	if idx == nil || len(idx.Members) != len(idx.Sizes) {
		return nil, fmt.Errorf("sparse: ClusterOracleRef: no cluster index, or members and sizes disagree")
	}
	n := len(probs)
	if err := checkTokens(fixed, n); err != nil {
		return nil, err
	}
	inF := make([]bool, n)
	got := 0.0
	for _, t := range fixed {
		inF[t] = true
		got += probs[t]
	}
	seen := make([]bool, n)
	mass := make([]float64, len(idx.Members))
	for c, mem := range idx.Members {
		for _, t := range mem {
			if t < 0 || int(t) >= n || seen[t] {
				return nil, fmt.Errorf("sparse: ClusterOracleRef: cluster %d token %d repeated or outside [0, %d)", c, t, n)
			}
			seen[t] = true
			if !inF[t] {
				mass[c] += probs[t]
			}
		}
	}
	total := 0.0
	for _, x := range probs {
		total += x
	}
	out := append([]int32(nil), fixed...)
	if got < p*total {
		order := make([]int, len(mass))
		for c := range order {
			order[c] = c
		}
		sortDescending(order, func(c int) float64 { return mass[c] })
		for _, c := range order {
			for _, t := range idx.Members[c] {
				if !inF[t] {
					out = append(out, t)
				}
			}
			got += mass[c]
			if got >= p*total {
				break
			}
		}
	}
	return UnionTokens(out), nil
}

// TokenOracleDecodeRef runs the token oracle for the query heads qs sharing
// one KV head (keys and values n×d, the tokens [0, n) the query attends):
// own[j] = TokenOracleRef(SoftmaxRef(q_j, keys, scale), fixed, p), tokens
// their union, and each head's output AttendSubsetRef over the union.
func TokenOracleDecodeRef(qs [][]float64, keys, values []float64, scale float64, fixed []int32, p float64) (outs [][]float64, tokens []int32, own [][]int32, err error) {
	return oracleDecode("TokenOracleDecodeRef", qs, keys, values, scale, func(probs []float64) ([]int32, error) {
		return TokenOracleRef(probs, fixed, p)
	})
}

// ClusterOracleDecodeRef runs the cluster oracle for the query heads qs
// sharing one KV head: own[j] = ClusterOracleRef(SoftmaxRef(q_j, keys,
// scale), idx, fixed, p), tokens their union, and each head's output
// AttendSubsetRef over the union.
func ClusterOracleDecodeRef(qs [][]float64, keys, values []float64, scale float64, idx *ClusterIndex, fixed []int32, p float64) (outs [][]float64, tokens []int32, own [][]int32, err error) {
	return oracleDecode("ClusterOracleDecodeRef", qs, keys, values, scale, func(probs []float64) ([]int32, error) {
		return ClusterOracleRef(probs, idx, fixed, p)
	})
}

// oracleDecode selects per head with sel over the head's exact softmax,
// takes the union and attends it.
func oracleDecode(name string, qs [][]float64, keys, values []float64, scale float64, sel func(probs []float64) ([]int32, error)) (outs [][]float64, tokens []int32, own [][]int32, err error) {
	if _, err := checkHeads(name, qs, keys, values); err != nil {
		return nil, nil, nil, err
	}
	own = make([][]int32, len(qs))
	for j, q := range qs {
		probs, err := SoftmaxRef(q, keys, scale)
		if err != nil {
			return nil, nil, nil, err
		}
		if own[j], err = sel(probs); err != nil {
			return nil, nil, nil, err
		}
	}
	tokens = UnionTokens(own...)
	if outs, err = attendHeads(qs, keys, values, tokens, scale); err != nil {
		return nil, nil, nil, err
	}
	return outs, tokens, own, nil
}
