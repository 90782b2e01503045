package kvcache

import (
	"fmt"
	"math"
)

// CodeMax is the largest magnitude of an 8-bit code (QuantizeRows): codes
// lie in [−CodeMax, CodeMax], symmetric, so −128 is never used.
const CodeMax = 127

// QuantizeRows returns each row of d values of x in 8 bits: the row's
// scale s = float32(m / CodeMax), m = max_i |x_i| (the division in
// float32), and codes k_i = round(x_i / s), the quotient taken in float64,
// rounded half away from zero and clamped to [−CodeMax, CodeMax] (all 0
// where s = 0). s·k_i then stands for x_i within s/2 (within s/2 + a
// float32 rounding of m at the largest). It refuses values that are not
// finite and an x that is not a whole number of rows.
func QuantizeRows(x []float32, d int) (codes []int8, scales []float32, err error) {
	if d <= 0 || len(x)%d != 0 {
		return nil, nil, fmt.Errorf("kvcache: %d values are not rows of %d", len(x), d)
	}
	codes, scales = make([]int8, len(x)), make([]float32, len(x)/d)
	for r := range scales {
		row := x[r*d : (r+1)*d]
		var m float32
		for i, v := range row {
			if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) {
				return nil, nil, fmt.Errorf("kvcache: value %d of row %d (%v) is not finite", i, r, v)
			}
			m = max(m, float32(math.Abs(float64(v))))
		}
		s := m / CodeMax
		scales[r] = s
		if s == 0 {
			continue
		}
		for i, v := range row {
			k := math.Round(float64(v) / float64(s))
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
