package kvcache

import (
	"math"
	"math/rand"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/vk/vktest"
)

func TestQuantizeRows(t *testing.T) {
	rng := rand.New(rand.NewSource(rand.Int63()))
	const d = 12
	x := make([]float32, 5*d)
	for i := range x {
		x[i] = float32(3 * rng.NormFloat64())
	}
	x[7] = -40                   // row 0's largest magnitude, negative: code −127
	clear(x[d : 2*d])            // row 1 all zero: scale 0, codes 0
	x[2*d], x[2*d+1] = 1e-30, -2 // a tiny value beside a large one
	codes, scales, err := QuantizeRows(x, d)
	require.NoError(t, err)
	require.Len(t, codes, len(x))
	require.Len(t, scales, 5)
	require.Equal(t, float32(40)/CodeMax, scales[0])
	require.Equal(t, int8(-CodeMax), codes[7])
	require.Zero(t, scales[1])
	for r := range scales {
		m := 0.0
		for _, v := range x[r*d : (r+1)*d] {
			m = math.Max(m, math.Abs(float64(v)))
		}
		require.InDelta(t, m/CodeMax, float64(scales[r]), 1e-7*m, "scale of row %d", r)
		for i := r * d; i < (r+1)*d; i++ {
			k := codes[i]
			require.LessOrEqual(t, math.Abs(float64(k)), float64(CodeMax))
			if scales[r] == 0 {
				require.Zero(t, k)
				continue
			}
			want := math.Round(float64(x[i]) / float64(scales[r]))
			require.Equal(t, max(-CodeMax, min(CodeMax, want)), float64(k), "code %d", i)
			require.LessOrEqual(t, math.Abs(float64(scales[r])*float64(k)-float64(x[i])), float64(scales[r])/2*(1+1e-6), "value %d", i)
		}
	}
	require.Zero(t, codes[2*d], "a value below half a step rounds to 0")

	_, _, err = QuantizeRows(x[:d+1], d)
	require.Error(t, err, "not whole rows")
	_, _, err = QuantizeRows([]float32{1, float32(math.Inf(1))}, 2)
	require.Error(t, err, "not finite")
}

func TestPackCodes(t *testing.T) {
	codes := []int8{1, -1, 127, -127, 0, 5, -128, 64}
	words := PackCodes(codes)
	require.Equal(t, []uint32{0x81_7f_ff_01, 0x40_80_05_00}, words)
	require.Equal(t, codes, UnpackCodes(words))
}

// TestClustersQuantize quantizes an index on the device: its centroids read
// back are QuantizeRows' codes times their scales, the float32 ones are
// released, a second Quantize changes nothing, and quantized indexes join
// (codes and scales one head after another).
func TestClustersQuantize(t *testing.T) {
	dev := vktest.Open(t)
	rng := rand.New(rand.NewSource(rand.Int63()))
	const heads, dim, first = 3, 20, 4
	a := randomClusters(t, dev, rng, heads, dim, 7, first, 61)
	defer a.Release()
	b := randomClusters(t, dev, rng, heads, dim, 5, first+61, 33)
	defer b.Release()
	f := make([]float32, heads*a.C*dim)
	require.NoError(t, a.Centroids.ReadFloat32(0, f))
	codes, scales, err := QuantizeRows(f, dim)
	require.NoError(t, err)
	held := a.Bytes()

	require.NoError(t, a.Quantize(dev))
	require.Nil(t, a.Centroids)
	require.Less(t, a.Bytes(), held)
	codesBuf := a.Codes
	require.NoError(t, a.Quantize(dev))
	require.Same(t, codesBuf, a.Codes, "quantized once")
	for g := 0; g < heads; g++ {
		h, err := a.Read(g)
		require.NoError(t, err)
		for i, v := range h.Centroids {
			j := g*a.C*dim + i
			require.Equal(t, scales[j/dim]*float32(codes[j]), v, "head %d value %d", g, i)
		}
	}
	_, err = a.Join(dev, b)
	require.ErrorContains(t, err, "8-bit", "a quantized index joins only another")

	ra, err := a.Read(1)
	require.NoError(t, err)
	require.NoError(t, b.Quantize(dev))
	rb, err := b.Read(1)
	require.NoError(t, err)
	j, err := a.Join(dev, b)
	require.NoError(t, err)
	defer j.Release()
	require.NotNil(t, j.Codes)
	require.Nil(t, j.Centroids)
	rj, err := j.Read(1)
	require.NoError(t, err)
	require.Equal(t, append(ra.Centroids, rb.Centroids...), rj.Centroids)
	require.Equal(t, append(ra.Members, rb.Members...), rj.Members)

	odd := randomClusters(t, dev, rng, 1, 6, 2, 0, 9)
	defer odd.Release()
	require.Error(t, odd.Quantize(dev), "codes are packed four to a word")
}
