package sparse

import (
	"fmt"

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
func DenseRef(heads Heads, q []float32, k, v []float64, n int, scale float64) ([]float64, error) {
	d := heads.Dim
	if len(q) != heads.Query*d || len(k) != heads.KV*n*d || len(v) != len(k) {
		return nil, fmt.Errorf("sparse: DenseRef: q has %d, k %d and v %d values for %d query and %d KV heads of %d over %d tokens", len(q), len(k), len(v), heads.Query, heads.KV, d, n)
	}
	out := make([]float64, 0, heads.Query*d)
	qh := make([]float64, d)
	for h := 0; h < heads.Query; h++ {
		g := h / heads.Group()
		for i := range qh {
			qh[i] = float64(q[h*d+i])
		}
		o, err := AttendRef(qh, k[g*n*d:(g+1)*n*d], v[g*n*d:(g+1)*n*d], scale)
		if err != nil {
			return nil, err
		}
		out = append(out, o...)
	}
	return out, nil
}
