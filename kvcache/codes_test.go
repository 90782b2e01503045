package kvcache

import (
	"math"
	"math/rand"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/vk/vktest"
)

func TestDimScales(t *testing.T) {
	x := []float32{1, -3, 0, 2, 0.5, 0, -4, 1, 0}
	m, err := DimScales(x, 3)
	require.NoError(t, err)
	require.Equal(t, []float32{4, 3, 0}, m)
	_, err = DimScales(x[:4], 3)
	require.Error(t, err, "not whole rows")
	_, err = DimScales([]float32{1, float32(math.NaN())}, 2)
	require.Error(t, err, "not finite")
}

// checkCodes checks QuantizeRows' codes and scales of x against dims m by
// their definition, and the bound on each value's error.
func checkCodes(t *testing.T, x []float32, d int, m []float32, codes []int8, scales []float32) {
	t.Helper()
	require.Len(t, codes, len(x))
	require.Len(t, scales, len(x)/d)
	for r := range scales {
		top := 0.0
		u := make([]float64, d)
		for i, v := range x[r*d : (r+1)*d] {
			if m[i] != 0 {
				u[i] = float64(v) / float64(m[i])
			}
			top = math.Max(top, math.Abs(u[i]))
		}
		require.Equal(t, float32(top/CodeMax), scales[r], "scale of row %d", r)
		s := float64(scales[r])
		for i := range u {
			k := codes[r*d+i]
			require.LessOrEqual(t, math.Abs(float64(k)), float64(CodeMax))
			if s == 0 {
				require.Zero(t, k)
				continue
			}
			require.Equal(t, max(-CodeMax, min(CodeMax, math.Round(u[i]/s))), float64(k), "code %d of row %d", i, r)
			step := s * float64(m[i])
			require.LessOrEqual(t, math.Abs(step*float64(k)-float64(x[r*d+i])), step/2*(1+1e-6)+1e-7*float64(m[i])*top, "value %d of row %d", i, r)
		}
	}
}

func TestQuantizeRows(t *testing.T) {
	rng := rand.New(rand.NewSource(rand.Int63()))
	const d = 12
	x := make([]float32, 6*d)
	for i := range x {
		x[i] = float32(3 * rng.NormFloat64())
		if i%d == 5 {
			x[i] = float32(40 + 5*rng.NormFloat64()) // an outlier dimension
		}
		if i%d == 9 {
			x[i] = 0 // a dimension all zero: scale 0, codes 0
		}
	}
	x[2*d+7] = -60                 // row 2's largest |x/m|, negative: code −127
	clear(x[d : 2*d])              // row 1 all zero: scale 0, codes 0
	x[3*d], x[3*d+1] = 1e-30, -2   // a tiny value beside a large one
	for i := 4 * d; i < 5*d; i++ { // a row much smaller than the others
		x[i] *= 1e-3
	}
	m, err := DimScales(x, d)
	require.NoError(t, err)
	require.Zero(t, m[9])
	codes, scales, err := QuantizeRows(x, d, m)
	require.NoError(t, err)
	checkCodes(t, x, d, m, codes, scales)
	require.Zero(t, scales[1])
	require.Equal(t, int8(-CodeMax), codes[2*d+7])
	require.Zero(t, codes[3*d], "a value below half a step rounds to 0")
	require.Less(t, scales[4], scales[0]/100, "a small row takes a small scale")
	for r := range scales {
		require.Zero(t, codes[r*d+9], "the zero dimension's codes")
	}
	// Every row but the zero one spends the whole code range on its
	// largest |x/m|, however small the row.
	for r := 0; r < 6; r++ {
		if r == 1 {
			continue
		}
		top := 0
		for _, k := range codes[r*d : (r+1)*d] {
			top = max(top, int(math.Abs(float64(k))))
		}
		require.Equal(t, CodeMax, top, "row %d", r)
	}

	// Scales smaller than the values (another index's): the row scale takes
	// the excess, no code is clamped beyond the definition.
	small := make([]float32, d)
	for i := range small {
		small[i] = m[i] / 4
	}
	codes, scales, err = QuantizeRows(x, d, small)
	require.NoError(t, err)
	checkCodes(t, x, d, small, codes, scales)

	_, _, err = QuantizeRows(x[:d+1], d, m)
	require.Error(t, err, "not whole rows")
	_, _, err = QuantizeRows(x, d, m[:d-1])
	require.Error(t, err, "too few dimension scales")
	_, _, err = QuantizeRows([]float32{1, float32(math.Inf(1))}, 2, []float32{1, 1})
	require.Error(t, err, "not finite")
	_, _, err = QuantizeRows([]float32{1, 2}, 2, []float32{1, -1})
	require.Error(t, err, "a negative dimension scale")
}

