package kvcache

import (
	"math/rand"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/vk/vktest"
)

func randomHalves(rng *rand.Rand, n int) []uint16 {
	f := make([]float32, n)
	for i := range f {
		f[i] = float32(rng.NormFloat64())
	}
	h, _ := ToHalves(f)
	return h
}

func TestPrefillAppendRead(t *testing.T) {
	dev := vktest.Open(t)
	rng := rand.New(rand.NewSource(rand.Int63()))
	const heads, dim, capacity = 3, 24, 41
	l, err := NewLayer(dev, heads, dim, capacity)
	require.NoError(t, err)
	defer l.Release()
	n := 37
	k, v := randomHalves(rng, heads*n*dim), randomHalves(rng, heads*n*dim)
	require.NoError(t, l.Prefill(k, v, n))
	require.Equal(t, n, l.Len())
	gotK, gotV, err := l.Read()
	require.NoError(t, err)
	require.Equal(t, k, gotK)
	require.Equal(t, v, gotV)

	wantK := make([][]uint16, heads)
	wantV := make([][]uint16, heads)
	for h := 0; h < heads; h++ {
		wantK[h] = append([]uint16{}, k[h*n*dim:(h+1)*n*dim]...)
		wantV[h] = append([]uint16{}, v[h*n*dim:(h+1)*n*dim]...)
	}
	for l.Len() < capacity {
		ak, av := randomHalves(rng, heads*dim), randomHalves(rng, heads*dim)
		require.NoError(t, l.Append(ak, av))
		for h := 0; h < heads; h++ {
			wantK[h] = append(wantK[h], ak[h*dim:(h+1)*dim]...)
			wantV[h] = append(wantV[h], av[h*dim:(h+1)*dim]...)
		}
	}
	gotK, gotV, err = l.Read()
	require.NoError(t, err)
	for h := 0; h < heads; h++ {
		rows := capacity * dim
		require.Equal(t, wantK[h], gotK[h*rows:(h+1)*rows], "keys of head %d", h)
		require.Equal(t, wantV[h], gotV[h*rows:(h+1)*rows], "values of head %d", h)
	}
}

// TestBadInputLeavesCacheUnchanged checks every refusal happens before any
// write: the stored tokens and length stay as they were.
func TestBadInputLeavesCacheUnchanged(t *testing.T) {
	dev := vktest.Open(t)
	rng := rand.New(rand.NewSource(rand.Int63()))
	const heads, dim, capacity = 2, 16, 8
	l, err := NewLayer(dev, heads, dim, capacity)
	require.NoError(t, err)
	defer l.Release()
	n := capacity
	k, v := randomHalves(rng, heads*n*dim), randomHalves(rng, heads*n*dim)
	require.NoError(t, l.Prefill(k, v, n))

	one := randomHalves(rng, heads*dim)
	require.ErrorContains(t, l.Append(one, one), "capacity", "append over capacity")
	require.ErrorContains(t, l.Prefill(k, v, n+1), "", "prefill over capacity")
	require.ErrorContains(t, l.Prefill(k[:10], v, n), "needs", "shape mismatch")
	require.Error(t, l.Prefill(nil, nil, 0), "zero tokens")
	nan := append([]uint16{}, k...)
	nan[5] = 0x7e00 // fp16 NaN
	require.ErrorContains(t, l.Prefill(nan, v, n), "NaN")

	require.Equal(t, n, l.Len())
	gotK, gotV, err := l.Read()
	require.NoError(t, err)
	require.Equal(t, k, gotK)
	require.Equal(t, v, gotV)

	small, err := NewLayer(dev, heads, dim, capacity)
	require.NoError(t, err)
	defer small.Release()
	require.ErrorContains(t, small.Append(one[:3], one), "needs")
	inf := append([]uint16{}, one...)
	inf[0] = 0x7c00 // fp16 +Inf
	require.ErrorContains(t, small.Append(inf, one), "Inf")
	require.Equal(t, 0, small.Len())

	_, err = NewLayer(dev, 2, 12, 4)
	require.ErrorContains(t, err, "multiple of 8")
	_, err = NewLayer(dev, 0, 16, 4)
	require.Error(t, err)
}

func TestToHalves(t *testing.T) {
	h, err := ToHalves([]float32{1, -2.5, 65504})
	require.NoError(t, err)
	require.Equal(t, []uint16{0x3c00, 0xc100, 0x7bff}, h)
	_, err = ToHalves([]float32{70000})
	require.Error(t, err, "overflows fp16")
}

// TestReleasedLayer checks that a released cache refuses every call with
// vk.ErrReleased instead of touching freed memory.
func TestReleasedLayer(t *testing.T) {
	dev := vktest.Open(t)
	l, err := NewLayer(dev, 1, 8, 4)
	require.NoError(t, err)
	require.NoError(t, l.Release())
	one := make([]uint16, 8)
	require.ErrorIs(t, l.Prefill(one, one, 1), vk.ErrReleased)
	require.ErrorIs(t, l.Append(one, one), vk.ErrReleased)
	require.ErrorIs(t, l.Truncate(0), vk.ErrReleased)
	_, _, err = l.Read()
	require.ErrorIs(t, err, vk.ErrReleased)
	_, err = l.ReadPositions()
	require.ErrorIs(t, err, vk.ErrReleased)
	require.ErrorIs(t, l.Release(), vk.ErrReleased)
}
