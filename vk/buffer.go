package vk

import (
	"fmt"
	"unsafe"

	vk "github.com/vulkan-go/vulkan"
)

// Memory says where a buffer lives.
type Memory int

const (
	// DeviceLocal memory is fast for kernels; the host reaches it through staging copies.
	DeviceLocal Memory = iota
	// HostVisible memory is mapped and coherent: the host reads and writes it directly.
	HostVisible
)

// Buffer is a storage buffer bound to its own memory allocation, or, when
// small, to a range of a block it shares with others.
type Buffer struct {
	dev    *Device
	buffer vk.Buffer
	memory vk.DeviceMemory // its own allocation (nil in a shared block)
	block  *block          // the shared block it lies in (nil: its own)
	offset uint64          // its offset in the block
	size   uint64
	held   uint64 // bytes of the allocation, or of its range of the block
	// staging marks the device's own staging buffer, which Allocated
	// does not count.
	staging bool
	kind    Memory
	mapped  unsafe.Pointer
}

// Range is a byte range of a buffer, as bound to a kernel.
type Range struct {
	Buffer *Buffer
	Offset uint64
	Size   uint64
}

// NewBuffer allocates size bytes of the given memory kind. A size beyond
// the device's largest allocation is ErrUnsupported, one beyond the memory
// heap it would come from ErrOutOfMemory, both refused before the driver
// is asked; the driver running out of memory is ErrOutOfMemory too.
func (d *Device) NewBuffer(size uint64, kind Memory) (*Buffer, error) {
	if size == 0 {
		return nil, fmt.Errorf("vk: NewBuffer: zero size")
	}
	if size > d.info.MaxAllocation {
		return nil, fmt.Errorf("%w: buffer of %d bytes exceeds the device's largest allocation (%d bytes)", ErrUnsupported, size, d.info.MaxAllocation)
	}
	if err := d.Lost(); err != nil {
		return nil, err
	}
	usage := vk.BufferUsageStorageBufferBit | vk.BufferUsageTransferSrcBit | vk.BufferUsageTransferDstBit | vk.BufferUsageIndirectBufferBit
	var buf vk.Buffer
	bci := vk.BufferCreateInfo{
		SType:       vk.StructureTypeBufferCreateInfo,
		Size:        vk.DeviceSize(size),
		Usage:       vk.BufferUsageFlags(usage),
		SharingMode: vk.SharingModeExclusive,
	}
	if err := check("vkCreateBuffer", vk.CreateBuffer(d.device, &bci, nil, &buf)); err != nil {
		return nil, err
	}
	var req vk.MemoryRequirements
	vk.GetBufferMemoryRequirements(d.device, buf, &req)
	req.Deref()
	want := vk.MemoryPropertyDeviceLocalBit
	if kind == HostVisible {
		want = vk.MemoryPropertyHostVisibleBit | vk.MemoryPropertyHostCoherentBit
	}
	typ, ok := d.memoryType(req.MemoryTypeBits, vk.MemoryPropertyFlags(want))
	if kind == HostVisible {
		// Cached host memory where there is some: the host reads it back
		// (staging, counters), and uncached reads crawl.
		if cached, found := d.memoryType(req.MemoryTypeBits, vk.MemoryPropertyFlags(want|vk.MemoryPropertyHostCachedBit)); found {
			typ, ok = cached, true
		}
	}
	if !ok && kind == DeviceLocal {
		typ, ok = d.memoryType(req.MemoryTypeBits, 0)
	}
	if !ok {
		vk.DestroyBuffer(d.device, buf, nil)
		return nil, fmt.Errorf("%w: no memory type for a buffer of kind %d", ErrUnsupported, kind)
	}
	if heap := d.memory.MemoryHeaps[d.memory.MemoryTypes[typ].HeapIndex].Size; uint64(req.Size) > uint64(heap) {
		vk.DestroyBuffer(d.device, buf, nil)
		return nil, fmt.Errorf("%w: buffer of %d bytes exceeds the device's memory heap (%d bytes)", ErrOutOfMemory, size, heap)
	}
	err := d.call(Allocation, "vkAllocateMemory")
	var (
		mem    vk.DeviceMemory
		shared *block
		offset uint64
	)
	if err == nil && uint64(req.Size) <= sharedMax {
		shared, offset, err = d.takeShared(typ, uint64(req.Size), max(uint64(req.Alignment), 1))
		if err == nil {
			mem = shared.mem
		}
	} else if err == nil {
		mai := vk.MemoryAllocateInfo{SType: vk.StructureTypeMemoryAllocateInfo, AllocationSize: req.Size, MemoryTypeIndex: typ}
		err = d.result("vkAllocateMemory", vk.AllocateMemory(d.device, &mai, nil, &mem))
	}
	if err != nil {
		vk.DestroyBuffer(d.device, buf, nil)
		return nil, fmt.Errorf("vk: allocating a buffer of %d bytes: %w", size, err)
	}
	free := func() {
		if shared != nil {
			d.giveShared(shared, offset, uint64(req.Size))
		} else {
			vk.FreeMemory(d.device, mem, nil)
		}
	}
	if err := check("vkBindBufferMemory", vk.BindBufferMemory(d.device, buf, mem, vk.DeviceSize(offset))); err != nil {
		free()
		vk.DestroyBuffer(d.device, buf, nil)
		return nil, err
	}
	b := &Buffer{dev: d, buffer: buf, size: size, held: uint64(req.Size), kind: kind, block: shared, offset: offset}
	if shared == nil {
		b.memory = mem
	}
	if kind == HostVisible {
		var p unsafe.Pointer
		err := d.call(Mapping, "vkMapMemory")
		if err == nil && shared != nil {
			p = unsafe.Add(shared.host, offset) // the block is mapped once, whole
		} else if err == nil {
			err = d.result("vkMapMemory", vk.MapMemory(d.device, mem, 0, vk.DeviceSize(size), 0, &p))
		}
		if err != nil {
			free()
			vk.DestroyBuffer(d.device, buf, nil)
			return nil, err
		}
		b.mapped = p
	}
	d.track(b, fmt.Sprintf("buffer(%d bytes)", size))
	d.mu.Lock()
	d.allocated += b.held
	d.mu.Unlock()
	return b, nil
}

