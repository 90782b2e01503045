package kvcache

import (
	"fmt"
	"math/rand"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/x448/float16"

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
	one := make([]uint16, 8)
	require.NoError(t, l.Prefill(one, one, 1))
	require.NoError(t, l.Release())
	require.Zero(t, l.Len(), "a released layer holds no token")
	require.ErrorIs(t, l.Prefill(one, one, 1), vk.ErrReleased)
	require.ErrorIs(t, l.Append(one, one), vk.ErrReleased)
	require.ErrorIs(t, l.Truncate(0), vk.ErrReleased)
	_, _, err = l.Read()
	require.ErrorIs(t, err, vk.ErrReleased)
	_, err = l.ReadPositions()
	require.ErrorIs(t, err, vk.ErrReleased)
	require.ErrorIs(t, l.Release(), vk.ErrReleased)
}

// TestCapacityBeyondDeviceLimits checks that NewLayer refuses, naming the
// limit, a head larger than the device's storage-buffer range and a cache
// larger than its largest allocation, before allocating anything.
func TestCapacityBeyondDeviceLimits(t *testing.T) {
	dev := vktest.Open(t)
	info := dev.Info()
	const dim = 256
	fits := int(info.MaxStorageBufferRange / (dim * 2))
	_, err := NewLayer(dev, 1, dim, fits+1)
	require.ErrorIs(t, err, vk.ErrUnsupported)
	require.ErrorContains(t, err, "maxStorageBufferRange")
	require.ErrorContains(t, err, fmt.Sprintf("at most %d tokens", fits))

	// 2⁶² tokens of 512 bytes pass 2⁶⁴ bytes: the message still says how many.
	_, err = NewLayer(dev, 1, dim, 1<<62)
	require.ErrorIs(t, err, vk.ErrUnsupported)
	require.ErrorContains(t, err, "takes 2.361e+21 bytes")

	heads := int(info.MaxAllocation/(64*dim*2)) + 1
	_, err = NewLayer(dev, heads, dim, 64)
	require.ErrorIs(t, err, vk.ErrUnsupported)
	require.ErrorContains(t, err, "largest allocation")
}

// TestConcurrentAppends appends from several goroutines at once while
// others read: every token lands in a slot of its own, whole.
func TestConcurrentAppends(t *testing.T) {
	dev := vktest.Open(t)
	const heads, dim, workers, each = 2, 8, 4, 6
	l, err := NewLayer(dev, heads, dim, workers*each)
	require.NoError(t, err)
	defer l.Release()
	var wg sync.WaitGroup
	errs := make(chan error, 2*workers)
	for w := 0; w < workers; w++ {
		wg.Add(2)
		go func(w int) {
			defer wg.Done()
			for i := 0; i < each; i++ {
				// Token w·each+i holds its own number in every key and value.
				tok := make([]uint16, heads*dim)
				for j := range tok {
					tok[j] = uint16(float16.Fromfloat32(float32(w*each + i)))
				}
				if err := l.Append(tok, tok); err != nil {
					errs <- err
				}
			}
		}(w)
		go func() {
			defer wg.Done()
			for i := 0; i < each; i++ {
				if _, _, err := l.Read(); err != nil {
					errs <- err
				}
				_ = l.Len()
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.Equal(t, workers*each, l.Len())
	k, v, err := l.Read()
	require.NoError(t, err)
	require.Equal(t, k, v)
	seen := map[float32]bool{}
	for h := 0; h < heads; h++ {
		for s := 0; s < l.Len(); s++ {
			row := k[(h*l.Len()+s)*dim : (h*l.Len()+s+1)*dim]
			for _, x := range row {
				require.Equal(t, row[0], x, "slot %d of head %d mixes tokens", s, h)
			}
			seen[float16.Frombits(row[0]).Float32()] = true
		}
	}
	require.Len(t, seen, workers*each)
}

// TestExtendAppendsTokens extends a layer by blocks of odd sizes up to its
// capacity and checks what Read returns, then that bad blocks (too many
// tokens, the wrong length, NaN) are refused and leave it as it was.
func TestExtendAppendsTokens(t *testing.T) {
	dev := vktest.Open(t)
	rng := rand.New(rand.NewSource(rand.Int63()))
	const heads, dim, capacity = 3, 16, 50
	l, err := NewLayer(dev, heads, dim, capacity)
	require.NoError(t, err)
	defer l.Release()
	wantK := make([][]uint16, heads)
	wantV := make([][]uint16, heads)
	for _, count := range []int{1, 13, 29, 7} {
		k, v := randomHalves(rng, heads*count*dim), randomHalves(rng, heads*count*dim)
		require.NoError(t, l.Extend(k, v, count))
		for h := 0; h < heads; h++ {
			wantK[h] = append(wantK[h], k[h*count*dim:(h+1)*count*dim]...)
			wantV[h] = append(wantV[h], v[h*count*dim:(h+1)*count*dim]...)
		}
	}
	require.Equal(t, capacity, l.Len())
	check := func() {
		gotK, gotV, err := l.Read()
		require.NoError(t, err)
		for h := 0; h < heads; h++ {
			rows := capacity * dim
			require.Equal(t, wantK[h], gotK[h*rows:(h+1)*rows], "keys of head %d", h)
			require.Equal(t, wantV[h], gotV[h*rows:(h+1)*rows], "values of head %d", h)
		}
	}
	check()
	require.NoError(t, l.Truncate(40))
	nanK := randomHalves(rng, heads*5*dim)
	nanK[17] = 0x7e00
	for _, bad := range []struct {
		k, v  []uint16
		count int
	}{
		{randomHalves(rng, heads*11*dim), randomHalves(rng, heads*11*dim), 11},
		{randomHalves(rng, heads*5*dim), randomHalves(rng, heads*4*dim), 5},
		{nanK, randomHalves(rng, heads*5*dim), 5},
		{nil, nil, 0},
	} {
		require.Error(t, l.Extend(bad.k, bad.v, bad.count))
		require.Equal(t, 40, l.Len())
	}
	require.NoError(t, l.Extend(flatten(wantK, 40, 50, dim), flatten(wantV, 40, 50, dim), 10))
	check()
}

// flatten returns rows [from, to) of every head, [heads][to−from][dim].
func flatten(perHead [][]uint16, from, to, dim int) []uint16 {
	var out []uint16
	for _, h := range perHead {
		out = append(out, h[from*dim:to*dim]...)
	}
	return out
}

// TestLayerHolds checks that a held layer refuses Release and the Prefill
// of a new sequence until every hold is dropped, and that a released
// layer refuses holds.
func TestLayerHolds(t *testing.T) {
	dev := vktest.Open(t)
	l, err := NewLayer(dev, 1, 8, 4)
	require.NoError(t, err)
	one := make([]uint16, 8)
	require.NoError(t, l.Prefill(one, one, 1))
	require.NoError(t, l.Hold())
	require.NoError(t, l.Hold())
	require.ErrorContains(t, l.Release(), "read by 2")
	require.ErrorContains(t, l.Prefill(one, one, 1), "release them first")
	require.NoError(t, l.Append(one, one), "appends go on under readers")
	l.Drop()
	require.Error(t, l.Release(), "one hold left")
	l.Drop()
	require.NoError(t, l.Prefill(one, one, 1))
	require.NoError(t, l.Release())
	require.ErrorIs(t, l.Hold(), vk.ErrReleased)
}
