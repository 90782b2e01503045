// Package kvcache owns the key/value storage of one attention layer of one
// sequence on the device: fp16 keys and values, packed two per 32-bit word,
// laid out [KVHeads][Capacity][HeadDim], of which the first Len rows of each
// head are filled.
//
// # Concurrency
//
// A Layer's methods are safe for concurrent use: each holds the layer's
// lock, so calls from several goroutines run one after another and every
// one sees the cache as a whole call left it. A refused call changes
// nothing. The lock does not reach the GPU: kernels that read the layer
// (the plans of package sparse) read whatever it holds when they run, so
// do not Prefill, Truncate or Reorder a layer while another goroutine
// attends over it (Append only writes past the rows an earlier attention
// reads). A Clusters index belongs to one goroutine at a time.
//
// # Limits
//
// Kernels bind a KV head's rows as one storage-buffer range, so NewLayer
// refuses a capacity whose head (capacity × headDim × 2 bytes) exceeds the
// device's maxStorageBufferRange (128 MiB on lavapipe), and a cache larger
// than the device's largest allocation, with vk.ErrUnsupported, before
// allocating anything. Dense attention binds a layer head by head; the
// clustering and the Tactic step of package sparse bind all of a layer's
// keys at once, so they need kvHeads × capacity × headDim × 2 bytes within
// the range and refuse a larger layer with vk.ErrUnsupported before
// dispatching anything.
package kvcache

import (
	"errors"
	"fmt"
	"math"
	"sync"
	"unsafe"

	"github.com/x448/float16"

	"github.com/vksparse/vksparse/vk"
)

// Layer is one layer's KV cache for one sequence.
type Layer struct {
	mu                         sync.Mutex // guards n, reordered and the buffers' contents
	dev                        *vk.Device
	kvHeads, headDim, capacity int
	keys, values               *vk.Buffer
	positions                  *vk.Buffer // uint32 [KVHeads][Capacity]; nil until the first Reorder
	n                          int
	// reordered lists the slot ranges [from, to) that Reorder put in
	// cluster order.
	reordered [][2]int
	// holds counts the plans and steps that bind the layer's buffers
	// (Hold): Release and Prefill refuse while there are any.
	holds int
}

// NewLayer allocates a cache for capacity tokens of kvHeads heads of headDim.
func NewLayer(dev *vk.Device, kvHeads, headDim, capacity int) (*Layer, error) {
	if kvHeads <= 0 || headDim <= 0 || capacity <= 0 {
		return nil, fmt.Errorf("kvcache: kvHeads %d, headDim %d and capacity %d must be positive", kvHeads, headDim, capacity)
	}
	if headDim%8 != 0 {
		return nil, fmt.Errorf("kvcache: headDim %d is not a multiple of 8", headDim)
	}
	if err := checkCapacity(dev.Info(), kvHeads, headDim, capacity); err != nil {
		return nil, err
	}
	size := uint64(kvHeads) * uint64(capacity) * uint64(headDim) * 2
	k, err := dev.NewBuffer(size, vk.DeviceLocal)
	if err != nil {
		return nil, fmt.Errorf("kvcache: keys: %w", err)
	}
	v, err := dev.NewBuffer(size, vk.DeviceLocal)
	if err != nil {
		return nil, errors.Join(fmt.Errorf("kvcache: values: %w", err), k.Release())
	}
	return &Layer{dev: dev, kvHeads: kvHeads, headDim: headDim, capacity: capacity, keys: k, values: v}, nil
}

// checkCapacity refuses a cache the device cannot hold or bind: a head
// beyond the storage-buffer range, or keys beyond the largest allocation.
func checkCapacity(info vk.Info, kvHeads, headDim, capacity int) error {
	row := uint64(headDim) * 2
	if maxTokens := info.MaxStorageBufferRange / row; uint64(capacity) > maxTokens {
		// The head's bytes as a float: capacity·row may pass 2⁶⁴.
		return fmt.Errorf("kvcache: %w: a KV head of %d tokens × %d dims takes %.4g bytes, beyond the device's maxStorageBufferRange of %d bytes (at most %d tokens per layer)",
			vk.ErrUnsupported, capacity, headDim, float64(capacity)*float64(row), info.MaxStorageBufferRange, maxTokens)
	}
	head := uint64(capacity) * row
	if maxHeads := info.MaxAllocation / head; uint64(kvHeads) > maxHeads {
		return fmt.Errorf("kvcache: %w: %d KV heads of %d bytes exceed the device's largest allocation of %d bytes (at most %d heads of this capacity)",
			vk.ErrUnsupported, kvHeads, head, info.MaxAllocation, maxHeads)
	}
	return nil
}

// KVHeads returns the number of KV heads.
func (l *Layer) KVHeads() int { return l.kvHeads }

// HeadDim returns the head dimension.
func (l *Layer) HeadDim() int { return l.headDim }

