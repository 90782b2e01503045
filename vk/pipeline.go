package vk

/*
#include <stdlib.h>
#include "native.h"
*/
import "C"

import (
	"fmt"
	"hash/crc32"
	"runtime"
	"strings"
	"unsafe"

	vk "github.com/vulkan-go/vulkan"
)

// Kernel describes a compute pipeline: SPIR-V with entry point "main",
// Bindings storage buffers at set 0, bindings 0..Bindings-1, PushWords
// 32-bit push constants, and specialization constants: Specialization[i]
// is the value of constant_id i (floats as their bits).
type Kernel struct {
	Name           string
	SPIRV          []byte
	Bindings       int
	PushWords      int
	Specialization []uint32
}

// Pipeline is a compiled compute kernel.
type Pipeline struct {
	dev       *Device
	name      string
	module    vk.ShaderModule
	setLayout vk.DescriptorSetLayout
	layout    vk.PipelineLayout
	pipeline  vk.Pipeline
	bindings  int
	pushWords int
	shared    bool // the device's own (SharedPipeline): Release leaves it
}

// NewPipeline compiles a kernel for the device.
func (d *Device) NewPipeline(k Kernel) (*Pipeline, error) {
	if err := d.Lost(); err != nil {
		return nil, err
	}
	if len(k.SPIRV) == 0 || len(k.SPIRV)%4 != 0 {
		return nil, fmt.Errorf("vk: kernel %s: SPIR-V of %d bytes is not a whole number of words", k.Name, len(k.SPIRV))
	}
	if uint32(4*k.PushWords) > d.info.MaxPushConstantBytes {
		return nil, fmt.Errorf("%w: kernel %s needs %d push-constant bytes, device allows %d", ErrUnsupported, k.Name, 4*k.PushWords, d.info.MaxPushConstantBytes)
	}
	p := &Pipeline{dev: d, name: k.Name, bindings: k.Bindings, pushWords: k.PushWords}
	fail := func(err error) (*Pipeline, error) {
		p.destroy()
		return nil, fmt.Errorf("kernel %s: %w", k.Name, err)
	}
	var (
		module    vk.ShaderModule
		setLayout vk.DescriptorSetLayout
		layout    vk.PipelineLayout
	)
	code := make([]uint32, len(k.SPIRV)/4)
	copy(bytesOf(code), k.SPIRV)
	smci := vk.ShaderModuleCreateInfo{SType: vk.StructureTypeShaderModuleCreateInfo, CodeSize: uint(len(k.SPIRV)), PCode: code}
	err := check("vkCreateShaderModule", vk.CreateShaderModule(d.device, &smci, nil, &module))
	runtime.KeepAlive(code) // the binding hands the driver a pointer into it
	if err != nil {
		return fail(err)
	}
	p.module = module
	binds := make([]vk.DescriptorSetLayoutBinding, k.Bindings)
	for i := range binds {
		binds[i] = vk.DescriptorSetLayoutBinding{
			Binding:         uint32(i),
			DescriptorType:  vk.DescriptorTypeStorageBuffer,
			DescriptorCount: 1,
			StageFlags:      vk.ShaderStageFlags(vk.ShaderStageComputeBit),
		}
	}
	dslci := vk.DescriptorSetLayoutCreateInfo{SType: vk.StructureTypeDescriptorSetLayoutCreateInfo, BindingCount: uint32(len(binds)), PBindings: binds}
	if err := check("vkCreateDescriptorSetLayout", vk.CreateDescriptorSetLayout(d.device, &dslci, nil, &setLayout)); err != nil {
		return fail(err)
	}
	p.setLayout = setLayout
	plci := vk.PipelineLayoutCreateInfo{SType: vk.StructureTypePipelineLayoutCreateInfo, SetLayoutCount: 1, PSetLayouts: []vk.DescriptorSetLayout{p.setLayout}}
	if k.PushWords > 0 {
		plci.PushConstantRangeCount = 1
		plci.PPushConstantRanges = []vk.PushConstantRange{{StageFlags: vk.ShaderStageFlags(vk.ShaderStageComputeBit), Size: uint32(4 * k.PushWords)}}
	}
	if err := check("vkCreatePipelineLayout", vk.CreatePipelineLayout(d.device, &plci, nil, &layout)); err != nil {
		return fail(err)
	}
	p.layout = layout
	// The constants live in C memory for the whole call.
	n := len(k.Specialization)
	spec := (*C.uint32_t)(C.malloc(C.size_t(4 * max(n, 1))))
	defer C.free(unsafe.Pointer(spec))
	copy(unsafe.Slice((*uint32)(unsafe.Pointer(spec)), n), k.Specialization)
	var pipe C.VkPipeline
	r := C.vks_create_compute_pipeline(C.VkInstance(unsafe.Pointer(d.instance)), C.VkDevice(unsafe.Pointer(d.device)),
		C.VkShaderModule(unsafe.Pointer(p.module)), C.VkPipelineLayout(unsafe.Pointer(p.layout)), spec, C.uint32_t(n), boolInt(d.stats), &pipe)
	if err := check("vkCreateComputePipelines", vk.Result(r)); err != nil {
		return fail(err)
	}
	p.pipeline = vk.Pipeline(unsafe.Pointer(pipe))
	d.track(p, "pipeline "+k.Name)
	return p, nil
}

