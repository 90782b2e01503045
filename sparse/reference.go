package sparse

import (
	"math"

	"github.com/x448/float16"
)

// HalvesToFloat64 decodes fp16 bit patterns.
func HalvesToFloat64(h []uint16) []float64 {
	out := make([]float64, len(h))
	for i, x := range h {
		out[i] = float64(float16.Frombits(x).Float32())
	}
	return out
}

// DenseRef is dense decode attention in float64 for one sequence:
// for every query head h of KV head g = h / (Hq/Hkv),
//
//	out[h] = Σ_t softmax_t(scale · q[h]·k[g][t]) v[g][t]
//
// over tokens t < n, with the softmax shifted by its maximum. q is
// [Hq][D], k and v are [Hkv][n][D] (already decoded), out is [Hq][D].
func DenseRef(heads Heads, q []float32, k, v []float64, n int, scale float64) []float64 {
	d := heads.Dim
	out := make([]float64, heads.Query*d)
	s := make([]float64, n)
	for h := 0; h < heads.Query; h++ {
		g := h / heads.Group()
		qh := q[h*d : (h+1)*d]
		m := math.Inf(-1)
		for t := 0; t < n; t++ {
			row := k[(g*n+t)*d : (g*n+t+1)*d]
			dot := 0.0
			for i, x := range row {
				dot += float64(qh[i]) * x
			}
			s[t] = scale * dot
			m = math.Max(m, s[t])
		}
		sum := 0.0
		o := out[h*d : (h+1)*d]
		for t := 0; t < n; t++ {
			p := math.Exp(s[t] - m)
			sum += p
			row := v[(g*n+t)*d : (g*n+t+1)*d]
			for i, x := range row {
				o[i] += p * x
			}
		}
		for i := range o {
			o[i] /= sum
		}
	}
	return out
}