func (d *Device) memoryType(bits uint32, want vk.MemoryPropertyFlags) (uint32, bool) {
	for i := uint32(0); i < d.memory.MemoryTypeCount; i++ {
		if bits&(1<<i) != 0 && d.memory.MemoryTypes[i].PropertyFlags&want == want {
			return i, true
		}
	}
	return 0, false
}

// Size returns the buffer's size in bytes.
func (b *Buffer) Size() uint64 { return b.size }

// All returns the range covering the whole buffer.
func (b *Buffer) All() Range { return Range{Buffer: b, Size: b.size} }

// Slice returns the range [offset, offset+size) of the buffer.
func (b *Buffer) Slice(offset, size uint64) Range {
	return Range{Buffer: b, Offset: offset, Size: size}
}

// Release frees the buffer and its memory.
func (b *Buffer) Release() error {
	if b == nil || b.buffer == nil {
		return ErrReleased
	}
	if b.mapped != nil && b.block == nil {
		vk.UnmapMemory(b.dev.device, b.memory)
	}
	b.mapped = nil
	vk.DestroyBuffer(b.dev.device, b.buffer, nil)
	if b.block != nil {
		b.dev.giveShared(b.block, b.offset, b.held)
	} else {
		vk.FreeMemory(b.dev.device, b.memory, nil)
	}
	b.buffer = nil
	b.dev.untrack(b)
	if !b.staging {
		b.dev.mu.Lock()
		b.dev.allocated -= b.held
		b.dev.mu.Unlock()
	}
	return nil
}

