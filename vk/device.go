// Package vk is a small Vulkan compute runtime: it loads the Vulkan loader,
// chooses a device, and offers buffers, compute pipelines from SPIR-V with
// specialization and push constants, command recording, fences and
// timestamp queries. It knows nothing about what the kernels compute.
//
// Every object has one owner and one Release method; Device.Release reports
// objects still alive. Environment: VKSPARSE_DEVICE picks a device by index
// or name substring; VKSPARSE_VALIDATE=1 turns on the Khronos validation
// layer, whose messages are kept and returned by ValidationMessages.
//
// # Concurrency
//
// A Device is safe for concurrent use by several goroutines: its queue is
// locked around each submission, every Commands has a command pool of its
// own, and every Binding a descriptor pool of its own. So are a Buffer's
// Read and Write (each stages through its own buffer and commands; writes
// to overlapping bytes from two goroutines leave either one's bytes) and a
// Pipeline's Bind. A Commands, a Timestamps pool and the recording into
// them belong to one goroutine at a time. Release of any object must
// follow every use of it, and Device.Release every other call; the GPU's
// own reads and writes are ordered only by the barriers recorded into
// Commands and by Submit, which waits for the work to finish.
//
// # Limits
//
// NewBuffer refuses a buffer larger than the device's largest allocation
// (ErrUnsupported) or than its device-local memory (ErrOutOfMemory)
// before asking the driver; Bind refuses a range larger than the device's
// maxStorageBufferRange (ErrUnsupported). Both name the limit. A driver
// that runs out of memory yields ErrOutOfMemory (test with errors.Is).
package vk

