package sparse

import (
	"fmt"
	"math"
)

// dot returns Σ_k a[k]·b[k], summed in index order.
func dot(a, b []float64) float64 {
	s := 0.0
	for k := range a {
		s += a[k] * b[k]
	}
	return s
}

// checkKV validates a query against key and value matrices and returns the
// token count n = len(keys)/len(q).
func checkKV(q, keys, values []float64) (int, error) {
	d := len(q)
	if d == 0 || len(keys)%d != 0 {
		return 0, fmt.Errorf("sparse: keys have %d elements, not a multiple of head dimension %d", len(keys), d)
	}
	if values != nil && len(values) != len(keys) {
		return 0, fmt.Errorf("sparse: values have %d elements, keys %d", len(values), len(keys))
	}
	return len(keys) / d, nil
}

// AttendRef returns dense attention of q (length d) over every row of keys
// and values (n×d each): o = Σ_i p_i v_i with p = softmax(scale·q·k_i),
// computed as exp(s_i − max s) / Σ exp(s_j − max s).
func AttendRef(q, keys, values []float64, scale float64) ([]float64, error) {
	n, err := checkKV(q, keys, values)
	if err != nil {
		return nil, err
	}
	tokens := make([]int32, n)
	for i := range tokens {
		tokens[i] = int32(i)
	}
	return AttendSubsetRef(q, keys, values, tokens, scale)
}

// AttendSubsetRef returns attention of q restricted to the given distinct
// token rows: o = Σ_{i∈tokens} p_i v_i with p_i = exp(s_i − m) / Σ_{j∈tokens}
// exp(s_j − m), s_i = scale·q·k_i and m = max_{i∈tokens} s_i. Sums run in
// the order of tokens. An empty token list is an error.
func AttendSubsetRef(q, keys, values []float64, tokens []int32, scale float64) ([]float64, error) {
	n, err := checkKV(q, keys, values)
	if err != nil {
		return nil, err
	}
	if values == nil {
		return nil, fmt.Errorf("sparse: AttendSubsetRef: no values")
	}
	if len(tokens) == 0 {
		return nil, fmt.Errorf("sparse: AttendSubsetRef: empty token set")
	}
	if err := checkTokens(tokens, n); err != nil {
		return nil, err
	}
	d := len(q)
	s := make([]float64, len(tokens))
	m := math.Inf(-1)
	for i, t := range tokens {
		s[i] = scale * dot(q, keys[int(t)*d:int(t+1)*d])
		m = math.Max(m, s[i])
	}
	out := make([]float64, d)
	z := 0.0
	for i, t := range tokens {
		e := math.Exp(s[i] - m)
		z += e
		v := values[int(t)*d : int(t+1)*d]
		for k := range out {
			out[k] += e * v[k]
		}
	}
	for k := range out {
		out[k] /= z
	}
	return out, nil
}

// checkTokens reports an error unless tokens are distinct ids in [0, n).
func checkTokens(tokens []int32, n int) error {
	seen := make([]bool, n)
	for _, t := range tokens {
		if t < 0 || int(t) >= n {
			return fmt.Errorf("sparse: token %d outside [0, %d)", t, n)
		}
		if seen[t] {
			return fmt.Errorf("sparse: token %d repeated", t)
		}
		seen[t] = true
	}
	return nil
}