const stagingChunk = 64 << 20

// Write copies data into the buffer at offset.
func (b *Buffer) Write(offset uint64, data []byte) error {
	if err := b.inRange("Write", offset, uint64(len(data))); err != nil || len(data) == 0 {
		return err
	}
	if err := b.dev.Lost(); err != nil {
		return err
	}
	if b.kind == HostVisible {
		copy(unsafe.Slice((*byte)(b.mapped), b.size)[offset:], data)
		return nil
	}
	return b.dev.staged(func(stage *Buffer, cmd *Commands) error {
		for done := uint64(0); done < uint64(len(data)); done += stage.size {
			n := min(stage.size, uint64(len(data))-done)
			copy(unsafe.Slice((*byte)(stage.mapped), stage.size), data[done:done+n])
			if err := cmd.once(func(c *Commands) error { c.Copy(stage.Slice(0, n), b.Slice(offset+done, n)); return nil }); err != nil {
				return err
			}
		}
		return nil
	}, uint64(len(data)))
}

// Upload is one copy of host data into a buffer: Data at byte Offset of To.
type Upload struct {
	To     *Buffer
	Offset uint64
	Data   []byte
}

// Upload copies each upload's data into its buffer, the device-local
// ones through the staging buffer in as few submissions as it holds
// (one, for uploads of up to 64 MiB together): a token's keys, values
// and positions cost one round trip, not one each. Every range is checked
// before anything is copied.
func (d *Device) Upload(ups ...Upload) error {
	var staged uint64
	for _, u := range ups {
		if err := u.To.inRange("Write", u.Offset, uint64(len(u.Data))); err != nil {
			return err
		}
		if u.To.dev != d {
			return fmt.Errorf("vk: Device.Upload into a buffer of another device")
		}
		if u.To.kind != HostVisible {
			staged += uint64(len(u.Data))
		}
	}
	if err := d.Lost(); err != nil {
		return err
	}
	if staged > stagingChunk {
		for _, u := range ups { // too big to pack: one buffer at a time
			if err := u.To.Write(u.Offset, u.Data); err != nil {
				return err
			}
		}
		return nil
	}
	for _, u := range ups {
		if u.To.kind == HostVisible {
			copy(unsafe.Slice((*byte)(u.To.mapped), u.To.size)[u.Offset:], u.Data)
		}
	}
	if staged == 0 {
		return nil
	}
	return d.staged(func(stage *Buffer, cmd *Commands) error {
		host := unsafe.Slice((*byte)(stage.mapped), stage.size)
		return cmd.once(func(c *Commands) error {
			at := uint64(0)
			for _, u := range ups {
				n := uint64(len(u.Data))
				if u.To.kind == HostVisible || n == 0 {
					continue
				}
				copy(host[at:], u.Data)
				c.Copy(stage.Slice(at, n), u.To.Slice(u.Offset, n))
				at += n
			}
			return nil
		})
	}, staged)
}

// Read copies len(out) bytes from the buffer at offset into out.
func (b *Buffer) Read(offset uint64, out []byte) error {
	if err := b.inRange("Read", offset, uint64(len(out))); err != nil || len(out) == 0 {
		return err
	}
	if err := b.dev.Lost(); err != nil {
		return err
	}
	if b.kind == HostVisible {
		copy(out, unsafe.Slice((*byte)(b.mapped), b.size)[offset:])
		return nil
	}
	return b.dev.staged(func(stage *Buffer, cmd *Commands) error {
		for done := uint64(0); done < uint64(len(out)); done += stage.size {
			n := min(stage.size, uint64(len(out))-done)
			if err := cmd.once(func(c *Commands) error { c.Copy(b.Slice(offset+done, n), stage.Slice(0, n)); return nil }); err != nil {
				return err
			}
			copy(out[done:done+n], unsafe.Slice((*byte)(stage.mapped), stage.size))
		}
		return nil
	}, uint64(len(out)))
}

