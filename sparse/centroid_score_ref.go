package sparse

import (
	"fmt"
	"math"

	"github.com/vksparse/vksparse/kvcache"
)

// QuantizedCentroidsRef returns one KV head's centroids (rows of d values)
// as the selection kernels hold them: each value rounded to float32, the
// head's dimension scales m_i = max_c |c_ci| over its rows
// (kvcache.DimScales), each row stored in 8 bits against them by
// kvcache.QuantizeRows (row scale r_c = float32(max_i |c_ci/m_i| / 127),
// codes k_ci = round(c_ci/(m_i·r_c)) in [−127, 127]), and read back in
// float64 as r_c·m_i·k_ci, the product taken in float64. TacticBudgetRef
// and the Double-P references over an index with these centroids score
// clusters as centroid_score does (CentroidScoresRef), up to the
// rounding of its float32 sums, and as centroid_score_dot does within the
// query's two bytes (CentroidScoresDotRef).
func QuantizedCentroidsRef(centroids []float64, d int) ([]float64, error) {
	f := make([]float32, len(centroids))
	for i, x := range centroids {
		f[i] = float32(x)
	}
	m, err := kvcache.DimScales(f, d)
	if err != nil {
		return nil, fmt.Errorf("sparse: %w", err)
	}
	codes, scales, err := kvcache.QuantizeRows(f, d, m)
	if err != nil {
		return nil, fmt.Errorf("sparse: %w", err)
	}
	out := make([]float64, len(codes))
	for i, k := range codes {
		out[i] = float64(scales[i/d]) * float64(m[i%d]) * float64(k)
	}
	return out, nil
}

// CentroidScoresRef is centroid_score in float64 for the query heads qs of
// one KV head, whose C centroids of d dimensions are given in 8 bits:
// codes [C][d], the rows' scales r and the head's dimension scales m
// (kvcache.QuantizeRows). For head h and cluster c it returns
//
//	l[h][c] = r_c · Σ_i (scale·q_h[i]·m_i)·k_c[i]          (Tactic)
//	l[h][c] = r_c · Σ_i (scale·q_h[i]·m_i)·k_c[i] + ln s_c  (logSize:
//	                                         Double-P's pseudo-token logit)
//
// the sum in index order, s_c = sizes[c], and −∞ where logSize and
// s_c = 0.
func CentroidScoresRef(qs [][]float64, scale float64, codes []int8, r, m []float32, sizes []int, d int, logSize bool) ([][]float64, error) {
	return centroidScoresRef("CentroidScoresRef", qs, scale, codes, r, m, sizes, d, logSize, false)
}

// CentroidScoresDotRef is centroid_score_dot in float64: CentroidScoresRef
// with each head's scaled query x_i = scale·q_h[i]·m_i replaced by its two
// bytes, QueryBytesRef(x).
func CentroidScoresDotRef(qs [][]float64, scale float64, codes []int8, r, m []float32, sizes []int, d int, logSize bool) ([][]float64, error) {
	return centroidScoresRef("CentroidScoresDotRef", qs, scale, codes, r, m, sizes, d, logSize, true)
}

// QueryBytesRef returns x as centroid_score_dot holds it: in two signed
// bytes a_i, b_i against the step s = max_i |x_i| / 127, a_i = round(x_i/s)
// and b_i = round(256·(x_i − s·a_i)/s) clamped to [−127, 127] (rounding
// half to even), x̃_i = s·(a_i + b_i/256); |x̃_i − x_i| ≤ s/512 but where
// the clamp binds (at most s/256). All zeros stay zeros.
func QueryBytesRef(x []float64) []float64 {
	mx := 0.0
	for _, v := range x {
		mx = math.Max(mx, math.Abs(v))
	}
	out := make([]float64, len(x))
	if mx == 0 {
		return out
	}
	s := mx / 127
	for i, v := range x {
		a := math.Max(-127, math.Min(127, math.RoundToEven(v/s)))
		b := math.Max(-127, math.Min(127, math.RoundToEven(256*(v-s*a)/s)))
		out[i] = s * (a + b/256)
	}
	return out
}

func centroidScoresRef(name string, qs [][]float64, scale float64, codes []int8, r, m []float32, sizes []int, d int, logSize, bytes bool) ([][]float64, error) {
	c := len(r)
	if d <= 0 || len(codes) != c*d || len(sizes) != c || len(m) != d {
		return nil, fmt.Errorf("sparse: %s: %d codes, %d row scales, %d dimension scales and %d sizes for rows of %d", name, len(codes), len(r), len(m), len(sizes), d)
	}
	out := make([][]float64, len(qs))
	for h, q := range qs {
		if len(q) != d {
			return nil, fmt.Errorf("sparse: %s: query %d has %d dimensions, not %d", name, h, len(q), d)
		}
		qm := make([]float64, d)
		for i := range qm {
			qm[i] = scale * q[i] * float64(m[i])
		}
		if bytes {
			qm = QueryBytesRef(qm)
		}
		out[h] = make([]float64, c)
		for j := range out[h] {
			s := 0.0
			for i, k := range codes[j*d : (j+1)*d] {
				s += qm[i] * float64(k)
			}
			l := float64(r[j]) * s
			if logSize {
				if sizes[j] == 0 {
					l = math.Inf(-1)
				} else {
					l += math.Log(float64(sizes[j]))
				}
			}
			out[h][j] = l
		}
	}
	return out, nil
}
