package kvcache

import (
	"errors"
	"fmt"

	"github.com/vksparse/vksparse/shaders"
	"github.com/vksparse/vksparse/vk"
)

// reorderWorkgroup is the threads per workgroup of the reorder kernel.
const reorderWorkgroup = 256

// reorderKernel returns the device's shared reorder kernel for heads of
// headDim, compiled on its first use.
func reorderKernel(dev *vk.Device, headDim int) (*vk.Pipeline, error) {
	code, err := shaders.SPIRV("kv_reorder")
	if err != nil {
		return nil, err
	}
	return dev.SharedPipeline(vk.Kernel{Name: "kv_reorder", SPIRV: code, Bindings: 6, PushWords: 5, Specialization: []uint32{reorderWorkgroup, uint32(headDim)}})
}

// PrepareReorder compiles the kernel of Reorder for heads of headDim on
// dev, so that the first Reorder does not: compiling it took 9.7 ms of an
// NVIDIA H200's first clustering of a 131 072-token layer, more than
// storing the layer in cluster order itself.
func PrepareReorder(dev *vk.Device, headDim int) error {
	if headDim <= 0 || headDim%8 != 0 {
		return fmt.Errorf("kvcache: reorder kernel for heads of %d (a positive multiple of 8)", headDim)
	}
	_, err := reorderKernel(dev, headDim)
	return err
}

// Reorder stores the tokens that x clusters in cluster order, so that a
// cluster's keys and values are one contiguous run of slots: afterwards
// slot x.First+Starts[g][c]+i of head g holds member i of cluster c
// (Members[g][Starts[g][c]+i]), Positions records that member's token
// position, and x.Contiguous is set. The range must still be in token
// order (slot t holding position t: not reordered before) and stored. On
// error the layer is as it was.
func (l *Layer) Reorder(x *Clusters) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	switch {
	case l.keys == nil:
		return vk.ErrReleased
	case x.KVHeads != l.kvHeads || x.HeadDim != l.headDim:
		return fmt.Errorf("kvcache: Reorder by an index of %d heads of %d for a cache of %d of %d", x.KVHeads, x.HeadDim, l.kvHeads, l.headDim)
	case x.First < 0 || x.First+x.Count > l.n:
		return fmt.Errorf("kvcache: Reorder of tokens [%d, %d) beyond the %d stored", x.First, x.First+x.Count, l.n)
	case x.Contiguous:
		return fmt.Errorf("kvcache: Reorder by an index already in cluster order")
	}
	for _, r := range l.reordered {
		if x.First < r[1] && r[0] < x.First+x.Count {
			return fmt.Errorf("kvcache: Reorder of tokens [%d, %d) overlaps [%d, %d), already in cluster order", x.First, x.First+x.Count, r[0], r[1])
		}
	}
	pipe, err := reorderKernel(l.dev, l.headDim)
	if err != nil {
		return err
	}
	if l.positions == nil {
		// The first reorder: from now on slots and positions differ.
		if l.positions, err = l.dev.NewBuffer(uint64(l.kvHeads)*uint64(l.capacity)*4, vk.DeviceLocal); err != nil {
			l.positions = nil
			return fmt.Errorf("kvcache: positions: %w", err)
		}
		made := l.positions
		defer func() {
			if x.Contiguous && l.positions == made {
				return
			}
			made.Release() // the reorder failed: the layer is as it was
			l.positions = nil
		}()
		// The stored slots outside the range keep their own positions;
		// the kernel writes the range's.
		ups := append(l.positionUploads(0, x.First), l.positionUploads(x.First+x.Count, l.n-x.First-x.Count)...)
		if err := l.dev.Upload(ups...); err != nil {
			return err
		}
	}
	// The range's keys and values are copied to one scratch buffer, keys
	// from 0 and values from vAt (one allocation: each costs about a
	// millisecond at this size on an H200).
	rowBytes := uint64(l.headDim) * 2
	span := uint64(x.Count) * rowBytes
	align := max(l.dev.Info().StorageOffsetAlignment, 16)
	vAt := (span + align - 1) / align * align
	src, err := l.dev.NewBuffer(vAt+span, vk.DeviceLocal)
	if err != nil {
		return fmt.Errorf("kvcache: Reorder: %w", err)
	}
	defer src.Release()
	srcK, srcV := src.Slice(0, span), src.Slice(vAt, span)
	var binds []*vk.Binding
	defer func() {
		for _, b := range binds {
			b.Release()
		}
	}()
	// Each head's rows are bound from the aligned offset at or below their
	// start; the kernel adds the rest (push word skip, in uvec4 units).
	skip := make([]uint32, l.kvHeads)
	for g := 0; g < l.kvHeads; g++ {
		head := uint64(g) * l.HeadBytes()
		at := head / align * align
		skip[g] = uint32((head - at) / 16)
		rows := head + l.HeadBytes() - at
		pos := uint64(g*l.capacity) * 4
		pat := pos / align * align
		// Positions are addressed as head·capacity + slot from the aligned offset.
		b, err := pipe.Bind(srcK, srcV, l.keys.Slice(at, rows), l.values.Slice(at, rows),
			x.Members.All(), l.positions.Slice(pat, pos+uint64(l.capacity)*4-pat))
		if err != nil {
			return err
		}
		binds = append(binds, b)
	}
	groups := uint32((x.Count*(l.headDim/8) + reorderWorkgroup - 1) / reorderWorkgroup)
	err = l.dev.Run(func(c *vk.Commands) {
		for g := 0; g < l.kvHeads; g++ {
			from := uint64(g)*l.HeadBytes() + uint64(x.First)*rowBytes
			c.Copy(l.keys.Slice(from, span), srcK)
			c.Copy(l.values.Slice(from, span), srcV)
			c.Barrier()
			posSkip := uint32(uint64(g*l.capacity) * 4 % align / 4)
			c.Dispatch(pipe, binds[g], []uint32{uint32(x.First), uint32(x.Count), skip[g], uint32(g * x.Count), posSkip}, groups, 1, 1)
			c.Barrier()
		}
	})
	if err != nil {
		return fmt.Errorf("kvcache: Reorder: %w", err)
	}
	l.reordered = append(l.reordered, [2]int{x.First, x.First + x.Count})
	x.Contiguous = true
	return nil
}

// ReadPositions returns the token position of every stored slot,
// [KVHeads][Len].
func (l *Layer) ReadPositions() ([]int32, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.keys == nil {
		return nil, vk.ErrReleased
	}
	out := make([]int32, l.kvHeads*l.n)
	if l.positions == nil {
		for h := 0; h < l.kvHeads; h++ {
			for t := 0; t < l.n; t++ {
				out[h*l.n+t] = int32(t)
			}
		}
		return out, nil
	}
	var errs []error
	for h := 0; h < l.kvHeads; h++ {
		errs = append(errs, l.positions.ReadInt32(uint64(h*l.capacity)*4, out[h*l.n:(h+1)*l.n]))
	}
	return out, errors.Join(errs...)
}
