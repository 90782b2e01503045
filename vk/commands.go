package vk

/*
#include "native.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"time"
	"unsafe"

	vk "github.com/vulkan-go/vulkan"
)

// Commands is a reusable command buffer with its fence. Recording methods
// keep the first error, which End returns. Each Commands has a command
// pool of its own, so that different goroutines may record and submit
// different Commands of one device at once; one Commands must be used by
// one goroutine at a time.
type Commands struct {
	dev   *Device
	pool  vk.CommandPool
	cb    vk.CommandBuffer
	fence vk.Fence
	err   error
}

// NewCommands allocates a command buffer.
func (d *Device) NewCommands() (*Commands, error) {
	if err := d.Lost(); err != nil {
		return nil, err
	}
	var pool vk.CommandPool
	pci := vk.CommandPoolCreateInfo{
		SType:            vk.StructureTypeCommandPoolCreateInfo,
		Flags:            vk.CommandPoolCreateFlags(vk.CommandPoolCreateResetCommandBufferBit),
		QueueFamilyIndex: d.info.queueFamily,
	}
	if err := check("vkCreateCommandPool", vk.CreateCommandPool(d.device, &pci, nil, &pool)); err != nil {
		return nil, err
	}
	cbs := make([]vk.CommandBuffer, 1)
	cbai := vk.CommandBufferAllocateInfo{SType: vk.StructureTypeCommandBufferAllocateInfo, CommandPool: pool, Level: vk.CommandBufferLevelPrimary, CommandBufferCount: 1}
	err := d.call(Allocation, "vkAllocateCommandBuffers")
	if err == nil {
		err = d.result("vkAllocateCommandBuffers", vk.AllocateCommandBuffers(d.device, &cbai, cbs))
	}
	if err != nil {
		vk.DestroyCommandPool(d.device, pool, nil)
		return nil, err
	}
	c := &Commands{dev: d, pool: pool, cb: cbs[0]}
	fci := vk.FenceCreateInfo{SType: vk.StructureTypeFenceCreateInfo}
	var fence vk.Fence
	if err := check("vkCreateFence", vk.CreateFence(d.device, &fci, nil, &fence)); err != nil {
		vk.DestroyCommandPool(d.device, pool, nil) // frees the command buffer too
		return nil, err
	}
	c.fence = fence
	d.track(c, "command buffer")
	return c, nil
}

// Release frees the command buffer, its pool and its fence.
func (c *Commands) Release() error {
	if c == nil || c.cb == nil {
		return ErrReleased
	}
	vk.DestroyFence(c.dev.device, c.fence, nil)
	vk.FreeCommandBuffers(c.dev.device, c.pool, 1, []vk.CommandBuffer{c.cb})
	vk.DestroyCommandPool(c.dev.device, c.pool, nil)
	c.cb, c.pool = nil, nil
	c.dev.untrack(c)
	return nil
}

// Begin starts recording, discarding what was recorded before.
func (c *Commands) Begin() error {
	c.err = nil
	var which *C.char
	if r := vk.Result(C.vks_begin(c.handle(), &which)); r != vk.Success {
		return check(C.GoString(which), r)
	}
	return nil
}

// End finishes recording and returns the first recording error.
func (c *Commands) End() error {
	if err := check("vkEndCommandBuffer", vk.EndCommandBuffer(c.cb)); err != nil {
		return err
	}
	return c.err
}

// Dispatch records a dispatch of groups (x, y, z) with the given push constants.
func (c *Commands) Dispatch(p *Pipeline, b *Binding, push []uint32, x, y, z uint32) {
	if !c.bindKernel(p, b, push) {
		return
	}
	lim := c.dev.info.MaxWorkgroupCount
	if x > lim[0] || y > lim[1] || z > lim[2] {
		c.fail(fmt.Errorf("%w: kernel %s: %d×%d×%d workgroups exceed the device's %v", ErrUnsupported, p.name, x, y, z, lim))
		return
	}
	if x == 0 || y == 0 || z == 0 {
		return
	}
	vk.CmdDispatch(c.cb, x, y, z)
}

// DispatchIndirect records a dispatch whose group counts are three uint32
// read from args at offset when the commands run.
func (c *Commands) DispatchIndirect(p *Pipeline, b *Binding, push []uint32, args *Buffer, offset uint64) {
	if c.bindKernel(p, b, push) {
		vk.CmdDispatchIndirect(c.cb, args.buffer, vk.DeviceSize(offset))
	}
}

func (c *Commands) bindKernel(p *Pipeline, b *Binding, push []uint32) bool {
	if c.err != nil {
		return false
	}
	if len(push) != p.pushWords {
		c.fail(fmt.Errorf("vk: kernel %s takes %d push-constant words, got %d", p.name, p.pushWords, len(push)))
		return false
	}
	if b == nil || b.pipe != p || b.pool == nil {
		c.fail(fmt.Errorf("vk: kernel %s dispatched without its own live binding", p.name))
		return false
	}
	var words *C.uint32_t
	if len(push) > 0 {
		words = (*C.uint32_t)(unsafe.Pointer(&push[0]))
	}
	C.vks_cmd_bind_kernel(c.handle(), C.VkPipeline(unsafe.Pointer(p.pipeline)), C.VkPipelineLayout(unsafe.Pointer(p.layout)),
		C.VkDescriptorSet(unsafe.Pointer(b.set)), words, C.uint32_t(len(push)))
	return true
}

func (c *Commands) fail(err error) {
	if c.err == nil {
		c.err = err
	}
}

// Barrier makes all earlier shader and transfer writes visible to later
// shader, transfer and indirect-argument reads.
func (c *Commands) Barrier() {
	C.vks_cmd_barrier(c.handle(),
		C.uint32_t(vk.PipelineStageComputeShaderBit|vk.PipelineStageTransferBit),
		C.uint32_t(vk.PipelineStageComputeShaderBit|vk.PipelineStageTransferBit|vk.PipelineStageDrawIndirectBit),
		C.uint32_t(vk.AccessShaderWriteBit|vk.AccessTransferWriteBit),
		C.uint32_t(vk.AccessShaderReadBit|vk.AccessShaderWriteBit|vk.AccessTransferReadBit|vk.AccessTransferWriteBit|vk.AccessIndirectCommandReadBit))
}

// ComputeBarrier makes earlier compute-shader writes visible to later
// compute-shader reads and writes, and orders nothing else.
func (c *Commands) ComputeBarrier() {
	C.vks_cmd_barrier(c.handle(), C.uint32_t(vk.PipelineStageComputeShaderBit), C.uint32_t(vk.PipelineStageComputeShaderBit),
		C.uint32_t(vk.AccessShaderWriteBit), C.uint32_t(vk.AccessShaderReadBit|vk.AccessShaderWriteBit))
}

// handle returns the command buffer as the C helpers take it.
func (c *Commands) handle() C.VkCommandBuffer { return C.VkCommandBuffer(unsafe.Pointer(c.cb)) }

// Fill records writing the 32-bit word value over a range (size a multiple of 4).
func (c *Commands) Fill(r Range, value uint32) {
	if r.Size%4 != 0 || r.Offset%4 != 0 || r.Offset+r.Size > r.Buffer.size {
		c.fail(fmt.Errorf("vk: Fill of [%d, +%d) on a buffer of %d bytes: not whole words or out of range", r.Offset, r.Size, r.Buffer.size))
		return
	}
	vk.CmdFillBuffer(c.cb, r.Buffer.buffer, vk.DeviceSize(r.Offset), vk.DeviceSize(r.Size), value)
}

// Update records writing words into r from its offset: small uploads
// carried in the command buffer itself (64 KiB per command), with no
// staging copy or submission of their own.
func (c *Commands) Update(r Range, words []uint32) {
	size := uint64(4 * len(words))
	if r.Offset%4 != 0 || size > r.Size || r.Offset+size > r.Buffer.size {
		c.fail(fmt.Errorf("vk: Update of %d bytes at %d into a range of %d bytes of a buffer of %d", size, r.Offset, r.Size, r.Buffer.size))
		return
	}
	const piece = 65536 / 4
	for done := 0; done < len(words); done += piece {
		n := min(piece, len(words)-done)
		vk.CmdUpdateBuffer(c.cb, r.Buffer.buffer, vk.DeviceSize(r.Offset+uint64(4*done)), vk.DeviceSize(4*n), &words[done])
	}
}

// Copy records a copy of src into dst (same sizes).
func (c *Commands) Copy(src, dst Range) {
	if src.Size != dst.Size || src.Offset+src.Size > src.Buffer.size || dst.Offset+dst.Size > dst.Buffer.size {
		c.fail(fmt.Errorf("vk: Copy of %d bytes into %d bytes, or out of range", src.Size, dst.Size))
		return
	}
	C.vks_cmd_copy(c.handle(), C.VkBuffer(unsafe.Pointer(src.Buffer.buffer)), C.VkBuffer(unsafe.Pointer(dst.Buffer.buffer)),
		C.uint64_t(src.Offset), C.uint64_t(dst.Offset), C.uint64_t(src.Size))
}

// SubmitTimeout bounds how long Submit waits for the GPU.
var SubmitTimeout = 2 * time.Minute

// Submit runs the recorded commands and waits for them to finish.
func (c *Commands) Submit() error {
	// The queue is shared by every goroutine using the device; Vulkan wants
	// its submissions serialized. The wait below needs no lock.
	if err := c.dev.call(Submission, "vkQueueSubmit"); err != nil {
		return err
	}
	c.dev.queueMu.Lock()
	err := c.dev.result("vkQueueSubmit", vk.Result(C.vks_queue_submit(C.VkQueue(unsafe.Pointer(c.dev.queue)), c.handle(), C.VkFence(unsafe.Pointer(c.fence)))))
	c.dev.queueMu.Unlock()
	if err != nil {
		return err
	}
	var which *C.char
	r := C.vks_wait_fence(C.VkDevice(unsafe.Pointer(c.dev.device)), C.VkFence(unsafe.Pointer(c.fence)),
		C.uint64_t(c.dev.spin.Nanoseconds()), C.uint64_t(SubmitTimeout.Nanoseconds()), &which)
	return c.dev.result(C.GoString(which), vk.Result(r))
}

// submitSpin is how long Submit polls its fence on a GPU before it sleeps
// in vkWaitForFences: most submissions (a copy, one step) finish within
// it, and a sleeping wait adds tens of microseconds to each. A software
// renderer does not poll: its work runs on the CPU cores that polling
// would take.
const submitSpin = 200 * time.Microsecond

// once records fn between Begin and End and submits it; an error from fn
// (or from recording) is returned before anything is submitted.
func (c *Commands) once(fn func(*Commands) error) error {
	if err := c.Begin(); err != nil {
		return err
	}
	if err := fn(c); err != nil {
		c.End()
		return err
	}
	if err := c.End(); err != nil {
		return err
	}
	return c.Submit()
}

// Run records fn into a fresh command buffer, submits it and waits.
func (d *Device) Run(fn func(*Commands)) error {
	return d.Do(func(c *Commands) error { fn(c); return nil })
}

// Do records fn into a command buffer, submits it and waits; an error
// from fn (or from recording) is returned before anything is submitted.
// The command buffers are the device's own, kept from one call to the
// next (creating one, with its fence, costs hundreds of microseconds on
// some drivers); one that a call failed with is released, not kept.
func (d *Device) Do(fn func(*Commands) error) error {
	c, err := d.idleCommands()
	if err != nil {
		return err
	}
	if err = c.once(fn); err != nil {
		return errors.Join(err, c.Release())
	}
	d.keepCommands(c)
	return nil
}

// idleCommands returns a command buffer of the device's that no call is
// using, making one when none is idle.
func (d *Device) idleCommands() (*Commands, error) {
	d.idleMu.Lock()
	if n := len(d.idle); n > 0 {
		c := d.idle[n-1]
		d.idle = d.idle[:n-1]
		d.idleMu.Unlock()
		return c, nil
	}
	d.idleMu.Unlock()
	return d.NewCommands()
}

// keepCommands keeps c for a later Do.
func (d *Device) keepCommands(c *Commands) {
	d.idleMu.Lock()
	d.idle = append(d.idle, c)
	d.idleMu.Unlock()
}

// releaseIdle releases the command buffers kept for Do.
func (d *Device) releaseIdle() {
	d.idleMu.Lock()
	defer d.idleMu.Unlock()
	for _, c := range d.idle {
		c.Release()
	}
	d.idle = nil
}

// Timestamps is a pool of timestamp queries.
type Timestamps struct {
	dev  *Device
	pool vk.QueryPool
	n    uint32
}

// NewTimestamps creates a pool of n timestamp queries.
func (d *Device) NewTimestamps(n int) (*Timestamps, error) {
	if d.info.TimestampValidBits == 0 {
		return nil, fmt.Errorf("%w: the compute queue has no timestamps", ErrUnsupported)
	}
	t := &Timestamps{dev: d, n: uint32(n)}
	var pool vk.QueryPool
	qpci := vk.QueryPoolCreateInfo{SType: vk.StructureTypeQueryPoolCreateInfo, QueryType: vk.QueryTypeTimestamp, QueryCount: uint32(n)}
	if err := check("vkCreateQueryPool", vk.CreateQueryPool(d.device, &qpci, nil, &pool)); err != nil {
		return nil, err
	}
	t.pool = pool
	d.track(t, "timestamp pool")
	return t, nil
}

// Len returns the number of queries in the pool.
func (t *Timestamps) Len() int { return int(t.n) }

// Reset records resetting all queries; do it before writing them again.
func (c *Commands) Reset(t *Timestamps) { vk.CmdResetQueryPool(c.cb, t.pool, 0, t.n) }

// Timestamp records writing query i once all earlier commands are done.
func (c *Commands) Timestamp(t *Timestamps, i int) {
	if uint32(i) >= t.n {
		c.fail(fmt.Errorf("vk: timestamp %d of a pool of %d", i, t.n))
		return
	}
	vk.CmdWriteTimestamp(c.cb, vk.PipelineStageBottomOfPipeBit, t.pool, uint32(i))
}

// read returns the raw ticks of queries 0..n-1 of the last submission,
// which must all have been written (reading waits for them).
func (t *Timestamps) read(n int) ([]uint64, error) {
	if n <= 0 || n > int(t.n) {
		return nil, fmt.Errorf("vk: reading %d timestamps of a pool of %d", n, t.n)
	}
	ticks := make([]uint64, n)
	// Submit has waited for the fence, so written queries are available; an
	// unwritten one fails with VK_NOT_READY instead of waiting forever.
	flags := vk.QueryResultFlags(vk.QueryResult64Bit)
	if err := check("vkGetQueryPoolResults", vk.GetQueryPoolResults(t.dev.device, t.pool, 0, uint32(n), uint(8*n), unsafe.Pointer(&ticks[0]), 8, flags)); err != nil {
		return nil, err
	}
	return ticks, nil
}

func (t *Timestamps) between(ticks []uint64, i, j int) time.Duration {
	bits := t.dev.info.TimestampValidBits
	mask := uint64(math.MaxUint64)
	if bits < 64 {
		mask = 1<<bits - 1
	}
	return time.Duration(float64((ticks[j]-ticks[i])&mask) * t.dev.info.TimestampPeriodNs)
}

// Elapsed returns the time between queries i and j of the last submission.
func (t *Timestamps) Elapsed(i, j int) (time.Duration, error) {
	ticks, err := t.read(max(i, j) + 1)
	if err != nil {
		return 0, err
	}
	return t.between(ticks, i, j), nil
}

// Durations returns, for every query 0 < i < n of the last submission, the
// time since query i-1 (element 0 is zero).
func (t *Timestamps) Durations(n int) ([]time.Duration, error) {
	ticks, err := t.read(n)
	if err != nil {
		return nil, err
	}
	out := make([]time.Duration, n)
	for i := 1; i < n; i++ {
		out[i] = t.between(ticks, i-1, i)
	}
	return out, nil
}

// Release destroys the pool.
func (t *Timestamps) Release() error {
	if t == nil || t.pool == nil {
		return ErrReleased
	}
	vk.DestroyQueryPool(t.dev.device, t.pool, nil)
	t.pool = nil
	t.dev.untrack(t)
	return nil
}

// TimeRuns records record warmup+reps times into c, back to back in one
// submission, a timestamp after each run, and returns the timed runs' GPU
// times, sorted. c must not be recording; record orders each run after the
// one before as it needs (a barrier of its own).
func (d *Device) TimeRuns(c *Commands, warmup, reps int, record func(*Commands) error) ([]time.Duration, error) {
	if reps <= 0 || warmup < 0 {
		return nil, fmt.Errorf("vk: timing %d warm-up and %d timed runs: at least one timed run, no negative warm-up", warmup, reps)
	}
	stamps, err := d.NewTimestamps(warmup + reps + 1)
	if err != nil {
		return nil, err
	}
	defer stamps.Release()
	if err := c.Begin(); err != nil {
		return nil, err
	}
	c.Reset(stamps)
	c.Timestamp(stamps, 0)
	for r := 0; r < warmup+reps; r++ {
		if err := record(c); err != nil {
			c.End()
			return nil, err
		}
		c.Timestamp(stamps, r+1)
	}
	if err := c.End(); err != nil {
		return nil, err
	}
	if err := c.Submit(); err != nil {
		return nil, err
	}
	all, err := stamps.Durations(warmup + reps + 1)
	if err != nil {
		return nil, err
	}
	times := slices.Clone(all[1+warmup:])
	slices.Sort(times)
	return times, nil
}
