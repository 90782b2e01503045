// Package kvcache owns the key/value storage of one attention layer of one
// sequence on the device: fp16 keys and values, packed two per 32-bit word,
// laid out [KVHeads][Capacity][HeadDim], of which the first Len rows of each
// head are filled.
package kvcache

import (
	"fmt"
	"math"

	"github.com/x448/float16"

	"github.com/vksparse/vksparse/vk"
)

// Layer is one layer's KV cache for one sequence.
type Layer struct {
	dev                        *vk.Device
	kvHeads, headDim, capacity int
	keys, values               *vk.Buffer
	n                          int
}

// NewLayer allocates a cache for capacity tokens of kvHeads heads of headDim.
func NewLayer(dev *vk.Device, kvHeads, headDim, capacity int) (*Layer, error) {
	if kvHeads <= 0 || headDim <= 0 || capacity <= 0 {
		return nil, fmt.Errorf("kvcache: kvHeads %d, headDim %d and capacity %d must be positive", kvHeads, headDim, capacity)
	}
	if headDim%8 != 0 {
		return nil, fmt.Errorf("kvcache: headDim %d is not a multiple of 8", headDim)
	}
	size := uint64(kvHeads) * uint64(capacity) * uint64(headDim) * 2
	k, err := dev.NewBuffer(size, vk.DeviceLocal)
	if err != nil {
		return nil, fmt.Errorf("kvcache: keys: %w", err)
	}
	v, err := dev.NewBuffer(size, vk.DeviceLocal)
	if err != nil {
		k.Release()
		return nil, fmt.Errorf("kvcache: values: %w", err)
	}
	return &Layer{dev: dev, kvHeads: kvHeads, headDim: headDim, capacity: capacity, keys: k, values: v}, nil
}

// KVHeads returns the number of KV heads.
func (l *Layer) KVHeads() int { return l.kvHeads }

// HeadDim returns the head dimension.
func (l *Layer) HeadDim() int { return l.headDim }

// Capacity returns the most tokens the cache holds.
func (l *Layer) Capacity() int { return l.capacity }

// Len returns the number of tokens stored.
func (l *Layer) Len() int { return l.n }

// Keys returns the key buffer, [KVHeads][Capacity][HeadDim] fp16.
func (l *Layer) Keys() *vk.Buffer { return l.keys }

// Values returns the value buffer, laid out as Keys.
func (l *Layer) Values() *vk.Buffer { return l.values }

// HeadBytes returns the bytes between consecutive heads' rows.
func (l *Layer) HeadBytes() uint64 { return uint64(l.capacity) * uint64(l.headDim) * 2 }

// checkHalves reports the first non-finite fp16 value, if any.
func checkHalves(what string, h []uint16) error {
	for i, x := range h {
		if f := float16.Frombits(x); f.IsNaN() || f.IsInf(0) {
			return fmt.Errorf("kvcache: %s[%d] is %v", what, i, f.Float32())
		}
	}
	return nil
}

// Prefill replaces the cache's contents with n tokens: k and v hold fp16
// bit patterns in [KVHeads][n][HeadDim] order.
func (l *Layer) Prefill(k, v []uint16, n int) error {
	want := l.kvHeads * n * l.headDim
	switch {
	case n <= 0:
		return fmt.Errorf("kvcache: Prefill of %d tokens", n)
	case n > l.capacity:
		return fmt.Errorf("kvcache: Prefill of %d tokens exceeds capacity %d", n, l.capacity)
	case len(k) != want || len(v) != want:
		return fmt.Errorf("kvcache: Prefill of %d tokens needs %d keys and values (%d heads × %d × %d), got %d and %d", n, want, l.kvHeads, n, l.headDim, len(k), len(v))
	}
	if err := checkHalves("k", k); err != nil {
		return err
	}
	if err := checkHalves("v", v); err != nil {
		return err
	}
	rows := n * l.headDim
	if n == l.capacity {
		if err := l.keys.WriteUint16(0, k); err != nil {
			return err
		}
		if err := l.values.WriteUint16(0, v); err != nil {
			return err
		}
	} else {
		for h := 0; h < l.kvHeads; h++ {
			off := uint64(h) * l.HeadBytes()
			if err := l.keys.WriteUint16(off, k[h*rows:(h+1)*rows]); err != nil {
				return err
			}
			if err := l.values.WriteUint16(off, v[h*rows:(h+1)*rows]); err != nil {
				return err
			}
		}
	}
	l.n = n
	return nil
}

// Append adds one token: k and v hold [KVHeads][HeadDim] fp16 bit patterns.
func (l *Layer) Append(k, v []uint16) error {
	want := l.kvHeads * l.headDim
	switch {
	case len(k) != want || len(v) != want:
		return fmt.Errorf("kvcache: Append needs %d keys and values (%d heads × %d), got %d and %d", want, l.kvHeads, l.headDim, len(k), len(v))
	case l.n >= l.capacity:
		return fmt.Errorf("kvcache: Append beyond capacity %d", l.capacity)
	}
	if err := checkHalves("k", k); err != nil {
		return err
	}
	if err := checkHalves("v", v); err != nil {
		return err
	}
	for h := 0; h < l.kvHeads; h++ {
		off := uint64(h)*l.HeadBytes() + uint64(l.n*l.headDim*2)
		if err := l.keys.WriteUint16(off, k[h*l.headDim:(h+1)*l.headDim]); err != nil {
			return err
		}
		if err := l.values.WriteUint16(off, v[h*l.headDim:(h+1)*l.headDim]); err != nil {
			return err
		}
	}
	l.n++
	return nil
}

// Truncate drops the tokens from n on (0 ≤ n ≤ Len); their slots are
// written again by later appends.
func (l *Layer) Truncate(n int) error {
	if n < 0 || n > l.n {
		return fmt.Errorf("kvcache: Truncate to %d tokens of %d", n, l.n)
	}
	l.n = n
	return nil
}

// Read returns the stored keys and values, [KVHeads][Len][HeadDim].
func (l *Layer) Read() (k, v []uint16, err error) {
	rows := l.n * l.headDim
	k = make([]uint16, l.kvHeads*rows)
	v = make([]uint16, l.kvHeads*rows)
	for h := 0; h < l.kvHeads; h++ {
		off := uint64(h) * l.HeadBytes()
		if err := l.keys.ReadUint16(off, k[h*rows:(h+1)*rows]); err != nil {
			return nil, nil, err
		}
		if err := l.values.ReadUint16(off, v[h*rows:(h+1)*rows]); err != nil {
			return nil, nil, err
		}
	}
	return k, v, nil
}

// Release frees the cache's device memory.
func (l *Layer) Release() error {
	if l.keys == nil {
		return vk.ErrReleased
	}
	err1 := l.keys.Release()
	err2 := l.values.Release()
	l.keys, l.values = nil, nil
	if err1 != nil {
		return err1
	}
	return err2
}

// ToHalves converts float32 values to fp16 bit patterns (round to nearest
// even), returning an error for values that are not finite in fp16.
func ToHalves(x []float32) ([]uint16, error) {
	out := make([]uint16, len(x))
	for i, f := range x {
		h := float16.Fromfloat32(f)
		if math.IsNaN(float64(f)) || h.IsInf(0) {
			return nil, fmt.Errorf("kvcache: value %d (%v) is not finite in fp16", i, f)
		}
		out[i] = uint16(h)
	}
	return out, nil
}
