package kvcache

import (
	"fmt"
	"math"
)

// CodeMax is the largest magnitude of an 8-bit code (QuantizeRows): codes
// lie in [−CodeMax, CodeMax], symmetric, so −128 is never used.
const CodeMax = 127

// DimScales returns the scale of each dimension of rows of d values of x,
// for QuantizeRows: m_i = max_r |x_ri|, the largest magnitude of dimension
// i over the rows (0 where the dimension is all zero). It refuses values
// that are not finite and an x that is not a whole number of rows.
func DimScales(x []float32, d int) ([]float32, error) {
	if d <= 0 || len(x)%d != 0 {
		return nil, fmt.Errorf("kvcache: %d values are not rows of %d", len(x), d)
	}
	m := make([]float32, d)
	for j, v := range x {
		if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) {
			return nil, fmt.Errorf("kvcache: value %d of row %d (%v) is not finite", j%d, j/d, v)
		}
		m[j%d] = max(m[j%d], float32(math.Abs(float64(v))))
	}
	return m, nil
}

// QuantizeRows returns each row r of d values of x in 8 bits against the
// dimensions' scales m (len d; DimScales gives the usual ones, any finite
// non-negative scales are accepted): in float64 u_ri = x_ri / m_i (0 where
// m_i = 0), the row's scale s_r = float32(max_i |u_ri| / CodeMax) and the
// codes k_ri = round(u_ri / s_r), rounded half away from zero and clamped
// to [−CodeMax, CodeMax] (all 0 where s_r = 0). s_r·m_i·k_ri then stands
// for x_ri within s_r·m_i/2, up to the float32 rounding of s_r at the
// row's largest |u|. Folding m into the query makes the product with a row
// s_r·Σ_i (q_i·m_i)·k_ri: per row the same work as a scale per row alone,
// while a dimension much larger than the others (outlier channels of
// keys) no longer coarsens every other dimension's step. It refuses values
// that are not finite, negative or non-finite scales, and an x that is
// not a whole number of rows.
func QuantizeRows(x []float32, d int, m []float32) (codes []int8, scales []float32, err error) {
	if d <= 0 || len(x)%d != 0 || len(m) != d {
		return nil, nil, fmt.Errorf("kvcache: %d values are not rows of %d with %d dimension scales", len(x), d, len(m))
	}
	for i, v := range m {
		if !(v >= 0) || math.IsInf(float64(v), 0) {
			return nil, nil, fmt.Errorf("kvcache: dimension scale %d (%v) is not finite and non-negative", i, v)
		}
	}
	codes, scales = make([]int8, len(x)), make([]float32, len(x)/d)
	u := make([]float64, d)
	for r := range scales {
		var top float64
		for i, v := range x[r*d : (r+1)*d] {
			if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) {
				return nil, nil, fmt.Errorf("kvcache: value %d of row %d (%v) is not finite", i, r, v)
			}
			u[i] = 0
			if m[i] != 0 {
				u[i] = float64(v) / float64(m[i])
			}
			top = max(top, math.Abs(u[i]))
		}
		s := float32(top / CodeMax)
		scales[r] = s
		if s == 0 {
			continue
		}
		for i, v := range u {
			k := math.Round(v / float64(s))
			codes[r*d+i] = int8(max(-CodeMax, min(CodeMax, k)))
		}
	}
	return codes, scales, nil
}

// PackCodes packs codes four to a 32-bit word, code 4j+b in byte b of
// word j (lowest first), two's complement; len(codes) must be a multiple
// of 4.
func PackCodes(codes []int8) []uint32 {
	out := make([]uint32, len(codes)/4)
	for j := range out {
		for b := 0; b < 4; b++ {
			out[j] |= uint32(uint8(codes[4*j+b])) << (8 * b)
		}
	}
	return out
}

// UnpackCodes inverts PackCodes.
func UnpackCodes(words []uint32) []int8 {
	out := make([]int8, 4*len(words))
	for i := range out {
		out[i] = int8(uint8(words[i/4] >> (8 * (i % 4))))
	}
	return out
}

// CodedRowBytes returns the bytes of a row of d values in 8 bits, as an
// index holds its centroids once quantized: d codes and a float32 scale.
func CodedRowBytes(d int) int { return d + 4 }

// CodedHeadBytes returns the bytes of one KV head's c centroids of d
// dimensions in 8 bits, all of which centroid scoring reads: c rows
// (CodedRowBytes) and the head's d float32 dimension scales.
func CodedHeadBytes(c, d int) int { return c*CodedRowBytes(d) + 4*d }

// Decode returns the value code k stands for in a row of scale s and a
// dimension of scale m: float32(s·m·k), the product taken in float64.
func Decode(s, m float32, k int8) float32 {
	return float32(float64(s) * float64(m) * float64(k))
}