func (p *Pipeline) destroy() {
	dev := p.dev.device
	if p.pipeline != nil {
		vk.DestroyPipeline(dev, p.pipeline, nil)
	}
	if p.layout != nil {
		vk.DestroyPipelineLayout(dev, p.layout, nil)
	}
	if p.setLayout != nil {
		vk.DestroyDescriptorSetLayout(dev, p.setLayout, nil)
	}
	if p.module != nil {
		vk.DestroyShaderModule(dev, p.module, nil)
	}
	p.pipeline, p.layout, p.setLayout, p.module = nil, nil, nil, nil
}

// Statistic is one figure a driver's compiler reports for a pipeline (its
// name as the driver gives it, "Register Count" say, and its value).
type Statistic struct {
	Name, Value string
}

// Statistics returns the compiler's statistics of the pipeline, on a
// device opened with Options.Statistics where the driver reports them
// (Info.ExecutableStatistics); ErrUnsupported elsewhere.
func (p *Pipeline) Statistics() ([]Statistic, error) {
	if p == nil || p.pipeline == nil {
		return nil, ErrReleased
	}
	d := p.dev
	if !d.stats {
		return nil, fmt.Errorf("%w: pipeline statistics (open the device with Options.Statistics on a driver with VK_KHR_pipeline_executable_properties)", ErrUnsupported)
	}
	const size = 1 << 14
	buf := (*C.char)(C.malloc(size))
	defer C.free(unsafe.Pointer(buf))
	r := C.vks_pipeline_statistics(C.VkInstance(unsafe.Pointer(d.instance)), C.VkDevice(unsafe.Pointer(d.device)), C.VkPipeline(unsafe.Pointer(p.pipeline)), buf, size)
	if err := check("vkGetPipelineExecutableStatisticsKHR", vk.Result(r)); err != nil {
		return nil, err
	}
	var out []Statistic
	for _, line := range strings.Split(C.GoString(buf), "\n") {
		if name, value, ok := strings.Cut(line, "\t"); ok {
			out = append(out, Statistic{Name: name, Value: value})
		}
	}
	return out, nil
}

// SharedPipeline returns the device's own compiled copy of k, compiling
// it on the first call for k's code, bindings, push words and
// specialization, and the same pipeline on every later one: kernels that
// callers would otherwise compile again for each short-lived use (a
// reorder, a one-off dispatch). The device owns it and destroys it when it
// is released; Release on it does nothing and returns nil.
func (d *Device) SharedPipeline(k Kernel) (*Pipeline, error) {
	key := fmt.Sprint(k.Name, len(k.SPIRV), crc32.ChecksumIEEE(k.SPIRV), k.Bindings, k.PushWords, k.Specialization)
	d.sharedMu.Lock()
	defer d.sharedMu.Unlock()
	if p, ok := d.shared[key]; ok {
		return p, d.Lost()
	}
	p, err := d.NewPipeline(k)
	if err != nil {
		return nil, err
	}
	d.untrack(p) // the device's own: no caller leaks it
	p.shared = true
	if d.shared == nil {
		d.shared = map[string]*Pipeline{}
	}
	d.shared[key] = p
	return p, nil
}

