package lm

import (
	"math"
	"math/rand"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/vk/vktest"
)

// TestGPUProductsMatchReference runs matmul_t on every matrix of a small
// random model (sizes not multiples of the tile: 24, 12, 40, 33) for 1, 7
// and 37 rows, y poisoned with NaN first, against matmulTRef; it reports
// the first mismatches.
func TestGPUProductsMatchReference(t *testing.T) {
	dev := vktest.Open(t)
	rng := rand.New(rand.NewSource(5))
	c := Config{Vocab: 33, Dim: 24, Layers: 1, Heads: 2, KVHeads: 1, HeadDim: 12, Hidden: 40}
	rnd := func(n int, scale float64) []float32 {
		x := make([]float32, n)
		for i := range x {
			x[i] = float32(rng.NormFloat64() * scale)
		}
		return x
	}
	ly := Layer{Wq: rnd(24*24, 0.2), Wk: rnd(12*24, 0.2), Wv: rnd(12*24, 0.2), Wo: rnd(24*24, 0.2),
		W1: rnd(40*24, 0.2), W3: rnd(40*24, 0.2), W2: rnd(24*40, 0.2)}
	w := &Weights{Config: c, Head: rnd(33*24, 0.2), Layers: []Layer{ly}}
	g, err := newGPUProducts(dev, w, 37)
	require.NoError(t, err)
	defer func() { require.NoError(t, g.release()) }()
	for _, m := range []struct {
		w       []float32
		in, out int
	}{{w.Head, 24, 33}, {ly.Wq, 24, 24}, {ly.Wk, 24, 12}, {ly.W1, 24, 40}, {ly.W2, 40, 24}} {
		for _, rows := range []int{1, 7, 37} {
			x := rnd(rows*m.in, 3)
			nan := math.Float32bits(float32(math.NaN()))
			require.NoError(t, dev.Run(func(cmd *vk.Commands) { cmd.Fill(g.y.All(), nan) }))
			y := make([]float32, rows*m.out)
			require.NoError(t, g.mul(y, x, rows, m.in, m.w, m.out))
			want := matmulTRef(to64(x), to64(m.w), rows, m.in, m.out)
			bad := 0
			for i, v := range y {
				if !(math.Abs(float64(v)-want[i]) <= 1e-5*(1+math.Abs(want[i]))) {
					if bad < 5 {
						t.Errorf("%d rows × %d → %d: y[%d] = %v, reference %v", rows, m.in, m.out, i, v, want[i])
					}
					bad++
				}
			}
			require.Zero(t, bad)
		}
	}
	require.Error(t, g.mul(make([]float32, 38*24), make([]float32, 38*40), 38, 40, ly.W2, 24), "more than the operands hold")
	require.Error(t, g.mul(make([]float32, 24), make([]float32, 24), 1, 24, make([]float32, 24*24), 24), "a matrix not uploaded")
}

func to64(x []float32) []float64 {
	y := make([]float64, len(x))
	for i, v := range x {
		y[i] = float64(v)
	}
	return y
}