func (b *Buffer) inRange(op string, offset, n uint64) error {
	if b == nil || b.buffer == nil {
		return ErrReleased
	}
	if offset+n > b.size || offset+n < offset {
		return fmt.Errorf("vk: Buffer.%s: [%d, %d) outside a buffer of %d bytes", op, offset, offset+n, b.size)
	}
	return nil
}

// staged runs fn with the device's host-visible staging buffer, of at
// least min(n, 64 MiB) bytes, and its command buffer, one call at a time:
// both are kept from one call to the next (allocating host-visible memory
// and a command pool for every transfer costs milliseconds on some
// drivers) and grown as needed; Release frees them.
func (d *Device) staged(fn func(stage *Buffer, cmd *Commands) error, n uint64) error {
	d.stageMu.Lock()
	defer d.stageMu.Unlock()
	if want := min(n, stagingChunk); d.stage == nil || d.stage.size < want {
		if d.stage != nil {
			d.stage.Release()
			d.stage = nil
		}
		// At least 1 MiB, so that small transfers never regrow it.
		stage, err := d.NewBuffer(max(want, 1<<20), HostVisible)
		if err != nil {
			return err
		}
		d.mu.Lock()
		d.allocated -= stage.held
		d.mu.Unlock()
		stage.staging = true
		d.stage = stage
	}
	if d.stageCmd == nil {
		cmd, err := d.NewCommands()
		if err != nil {
			return err
		}
		d.stageCmd = cmd
	}
	return fn(d.stage, d.stageCmd)
}

// releaseStaging frees the staging buffer and its command buffer.
func (d *Device) releaseStaging() {
	d.stageMu.Lock()
	defer d.stageMu.Unlock()
	if d.stage != nil {
		d.stage.Release()
	}
	if d.stageCmd != nil {
		d.stageCmd.Release()
	}
	d.stage, d.stageCmd = nil, nil
}

// bytesOf views a slice of plain values as bytes.
func bytesOf[T uint16 | uint32 | int32 | float32](s []T) []byte {
	if len(s) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&s[0])), len(s)*int(unsafe.Sizeof(s[0])))
}

// WriteFloat32 copies values into the buffer at byte offset.
func (b *Buffer) WriteFloat32(offset uint64, v []float32) error { return b.Write(offset, bytesOf(v)) }

// ReadFloat32 fills out from the buffer at byte offset.
func (b *Buffer) ReadFloat32(offset uint64, out []float32) error { return b.Read(offset, bytesOf(out)) }

// WriteUint16 copies values (fp16 bit patterns, say) into the buffer at byte offset.
func (b *Buffer) WriteUint16(offset uint64, v []uint16) error { return b.Write(offset, bytesOf(v)) }

// ReadUint16 fills out from the buffer at byte offset.
func (b *Buffer) ReadUint16(offset uint64, out []uint16) error { return b.Read(offset, bytesOf(out)) }

// WriteUint32 copies values into the buffer at byte offset.
func (b *Buffer) WriteUint32(offset uint64, v []uint32) error { return b.Write(offset, bytesOf(v)) }

// ReadUint32 fills out from the buffer at byte offset.
func (b *Buffer) ReadUint32(offset uint64, out []uint32) error { return b.Read(offset, bytesOf(out)) }

// WriteInt32 copies values into the buffer at byte offset.
func (b *Buffer) WriteInt32(offset uint64, v []int32) error { return b.Write(offset, bytesOf(v)) }

// ReadInt32 fills out from the buffer at byte offset.
func (b *Buffer) ReadInt32(offset uint64, out []int32) error { return b.Read(offset, bytesOf(out)) }

// Held returns the bytes of device memory the buffers hold (0 for a nil or
// released one).
func Held(bufs ...*Buffer) uint64 {
	var n uint64
	for _, b := range bufs {
		if b != nil && b.buffer != nil {
			n += b.held
		}
	}
	return n
}