// Capacity returns the most tokens the cache holds.
func (l *Layer) Capacity() int { return l.capacity }

// Hold records a reader that binds the layer's buffers (a plan or a
// step): until its Drop, Release and Prefill refuse. A released layer
// refuses the hold.
func (l *Layer) Hold() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.keys == nil {
		return vk.ErrReleased
	}
	l.holds++
	return nil
}

// Drop ends a Hold.
func (l *Layer) Drop() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.holds > 0 {
		l.holds--
	}
}

// Len returns the number of tokens stored (0 once released).
func (l *Layer) Len() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.keys == nil {
		return 0 // released
	}
	return l.n
}

// Keys returns the key buffer, [KVHeads][Capacity][HeadDim] fp16.
func (l *Layer) Keys() *vk.Buffer { return l.keys }

// Values returns the value buffer, laid out as Keys.
func (l *Layer) Values() *vk.Buffer { return l.values }

// Positions returns the token position of every slot, uint32
// [KVHeads][Capacity] (the first Len of each head are set), or nil while
// the layer was never reordered: slot t then holds position t, and the
// layer keeps no buffer to say so.
func (l *Layer) Positions() *vk.Buffer { return l.positions }

// HeadBytes returns the bytes between consecutive heads' rows.
func (l *Layer) HeadBytes() uint64 { return uint64(l.capacity) * uint64(l.headDim) * 2 }

// CheckFinite reports the first fp16 value of h that is NaN or infinite
// (what names h in the error), or nil when every value is finite.
func CheckFinite(what string, h []uint16) error {
	for i, x := range h {
		if f := float16.Frombits(x); f.IsNaN() || f.IsInf(0) {
			return fmt.Errorf("kvcache: %s[%d] is not finite (%v)", what, i, f.Float32())
		}
	}
	return nil
}

// checkPrefill reports why Prefill(k, v, n) must be refused by a layer of
// kvHeads heads of headDim with room for capacity tokens (all positive,
// as NewLayer ensures), or nil when it may go ahead. It needs no device.
func checkPrefill(kvHeads, headDim, capacity int, k, v []uint16, n int) error {
	switch {
	case n <= 0:
		return fmt.Errorf("kvcache: Prefill of %d tokens", n)
	case n > capacity:
		return fmt.Errorf("kvcache: Prefill of %d tokens exceeds capacity %d", n, capacity)
	}
	if want := kvHeads * n * headDim; len(k) != want || len(v) != want {
		return fmt.Errorf("kvcache: Prefill of %d tokens needs %d keys and values (%d heads × %d × %d), got %d and %d", n, want, kvHeads, n, headDim, len(k), len(v))
	}
	if err := CheckFinite("k", k); err != nil {
		return err
	}
	return CheckFinite("v", v)
}

// checkAppend reports why Append(k, v) must be refused by such a layer
// holding stored tokens, or nil when it may go ahead.
func checkAppend(kvHeads, headDim, capacity, stored int, k, v []uint16) error {
	want := kvHeads * headDim
	switch {
	case len(k) != want || len(v) != want:
		return fmt.Errorf("kvcache: Append needs %d keys and values (%d heads × %d), got %d and %d", want, kvHeads, headDim, len(k), len(v))
	case stored >= capacity:
		return fmt.Errorf("kvcache: Append beyond capacity %d", capacity)
	}
	if err := CheckFinite("k", k); err != nil {
		return err
	}
	return CheckFinite("v", v)
}

// Prefill replaces the cache's contents with n tokens: k and v hold fp16
// bit patterns in [KVHeads][n][HeadDim] order, and slots are back in token
// order (an index that Reorder used no longer describes them). Every check
// comes before the first write: a refused call leaves the cache as it was;
// one the device fails part way leaves it empty.
func (l *Layer) Prefill(k, v []uint16, n int) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.keys == nil {
		return vk.ErrReleased
	}
	if l.holds > 0 {
		return fmt.Errorf("kvcache: Prefill of a new sequence while %d plans or steps read the layer's old one: release them first", l.holds)
	}
	if err := checkPrefill(l.kvHeads, l.headDim, l.capacity, k, v, n); err != nil {
		return err
	}
	if err := l.write(k, v, n); err != nil {
		// The device failed part way: whatever the slots hold now, none of
		// it is a cache the caller filled.
		l.n, l.reordered = 0, nil
		return fmt.Errorf("kvcache: Prefill (the cache is left empty): %w", err)
	}
	l.n = n
	l.reordered = nil
	return nil
}

// write stores n tokens' keys, values and positions from slot 0.
func (l *Layer) write(k, v []uint16, n int) error {
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
	return l.writePositions(0, n)
}

// writePositions records that slots [from, from+n) of every head hold
// their own positions, where the layer keeps positions.
func (l *Layer) writePositions(from, n int) error {
	return l.dev.Upload(l.positionUploads(from, n)...)
}