func TestPackCodes(t *testing.T) {
	codes := []int8{1, -1, 127, -127, 0, 5, -128, 64}
	words := PackCodes(codes)
	require.Equal(t, []uint32{0x81_7f_ff_01, 0x40_80_05_00}, words)
	require.Equal(t, codes, UnpackCodes(words))
}

// TestClustersQuantize quantizes an index on the device: its centroids read
// back are QuantizeRows' codes against each head's DimScales, decoded
// (Decode), the float32 ones are released, a second Quantize changes
// nothing; a quantized index joins only one quantized against its
// dimension scales (QuantizeLike), codes and scales one head after
// another.
func TestClustersQuantize(t *testing.T) {
	dev := vktest.Open(t)
	rng := rand.New(rand.NewSource(rand.Int63()))
	const heads, dim, first = 3, 20, 4
	a := randomClusters(t, dev, rng, heads, dim, 7, first, 61)
	defer a.Release()
	b := randomClusters(t, dev, rng, heads, dim, 5, first+61, 33)
	defer b.Release()
	other := randomClusters(t, dev, rng, heads, dim, 5, first+61, 33)
	defer other.Release()
	f := make([]float32, heads*a.C*dim)
	require.NoError(t, a.Centroids.ReadFloat32(0, f))
	held := a.Bytes()

	require.NoError(t, a.Quantize(dev))
	require.Nil(t, a.Centroids)
	require.Less(t, a.Bytes(), held)
	codesBuf := a.Codes
	require.NoError(t, a.Quantize(dev))
	require.Same(t, codesBuf, a.Codes, "quantized once")
	dims := make([]float32, heads*dim)
	require.NoError(t, a.DimScales.ReadFloat32(0, dims))
	for g := 0; g < heads; g++ {
		rows := f[g*a.C*dim : (g+1)*a.C*dim]
		m, err := DimScales(rows, dim)
		require.NoError(t, err)
		require.Equal(t, m, dims[g*dim:(g+1)*dim], "head %d's dimension scales", g)
		codes, scales, err := QuantizeRows(rows, dim, m)
		require.NoError(t, err)
		h, err := a.Read(g)
		require.NoError(t, err)
		for i, v := range h.Centroids {
			require.Equal(t, Decode(scales[i/dim], m[i%dim], codes[i]), v, "head %d value %d", g, i)
		}
	}
	_, err := a.Join(dev, b)
	require.ErrorContains(t, err, "8-bit", "a quantized index joins only another")
	require.NoError(t, other.Quantize(dev))
	_, err = a.Join(dev, other)
	require.ErrorContains(t, err, "dimension scales", "one quantized against its own dimension scales")

	ra, err := a.Read(1)
	require.NoError(t, err)
	fb := make([]float32, heads*b.C*dim)
	require.NoError(t, b.Centroids.ReadFloat32(0, fb))
	require.NoError(t, b.QuantizeLike(dev, a))
	rb, err := b.Read(1)
	require.NoError(t, err)
	codes, scales, err := QuantizeRows(fb[b.C*dim:2*b.C*dim], dim, dims[dim:2*dim])
	require.NoError(t, err)
	for i, v := range rb.Centroids {
		require.Equal(t, Decode(scales[i/dim], dims[dim+i%dim], codes[i]), v, "joined index's value %d, against the first's dimension scales", i)
	}
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