/*
#cgo LDFLAGS: -ldl
#include <stdlib.h>
#include "native.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"
	"unsafe"

	vk "github.com/vulkan-go/vulkan"
)

// Info holds the facts about a device that kernels and reports need.
type Info struct {
	Index         int    // position in the loader's device list
	Name          string // device name
	Type          string // discrete, integrated, virtual, cpu or other
	VendorID      uint32
	DeviceID      uint32
	Vendor        string // vendor name when known, else the hex ID
	Driver        string // driver name and version information
	DriverVersion uint32
	APIVersion    string

	SubgroupSize            uint32
	SubgroupArithmetic      bool // subgroup add/min/max in compute shaders
	SubgroupShuffle         bool // subgroup shuffles in compute shaders
	MaxWorkgroupInvocations uint32
	MaxWorkgroupSize        [3]uint32
	MaxWorkgroupCount       [3]uint32
	SharedMemoryBytes       uint32
	MaxStorageBufferRange   uint64
	MaxAllocation           uint64
	StorageOffsetAlignment  uint64
	MaxPushConstantBytes    uint32
	Storage16Bit            bool // 16-bit storage buffer access
	Float16                 bool // float16 arithmetic in shaders
	Int64                   bool
	// CooperativeMatrixNV: VK_NV_cooperative_matrix (with the Vulkan memory
	// model) multiplies 16×16×16 fp16 matrices into fp32 per subgroup; the
	// device is opened with both enabled.
	CooperativeMatrixNV bool
	// ExecutableStatistics: the driver reports its compiler's statistics
	// per pipeline (VK_KHR_pipeline_executable_properties; Options.Statistics).
	ExecutableStatistics bool
	// IntegerDot: shaders may take dot products of words of four signed
	// bytes (VK_KHR_shader_integer_dot_product; the device is opened with
	// it); IntegerDotFast: the device says they are accelerated.
	IntegerDot, IntegerDotFast bool
	DeviceLocalBytes           uint64
	TimestampPeriodNs          float64 // nanoseconds per timestamp tick
	TimestampValidBits         uint32  // 0: the compute queue has no timestamps
	queueFamily                uint32
}

// Options chooses and configures the device that Open creates.
type Options struct {
	// Select picks a device by index or by case-insensitive name substring;
	// empty picks the best: discrete > integrated > virtual > CPU.
	Select string
	// Validate enables VK_LAYER_KHRONOS_validation.
	Validate bool
	// Statistics keeps the compiler's statistics of every pipeline where
	// the driver reports them (Info.ExecutableStatistics), for
	// Pipeline.Statistics.
	Statistics bool
	// Faults lets tests inject failures (Device.InjectFault) and counts
	// the calls that can fail (Device.Calls).
	Faults bool
}

// OptionsFromEnv reads VKSPARSE_DEVICE, VKSPARSE_VALIDATE and
// VKSPARSE_STATISTICS.
func OptionsFromEnv() Options {
	on := func(name string) bool {
		v := os.Getenv(name)
		return v != "" && v != "0" && v != "false"
	}
	return Options{Select: os.Getenv("VKSPARSE_DEVICE"), Validate: on("VKSPARSE_VALIDATE"), Statistics: on("VKSPARSE_STATISTICS")}
}

var (
	loaderOnce sync.Once
	loaderErr  error
	loaderName string
)

// loadLoader opens the Vulkan loader once per process.
func loadLoader() error {
	loaderOnce.Do(func() {
		var which *C.char
		f := C.vks_load_loader(&which)
		if f == nil {
			loaderErr = ErrNoLoader
			return
		}
		loaderName = C.GoString(which)
		vk.SetGetInstanceProcAddr(f)
		if err := vk.Init(); err != nil {
			loaderErr = fmt.Errorf("vk: initialising %s: %v", loaderName, err)
		}
	})
	return loaderErr
}

const validationLayer = "VK_LAYER_KHRONOS_validation"

func newInstance(validate bool) (vk.Instance, error) {
	if err := loadLoader(); err != nil {
		return nil, err
	}
	info := vk.InstanceCreateInfo{
		SType: vk.StructureTypeInstanceCreateInfo,
		PApplicationInfo: &vk.ApplicationInfo{
			SType:            vk.StructureTypeApplicationInfo,
			PApplicationName: "vksparse\x00",
			PEngineName:      "vksparse\x00",
			ApiVersion:       vk.MakeVersion(1, 1, 0),
		},
	}
	if validate {
		if !haveLayer(validationLayer) {
			return nil, fmt.Errorf("%w: %s requested but not installed (apt-get install vulkan-validationlayers)", ErrUnsupported, validationLayer)
		}
		info.EnabledLayerCount = 1
		info.PpEnabledLayerNames = []string{validationLayer + "\x00"}
		info.EnabledExtensionCount = 1
		info.PpEnabledExtensionNames = []string{"VK_EXT_debug_utils\x00"}
	}
	var inst vk.Instance
	if err := check("vkCreateInstance", vk.CreateInstance(&info, nil, &inst)); err != nil {
		return nil, err
	}
	if err := vk.InitInstance(inst); err != nil {
		vk.DestroyInstance(inst, nil)
		return nil, fmt.Errorf("vk: loading instance functions: %v", err)
	}
	return inst, nil
}

func haveLayer(name string) bool {
	var n uint32
	if vk.EnumerateInstanceLayerProperties(&n, nil) != vk.Success || n == 0 {
		return false
	}
	props := make([]vk.LayerProperties, n)
	if vk.EnumerateInstanceLayerProperties(&n, props) != vk.Success {
		return false
	}
	for _, p := range props[:n] {
		p.Deref()
		if vk.ToString(p.LayerName[:]) == name {
			return true
		}
	}
	return false
}

func physicalDevices(inst vk.Instance) ([]vk.PhysicalDevice, error) {
	var n uint32
	if err := check("vkEnumeratePhysicalDevices", vk.EnumeratePhysicalDevices(inst, &n, nil)); err != nil {
		return nil, err
	}
	pds := make([]vk.PhysicalDevice, n)
	if n > 0 {
		if err := check("vkEnumeratePhysicalDevices", vk.EnumeratePhysicalDevices(inst, &n, pds)); err != nil {
			return nil, err
		}
	}
	return pds[:n], nil
}

var vendors = map[uint32]string{0x10DE: "NVIDIA", 0x1002: "AMD", 0x8086: "Intel", 0x13B5: "ARM", 0x5143: "Qualcomm", 0x1AE0: "Google", 0x10005: "Mesa"}

func describe(inst vk.Instance, pd vk.PhysicalDevice, index int) Info {
	var f C.vks_facts
	C.vks_query(C.VkInstance(unsafe.Pointer(inst)), C.VkPhysicalDevice(unsafe.Pointer(pd)), &f)
	types := map[uint32]string{1: "integrated", 2: "discrete", 3: "virtual", 4: "cpu"}
	info := Info{
		Index:                   index,
		Name:                    C.GoString(&f.name[0]),
		Type:                    "other",
		VendorID:                uint32(f.vendor_id),
		DeviceID:                uint32(f.device_id),
		DriverVersion:           uint32(f.driver_version),
		APIVersion:              fmt.Sprintf("%d.%d.%d", f.api_version>>22, (f.api_version>>12)&0x3ff, f.api_version&0xfff),
		SubgroupSize:            uint32(f.subgroup_size),
		SubgroupArithmetic:      f.subgroup_stages&C.VK_SHADER_STAGE_COMPUTE_BIT != 0 && f.subgroup_ops&C.VK_SUBGROUP_FEATURE_ARITHMETIC_BIT != 0,
		SubgroupShuffle:         f.subgroup_stages&C.VK_SHADER_STAGE_COMPUTE_BIT != 0 && f.subgroup_ops&C.VK_SUBGROUP_FEATURE_SHUFFLE_BIT != 0,
		MaxWorkgroupInvocations: uint32(f.max_wg_invocations),
		SharedMemoryBytes:       uint32(f.max_shared_memory),
		MaxStorageBufferRange:   uint64(f.max_storage_range),
		MaxAllocation:           uint64(f.max_allocation),
		StorageOffsetAlignment:  uint64(f.min_storage_offset_align),
		MaxPushConstantBytes:    uint32(f.max_push_constants),
		Storage16Bit:            f.storage_16bit != 0,
		Float16:                 f.float16 != 0,
		Int64:                   f.int64 != 0,
		CooperativeMatrixNV:     f.coopmat_nv != 0,
		ExecutableStatistics:    f.executable_stats != 0,
		IntegerDot:              f.integer_dot != 0,
		IntegerDotFast:          f.integer_dot_fast != 0,
		DeviceLocalBytes:        uint64(f.device_local_bytes),
		TimestampPeriodNs:       float64(f.timestamp_period),
	}
	for i := 0; i < 3; i++ {
		info.MaxWorkgroupSize[i] = uint32(f.max_wg_size[i])
		info.MaxWorkgroupCount[i] = uint32(f.max_wg_count[i])
	}
	if t, ok := types[uint32(f.device_type)]; ok {
		info.Type = t
	}
	info.Vendor = vendors[info.VendorID]
	if info.Vendor == "" {
		info.Vendor = fmt.Sprintf("0x%04x", info.VendorID)
	}
	info.Driver = strings.TrimSpace(C.GoString(&f.driver_name[0]) + " " + C.GoString(&f.driver_info[0]))
	if info.Driver == "" {
		info.Driver = fmt.Sprintf("version 0x%x", info.DriverVersion)
	}
	if info.MaxAllocation == 0 {
		info.MaxAllocation = 1 << 30
	}
	// The compute queue family: the first with compute, preferring timestamps.
	var n uint32
	vk.GetPhysicalDeviceQueueFamilyProperties(pd, &n, nil)
	fams := make([]vk.QueueFamilyProperties, n)
	vk.GetPhysicalDeviceQueueFamilyProperties(pd, &n, fams)
	best := -1
	for i := range fams {
		fams[i].Deref()
		if vk.QueueFlagBits(fams[i].QueueFlags)&vk.QueueComputeBit == 0 {
			continue
		}
		if best < 0 || (fams[best].TimestampValidBits == 0 && fams[i].TimestampValidBits > 0) {
			best = i
		}
	}
	if best >= 0 {
		info.queueFamily = uint32(best)
		info.TimestampValidBits = fams[best].TimestampValidBits
	} else {
		info.queueFamily = ^uint32(0)
	}
	return info
}

// The process's Vulkan instances, one per validation setting, each created
// by the first call that needs it and kept until the process ends: NVIDIA's
// driver (580, on an H100) refuses vkCreateInstance with
// VK_ERROR_INCOMPATIBLE_DRIVER once about 30 instances have been created
// and destroyed in one process, so devices opened and released again and
// again share one instance (and, under validation, one messenger).
var (
	instanceMu sync.Mutex
	instances  = map[bool]vk.Instance{}
)

// instanceFor returns the process's instance for the validation setting,
// creating it (with its messenger under validation) on first use.
func instanceFor(validate bool) (vk.Instance, error) {
	instanceMu.Lock()
	defer instanceMu.Unlock()
	if inst, ok := instances[validate]; ok {
		return inst, nil
	}
	inst, err := newInstance(validate)
	if err != nil {
		return nil, err
	}
	if validate {
		var m C.VkDebugUtilsMessengerEXT
		if err := check("vkCreateDebugUtilsMessengerEXT", vk.Result(C.vks_messenger_create(C.VkInstance(unsafe.Pointer(inst)), &m))); err != nil {
			vk.DestroyInstance(inst, nil)
			return nil, err
		}
	}
	if C.vks_hot_init(C.VkInstance(unsafe.Pointer(inst))) == 0 {
		return nil, fmt.Errorf("%w: the Vulkan loader lacks a core 1.0 command", ErrUnsupported)
	}
	instances[validate] = inst
	return inst, nil
}

// Devices lists every Vulkan device the loader sees.
func Devices() ([]Info, error) {
	inst, err := instanceFor(false)
	if err != nil {
		return nil, err
	}
	pds, err := physicalDevices(inst)
	if err != nil {
		return nil, err
	}
	infos := make([]Info, len(pds))
	for i, pd := range pds {
		infos[i] = describe(inst, pd, i)
	}
	return infos, nil
}

// choose picks the device named by sel, or the best kind present.
func choose(infos []Info, sel string) (int, error) {
	usable := func(i Info) bool { return i.queueFamily != ^uint32(0) }
	if sel != "" {
		if idx, err := strconv.Atoi(sel); err == nil {
			if idx < 0 || idx >= len(infos) || !usable(infos[idx]) {
				return -1, fmt.Errorf("%w: device index %d not present or without compute (%d devices)", ErrNoDevice, idx, len(infos))
			}
			return idx, nil
		}
		for i, info := range infos {
			if usable(info) && strings.Contains(strings.ToLower(info.Name), strings.ToLower(sel)) {
				return i, nil
			}
		}
		return -1, fmt.Errorf("%w: no device name contains %q", ErrNoDevice, sel)
	}
	rank := map[string]int{"discrete": 0, "integrated": 1, "virtual": 2, "cpu": 3, "other": 4}
	order := make([]int, 0, len(infos))
	for i, info := range infos {
		if usable(info) {
			order = append(order, i)
		}
	}
	if len(order) == 0 {
		return -1, ErrNoDevice
	}
	sort.SliceStable(order, func(a, b int) bool { return rank[infos[order[a]].Type] < rank[infos[order[b]].Type] })
	return order[0], nil
}

// Device is an open logical device with one compute queue.
type Device struct {
	info     Info
	instance vk.Instance
	physical vk.PhysicalDevice
	device   vk.Device
	queue    vk.Queue
	memory   vk.PhysicalDeviceMemoryProperties
	validate bool
	stats    bool   // pipelines keep their compiler statistics
	firstMsg uint64 // messages recorded before this device opened
	firstErr uint64 // errors recorded before this device opened

	mu        sync.Mutex
	live      map[any]string // objects not yet released, with a description
	allocated uint64         // bytes of device memory held by live buffers

	queueMu sync.Mutex // serializes use of queue

	stageMu  sync.Mutex // serializes transfers through stage
	stage    *Buffer    // host-visible staging of Buffer.Read and Write, kept
	stageCmd *Commands  // their command buffer

	blocks blocks // device memory that small buffers share

	spin time.Duration // how long Submit polls its fence

	idleMu sync.Mutex  // serializes idle
	idle   []*Commands // Do's command buffers, kept between calls

	sharedMu sync.Mutex           // serializes SharedPipeline
	shared   map[string]*Pipeline // SharedPipeline's, by kernel

	faults faults // injected failures, and whether the device is lost
}

// Open creates a device as opts say, on the process's instance for
// opts.Validate (created on first use and kept; see instanceFor).
func Open(opts Options) (*Device, error) {
	inst, err := instanceFor(opts.Validate)
	if err != nil {
		return nil, err
	}
	d := &Device{instance: inst, validate: opts.Validate, live: map[any]string{}}
	d.faults.on = opts.Faults
	if opts.Validate {
		d.firstMsg = uint64(C.vks_messages_total())
		d.firstErr = uint64(C.vks_messages_errors())
	}
	pds, err := physicalDevices(inst)
	if err != nil {
		return nil, err
	}
	infos := make([]Info, len(pds))
	for i, pd := range pds {
		infos[i] = describe(inst, pd, i)
	}
	idx, err := choose(infos, opts.Select)
	if err != nil {
		return nil, err
	}
	d.info, d.physical = infos[idx], pds[idx]
	if d.info.Type != "cpu" {
		d.spin = submitSpin
	}
	vk.GetPhysicalDeviceMemoryProperties(d.physical, &d.memory)
	d.memory.Deref()
	for i := range d.memory.MemoryTypes {
		d.memory.MemoryTypes[i].Deref()
	}
	for i := range d.memory.MemoryHeaps {
		d.memory.MemoryHeaps[i].Deref()
	}

	d.stats = opts.Statistics && d.info.ExecutableStatistics
	features := C.vks_features(boolInt(d.info.Storage16Bit), boolInt(d.info.Float16), boolInt(d.info.Int64), boolInt(d.info.CooperativeMatrixNV), boolInt(d.stats), boolInt(d.info.IntegerDot))
	if features == nil {
		return nil, ErrOutOfMemory
	}
	defer C.free(features)
	var dev vk.Device
	ci := vk.DeviceCreateInfo{
		SType:                vk.StructureTypeDeviceCreateInfo,
		PNext:                features,
		QueueCreateInfoCount: 1,
		PQueueCreateInfos: []vk.DeviceQueueCreateInfo{{
			SType:            vk.StructureTypeDeviceQueueCreateInfo,
			QueueFamilyIndex: d.info.queueFamily,
			QueueCount:       1,
			PQueuePriorities: []float32{1},
		}},
	}
	if d.info.CooperativeMatrixNV {
		var n C.uint32_t
		names := unsafe.Slice(C.vks_coopmat_extensions(&n), int(n))
		for _, name := range names {
			ci.PpEnabledExtensionNames = append(ci.PpEnabledExtensionNames, C.GoString(name)+"\x00")
		}
	}
	if d.stats {
		ci.PpEnabledExtensionNames = append(ci.PpEnabledExtensionNames, "VK_KHR_pipeline_executable_properties\x00")
	}
	if d.info.IntegerDot {
		ci.PpEnabledExtensionNames = append(ci.PpEnabledExtensionNames, "VK_KHR_shader_integer_dot_product\x00")
	}
	ci.EnabledExtensionCount = uint32(len(ci.PpEnabledExtensionNames))
	if err := check("vkCreateDevice", vk.CreateDevice(d.physical, &ci, nil, &dev)); err != nil {
		return nil, err
	}
	d.device = dev
	var q vk.Queue
	vk.GetDeviceQueue(dev, d.info.queueFamily, 0, &q)
	d.queue = q
	return d, nil
}

func boolInt(b bool) C.int {
	if b {
		return 1
	}
	return 0
}

// Info returns the device's facts.
func (d *Device) Info() Info { return d.info }

// Identity names the device and its driver (name, vendor and device IDs,
// driver and its version): what measurements of the device are kept by.
func (i Info) Identity() string {
	return fmt.Sprintf("%s|%04x:%04x|%s|%d", i.Name, i.VendorID, i.DeviceID, i.Driver, i.DriverVersion)
}

// Validating reports whether the validation layer is on.
func (d *Device) Validating() bool { return d.validate }

// ValidationMessages returns the validation layer's errors and warnings
// since Open (at most the 64 most recent), and how many of all since Open
// were errors.
func (d *Device) ValidationMessages() (msgs []string, errorCount uint64) {
	if !d.validate {
		return nil, 0
	}
	total := uint64(C.vks_messages_total())
	buf := (*C.char)(C.malloc(4096))
	defer C.free(unsafe.Pointer(buf))
	for i := d.firstMsg; i < total; i++ {
		if C.vks_messages_copy(C.uint64_t(i), buf, 4096) == 1 {
			msgs = append(msgs, C.GoString(buf))
		}
	}
	return msgs, uint64(C.vks_messages_errors()) - d.firstErr
}

func (d *Device) track(obj any, what string) {
	d.mu.Lock()
	d.live[obj] = what
	d.mu.Unlock()
}

func (d *Device) untrack(obj any) {
	d.mu.Lock()
	delete(d.live, obj)
	d.mu.Unlock()
}

// Allocated returns the bytes of device memory that the buffers made on
// the device and not yet released hold: each buffer's allocation, or its
// range of a shared block (Reserved), of the size the driver asks for a
// buffer of its size (which may round it up).
func (d *Device) Allocated() uint64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.allocated
}

// WaitIdle waits until the device has finished all work.
func (d *Device) WaitIdle() error {
	d.queueMu.Lock()
	defer d.queueMu.Unlock()
	if err := d.Lost(); err != nil {
		return err
	}
	return d.result("vkDeviceWaitIdle", vk.DeviceWaitIdle(d.device))
}

// Release destroys the device. While some object made from it is still
// alive it refuses, naming them, and the device stays open (release them,
// then the device); under validation it also reports any error the layer
// raised while the device was torn down.
func (d *Device) Release() error {
	if d.device == nil {
		return ErrReleased
	}
	var errs []error
	if d.Lost() == nil { // a lost device has nothing left to wait for
		if err := d.WaitIdle(); err != nil {
			errs = append(errs, err)
		}
	}
	d.releaseStaging()
	d.releaseIdle()
	d.mu.Lock()
	var leaked []string
	for _, what := range d.live {
		leaked = append(leaked, what)
	}
	d.mu.Unlock()
	sort.Strings(leaked)
	if len(leaked) > 0 {
		// Destroying the device under live objects would leave them
		// pointing at nothing: the next call on one would crash. The
		// device stays open until they are released.
		errs = append(errs, fmt.Errorf("%d objects not released: %s; the device stays open until they are", len(leaked), strings.Join(leaked, ", ")))
		return fmt.Errorf("vk: releasing device: %w", errors.Join(errs...))
	}
	before := uint64(C.vks_messages_errors())
	d.releaseShared()
	d.releaseBlocks()
	vk.DestroyDevice(d.device, nil)
	d.device = nil
	after := uint64(C.vks_messages_errors())
	if after > before {
		msgs, _ := d.ValidationMessages()
		errs = append(errs, fmt.Errorf("validation reported %d errors while releasing the device: %s", after-before, strings.Join(msgs, "\n")))
	}
	if len(errs) > 0 {
		return fmt.Errorf("vk: releasing device: %w", errors.Join(errs...))
	}
	return nil
}