// releaseShared destroys the pipelines SharedPipeline made.
func (d *Device) releaseShared() {
	d.sharedMu.Lock()
	defer d.sharedMu.Unlock()
	for _, p := range d.shared {
		p.destroy()
	}
	d.shared = nil
}

// Release destroys the pipeline (a shared one stays: see SharedPipeline).
func (p *Pipeline) Release() error {
	if p == nil || p.pipeline == nil {
		return ErrReleased
	}
	if p.shared {
		return nil
	}
	p.destroy()
	p.dev.untrack(p)
	return nil
}

// Binding is a descriptor set: the buffer ranges a pipeline's bindings see.
type Binding struct {
	pipe *Pipeline
	pool vk.DescriptorPool
	set  vk.DescriptorSet
}

// Bind makes a descriptor set for the pipeline with ranges[i] at binding i.
// A range of size 0 means the rest of its buffer from its offset.
func (p *Pipeline) Bind(ranges ...Range) (*Binding, error) {
	d := p.dev
	if err := d.Lost(); err != nil {
		return nil, err
	}
	if len(ranges) != p.bindings {
		return nil, fmt.Errorf("vk: kernel %s has %d bindings, got %d ranges", p.name, p.bindings, len(ranges))
	}
	n := len(ranges)
	bufs := make([]C.VkBuffer, max(n, 1))
	offsets := make([]C.uint64_t, max(n, 1))
	sizes := make([]C.uint64_t, max(n, 1))
	for i, r := range ranges {
		if r.Buffer == nil || r.Buffer.buffer == nil {
			return nil, fmt.Errorf("vk: kernel %s binding %d: no buffer", p.name, i)
		}
		size := r.Size
		if size == 0 {
			size = r.Buffer.size - r.Offset
		}
		switch {
		case r.Offset+size > r.Buffer.size:
			return nil, fmt.Errorf("vk: kernel %s binding %d: range [%d, %d) outside a buffer of %d bytes", p.name, i, r.Offset, r.Offset+size, r.Buffer.size)
		case size > d.info.MaxStorageBufferRange:
			return nil, fmt.Errorf("%w: kernel %s binding %d: range of %d bytes exceeds maxStorageBufferRange %d", ErrUnsupported, p.name, i, size, d.info.MaxStorageBufferRange)
		case r.Offset%d.info.StorageOffsetAlignment != 0:
			return nil, fmt.Errorf("vk: kernel %s binding %d: offset %d not a multiple of %d", p.name, i, r.Offset, d.info.StorageOffsetAlignment)
		}
		bufs[i] = C.VkBuffer(unsafe.Pointer(r.Buffer.buffer))
		offsets[i], sizes[i] = C.uint64_t(r.Offset), C.uint64_t(size)
	}
	if err := d.call(Allocation, "vkAllocateDescriptorSets"); err != nil {
		return nil, err
	}
	var (
		pool C.VkDescriptorPool
		set  C.VkDescriptorSet
	)
	r := C.vks_make_buffer_set(C.VkDevice(unsafe.Pointer(d.device)), C.VkDescriptorSetLayout(unsafe.Pointer(p.setLayout)),
		C.uint32_t(n), &bufs[0], &offsets[0], &sizes[0], &pool, &set)
	if err := d.result("vkAllocateDescriptorSets", vk.Result(r)); err != nil {
		return nil, err
	}
	b := &Binding{pipe: p, pool: vk.DescriptorPool(unsafe.Pointer(pool)), set: vk.DescriptorSet(unsafe.Pointer(set))}
	d.track(b, "binding of "+p.name)
	return b, nil
}

// Release destroys the descriptor set.
func (b *Binding) Release() error {
	if b == nil || b.pool == nil {
		return ErrReleased
	}
	vk.DestroyDescriptorPool(b.pipe.dev.device, b.pool, nil)
	b.pool = nil
	b.pipe.dev.untrack(b)
	return nil
}
