package vk

import (
	"fmt"
	"slices"
	"sort"
	"sync"
	"unsafe"

	vk "github.com/vulkan-go/vulkan"
)

// sharedMax is the largest buffer that takes its memory from a block
// shared with others rather than from an allocation of its own: allocating
// and freeing device memory (and mapping it, for host-visible memory) costs
// hundreds of microseconds to milliseconds on some drivers, and steps,
// plans and indexes make many small buffers.
const sharedMax = 1 << 20

// blockBytes is the size of each shared block.
const blockBytes = 16 << 20

// block is one device-memory allocation that small buffers share.
type block struct {
	mem  vk.DeviceMemory
	typ  uint32         // memory type index
	host unsafe.Pointer // the whole block mapped, for a host-visible type
	free []span         // free ranges, by offset, never adjacent
	used uint64         // bytes handed out
}

// span is a byte range of a block.
type span struct{ off, size uint64 }

// take returns the offset of size bytes aligned to align, first fit.
func (b *block) take(size, align uint64) (uint64, bool) {
	for i, s := range b.free {
		off := (s.off + align - 1) / align * align
		end := s.off + s.size
		if off+size > end {
			continue
		}
		var rest []span
		if off > s.off {
			rest = append(rest, span{s.off, off - s.off})
		}
		if off+size < end {
			rest = append(rest, span{off + size, end - off - size})
		}
		b.free = slices.Replace(b.free, i, i+1, rest...)
		b.used += size
		return off, true
	}
	return 0, false
}

// give returns [off, off+size) to the free ranges, joining neighbours.
func (b *block) give(off, size uint64) {
	i := sort.Search(len(b.free), func(i int) bool { return b.free[i].off > off })
	b.free = slices.Insert(b.free, i, span{off, size})
	if i+1 < len(b.free) && b.free[i].off+b.free[i].size == b.free[i+1].off {
		b.free[i].size += b.free[i+1].size
		b.free = slices.Delete(b.free, i+1, i+2)
	}
	if i > 0 && b.free[i-1].off+b.free[i-1].size == b.free[i].off {
		b.free[i-1].size += b.free[i].size
		b.free = slices.Delete(b.free, i, i+1)
	}
	b.used -= size
}

// blocks are a device's shared blocks.
type blocks struct {
	mu  sync.Mutex
	all []*block
}

// takeShared finds size bytes aligned to align in a block of memory type
// typ, allocating a new block when none has room.
func (d *Device) takeShared(typ uint32, size, align uint64) (*block, uint64, error) {
	p := &d.blocks
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, b := range p.all {
		if b.typ != typ {
			continue
		}
		if off, ok := b.take(size, align); ok {
			return b, off, nil
		}
	}
	var mem vk.DeviceMemory
	mai := vk.MemoryAllocateInfo{SType: vk.StructureTypeMemoryAllocateInfo, AllocationSize: blockBytes, MemoryTypeIndex: typ}
	if err := d.result("vkAllocateMemory", vk.AllocateMemory(d.device, &mai, nil, &mem)); err != nil {
		return nil, 0, fmt.Errorf("a shared block of %d bytes: %w", blockBytes, err)
	}
	b := &block{mem: mem, typ: typ, free: []span{{0, blockBytes}}}
	if d.memory.MemoryTypes[typ].PropertyFlags&vk.MemoryPropertyFlags(vk.MemoryPropertyHostVisibleBit) != 0 {
		var host unsafe.Pointer
		if err := d.result("vkMapMemory", vk.MapMemory(d.device, mem, 0, blockBytes, 0, &host)); err != nil {
			vk.FreeMemory(d.device, mem, nil)
			return nil, 0, fmt.Errorf("mapping a shared block: %w", err)
		}
		b.host = host
	}
	p.all = append(p.all, b)
	off, _ := b.take(size, align)
	return b, off, nil
}

// giveShared returns a buffer's bytes to its block; a block left empty is
// freed unless it is the only empty one of its memory type (kept for the
// next buffers, so that a buffer made and released in a loop does not
// allocate device memory each time).
func (d *Device) giveShared(b *block, off, size uint64) {
	p := &d.blocks
	p.mu.Lock()
	defer p.mu.Unlock()
	b.give(off, size)
	if b.used != 0 {
		return
	}
	for _, o := range p.all {
		if o != b && o.typ == b.typ && o.used == 0 {
			vk.FreeMemory(d.device, b.mem, nil)
			p.all = slices.DeleteFunc(p.all, func(x *block) bool { return x == b })
			return
		}
	}
}

// releaseBlocks frees every shared block (their buffers are released).
func (d *Device) releaseBlocks() {
	p := &d.blocks
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, b := range p.all {
		vk.FreeMemory(d.device, b.mem, nil)
	}
	p.all = nil
}

// Reserved returns the bytes of device memory the device holds in the
// blocks that small buffers share, whether buffers hold them or not
// (Allocated counts only what the buffers hold).
func (d *Device) Reserved() uint64 {
	p := &d.blocks
	p.mu.Lock()
	defer p.mu.Unlock()
	return uint64(len(p.all)) * blockBytes
}
