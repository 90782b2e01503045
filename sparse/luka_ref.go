package sparse

import (
	"fmt"
	"math"
	"sort"
)

// LuKAPick returns the token LuKARandom keeps of summary s of KV head g:
// pcg(seed ^ pcg(g·0x9E3779B9 + s)) mod segment, with pcg the 32-bit
// PCG-RXS-M-XS output permutation of one LCG step.
func LuKAPick(seed uint32, g, s, segment int) int {
	return int(pcg32(seed^pcg32(uint32(g)*0x9E3779B9+uint32(s))) % uint32(segment))
}

func pcg32(x uint32) uint32 {
	state := x*747796405 + 2891336453
	word := ((state >> ((state >> 28) + 4)) ^ state) * 277803737
	return (word >> 22) ^ word
}

// LuKACompressRef returns the summary key and value of one segment of
// p = len(weights) tokens, keys and values [p][d]: Σ_u π_u k_u and
// Σ_u π_u v_u with π = softmax(λ), λ_u = 0 (LuKAMean), weights[u]/τ
// (LuKAWeighted: weights are the tokens' accumulated cover masses), or 0
// at u = pick and −∞ elsewhere (LuKARandom).
func LuKACompressRef(keys, values []float64, d int, c LuKACompressor, weights []float64, tau float64, pick int) (k, v []float64, err error) {
	p := len(weights)
	if p == 0 || len(keys) != p*d || len(values) != p*d {
		return nil, nil, fmt.Errorf("sparse: a segment of %d weights with %d keys and %d values of %d", p, len(keys), len(values), d)
	}
	lambda := make([]float64, p)
	for u := range lambda {
		switch c {
		case LuKAWeighted:
			lambda[u] = weights[u] / tau
		case LuKARandom:
			if u != pick {
				lambda[u] = math.Inf(-1)
			}
		}
	}
	top := math.Inf(-1)
	for _, l := range lambda {
		top = max(top, l)
	}
	z := 0.0
	for _, l := range lambda {
		z += math.Exp(l - top)
	}
	k, v = make([]float64, d), make([]float64, d)
	for u, l := range lambda {
		pi := math.Exp(l-top) / z
		for i := 0; i < d; i++ {
			k[i] += pi * keys[u*d+i]
			v[i] += pi * values[u*d+i]
		}
	}
	return k, v, nil
}

// LuKARefineRef returns the summaries a query refines, ascending, from
// their cover logits and the cover's log normaliser logZ: under the top-K
// and fraction rules the o.Refines(len(logits)) greatest, ties to the
// lower summary; under the threshold rule those with
// exp(logit − logZ) > ε, compared as logit > logZ + log ε.
func LuKARefineRef(logits []float64, logZ float64, o LuKA) []int {
	s := len(logits)
	n := o.Refines(s)
	var out []int
	if n < 0 {
		bound := logZ + math.Log(o.Epsilon)
		for j, l := range logits {
			if l > bound {
				out = append(out, j)
			}
		}
		return out
	}
	order := make([]int, s)
	for j := range order {
		order[j] = j
	}
	sort.SliceStable(order, func(a, b int) bool { return logits[order[a]] > logits[order[b]] })
	out = append(out, order[:n]...)
	sort.Ints(out)
	return out
}

// LuKAAttendRef returns LuKA's clustered attention output for one query
// head q over a layer's rows keys and values ([n][d]), the summaries sumK
// and sumV ([S][d], summary c standing for rows [cP, cP+P)) and the
// refined summaries, with the cover logits (S summaries, then rows
// [S·P, n); a summary's logit gets bias added, LuKA.SummaryBias) and the
// cover's log normaliser:
//
//	o = Σ_{j not refined} α_j v_j + Σ_{c refined} α_c Σ_u β_u v_{cP+u},
//
// α = softmax of scale·q·k over the cover and β the local softmax of
// scale·q·k over c's rows (Eqs. 1–4 of the paper).
func LuKAAttendRef(q, keys, values, sumK, sumV []float64, d, p int, scale, bias float64, refined []int) (out, logits []float64, logZ float64, err error) {
	n, s := len(keys)/d, len(sumK)/d
	if len(q) != d || len(values) != n*d || len(sumV) != s*d || s*p > n {
		return nil, nil, 0, fmt.Errorf("sparse: LuKA over %d rows and %d summaries of %d tokens", n, s, p)
	}
	logits = make([]float64, 0, s+n-s*p)
	for c := 0; c < s; c++ {
		logits = append(logits, scale*dot(q, sumK[c*d:(c+1)*d])+bias)
	}
	for t := s * p; t < n; t++ {
		logits = append(logits, scale*dot(q, keys[t*d:(t+1)*d]))
	}
	top := math.Inf(-1)
	for _, l := range logits {
		top = max(top, l)
	}
	z := 0.0
	for _, l := range logits {
		z += math.Exp(l - top)
	}
	logZ = top + math.Log(z)
	isRefined := make([]bool, s)
	for _, c := range refined {
		if c < 0 || c >= s {
			return nil, nil, 0, fmt.Errorf("sparse: refined summary %d of %d", c, s)
		}
		isRefined[c] = true
	}
	out = make([]float64, d)
	add := func(w float64, v []float64) {
		for i := range out {
			out[i] += w * v[i]
		}
	}
	for j, l := range logits {
		alpha := math.Exp(l - logZ)
		switch {
		case j >= s:
			t := s*p + j - s
			add(alpha, values[t*d:(t+1)*d])
		case !isRefined[j]:
			add(alpha, sumV[j*d:(j+1)*d])
		default:
			child := make([]float64, p)
			ctop := math.Inf(-1)
			for u := range child {
				t := j*p + u
				child[u] = scale * dot(q, keys[t*d:(t+1)*d])
				ctop = max(ctop, child[u])
			}
			cz := 0.0
			for _, c := range child {
				cz += math.Exp(c - ctop)
			}
			for u, c := range child {
				t := j*p + u
				add(alpha*math.Exp(c-ctop)/cz, values[t*d:(t+1)*d])
			}
		}
	}
	return out, logits, logZ, nil
}