// positionUploads returns the writes of the identity positions of slots
// [from, from+n) of every head (none before the first Reorder).
func (l *Layer) positionUploads(from, n int) []vk.Upload {
	if l.positions == nil || n == 0 {
		return nil
	}
	ids := make([]uint32, n)
	for i := range ids {
		ids[i] = uint32(from + i)
	}
	raw := unsafe.Slice((*byte)(unsafe.Pointer(&ids[0])), 4*n)
	ups := make([]vk.Upload, l.kvHeads)
	for h := range ups {
		ups[h] = vk.Upload{To: l.positions, Offset: uint64(h*l.capacity+from) * 4, Data: raw}
	}
	return ups
}

// Append adds one token: k and v hold [KVHeads][HeadDim] fp16 bit
// patterns. A refused call, or one the device fails, leaves Len and the
// stored tokens as they were.
func (l *Layer) Append(k, v []uint16) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.keys == nil {
		return vk.ErrReleased
	}
	if err := checkAppend(l.kvHeads, l.headDim, l.capacity, l.n, k, v); err != nil {
		return err
	}
	return l.appendRows(k, v, 1)
}

// Extend appends count tokens: k and v hold [KVHeads][count][HeadDim] fp16
// bit patterns. Every check comes before the first write; a refused call
// leaves the cache as it was, and one the device fails part way leaves
// Len as it was (the slots past it are written again by later appends).
func (l *Layer) Extend(k, v []uint16, count int) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.keys == nil {
		return vk.ErrReleased
	}
	if count <= 0 || l.n+count > l.capacity {
		return fmt.Errorf("kvcache: Extend by %d tokens past the %d stored, capacity %d", count, l.n, l.capacity)
	}
	if want := l.kvHeads * count * l.headDim; len(k) != want || len(v) != want {
		return fmt.Errorf("kvcache: Extend by %d tokens needs %d keys and values, got %d and %d", count, want, len(k), len(v))
	}
	if err := errors.Join(CheckFinite("k", k), CheckFinite("v", v)); err != nil {
		return err
	}
	return l.appendRows(k, v, count)
}

// appendRows writes count checked tokens ([KVHeads][count][HeadDim]) and
// their positions past the stored ones, then counts them; Len stays as it
// was when the device fails.
func (l *Layer) appendRows(k, v []uint16, count int) error {
	rows := count * l.headDim
	ups := make([]vk.Upload, 0, 3*l.kvHeads)
	for h := 0; h < l.kvHeads; h++ {
		off := uint64(h)*l.HeadBytes() + uint64(l.n*l.headDim*2)
		ups = append(ups,
			vk.Upload{To: l.keys, Offset: off, Data: halfBytes(k[h*rows : (h+1)*rows])},
			vk.Upload{To: l.values, Offset: off, Data: halfBytes(v[h*rows : (h+1)*rows])})
	}
	if err := l.dev.Upload(append(ups, l.positionUploads(l.n, count)...)...); err != nil {
		return err
	}
	l.n += count
	return nil
}

// halfBytes views fp16 bit patterns as bytes.
func halfBytes(s []uint16) []byte {
	if len(s) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&s[0])), 2*len(s))
}

// Truncate drops the tokens from n on (0 ≤ n ≤ Len); their slots are
// written again by later appends.
func (l *Layer) Truncate(n int) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.keys == nil {
		return vk.ErrReleased
	}
	if n < 0 || n > l.n {
		return fmt.Errorf("kvcache: Truncate to %d tokens of %d", n, l.n)
	}
	for _, r := range l.reordered {
		if n > r[0] && n < r[1] {
			return fmt.Errorf("kvcache: Truncate to %d tokens inside the range [%d, %d) kept in cluster order", n, r[0], r[1])
		}
	}
	kept := l.reordered[:0]
	for _, r := range l.reordered {
		if r[1] <= n {
			kept = append(kept, r)
		}
	}
	l.reordered = kept
	l.n = n
	return nil
}

// Read returns the stored keys and values, [KVHeads][Len][HeadDim], in slot
// order (ReadPositions gives each slot's token position).
func (l *Layer) Read() (k, v []uint16, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.keys == nil {
		return nil, nil, vk.ErrReleased
	}
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
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.keys == nil {
		return vk.ErrReleased
	}
	if l.holds > 0 {
		return fmt.Errorf("kvcache: the layer is read by %d plans or steps: release them first", l.holds)
	}
	err := errors.Join(l.keys.Release(), l.values.Release())
	if l.positions != nil {
		err = errors.Join(err, l.positions.Release())
	}
	l.keys, l.values, l.positions = nil, nil, nil
	return err
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

// CacheBytes returns the device memory of the layer's keys and values at
// capacity.
func (l *Layer) CacheBytes() uint64 { return vk.Held(l.keys, l.values) }

// Bytes returns the device memory the layer holds: keys, values and
// positions.
func (l *Layer) Bytes() uint64 { return vk.Held(l.keys, l.values, l.positions) }
