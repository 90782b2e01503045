package vk

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	vk "github.com/vulkan-go/vulkan"
)

// Site is a kind of Vulkan call that a test can make fail on purpose
// (Options.Faults, Device.InjectFault).
type Site int

const (
	// Allocation: vkAllocateMemory, vkAllocateDescriptorSets and
	// vkAllocateCommandBuffers, the calls that take memory.
	Allocation Site = iota
	// Submission: vkQueueSubmit.
	Submission
	// Mapping: vkMapMemory.
	Mapping
	sites
)

func (s Site) String() string {
	switch s {
	case Allocation:
		return "allocation"
	case Submission:
		return "submission"
	case Mapping:
		return "mapping"
	}
	return fmt.Sprintf("Site(%d)", int(s))
}

// Fault is a failure to inject: the Nth call at Site from now on (1 is the
// next one) fails with Err, which is ErrOutOfMemory or ErrDeviceLost.
// Out of memory fails that one call; device lost also makes every later
// call of the device fail with ErrDeviceLost, as a lost device does.
type Fault struct {
	Site Site
	Nth  int
	Err  error
}

// faults counts the calls at each site and holds the armed fault.
type faults struct {
	mu     sync.Mutex
	on     bool // Options.Faults
	armed  *Fault
	seen   int         // calls at armed.Site since it was armed
	fired  bool        // the armed fault has fired
	lost   atomic.Bool // the device is lost, really or by injection
	counts [sites]int
}

// InjectFault arms f, replacing any fault armed before. The device must
// have been opened with Options.Faults; it is meant for tests.
func (d *Device) InjectFault(f Fault) error {
	if !d.faults.on {
		return fmt.Errorf("%w: InjectFault needs a device opened with Options.Faults", ErrUnsupported)
	}
	if f.Site < 0 || f.Site >= sites || f.Nth < 1 {
		return fmt.Errorf("vk: InjectFault: site %v, call %d: want a known site and a call ≥ 1", f.Site, f.Nth)
	}
	if !errors.Is(f.Err, ErrOutOfMemory) && !errors.Is(f.Err, ErrDeviceLost) {
		return fmt.Errorf("vk: InjectFault: error %v: want ErrOutOfMemory or ErrDeviceLost", f.Err)
	}
	d.faults.mu.Lock()
	defer d.faults.mu.Unlock()
	d.faults.armed, d.faults.seen, d.faults.fired = &f, 0, false
	return nil
}

// ClearFault disarms the fault armed by InjectFault, and reports whether
// it fired. A lost device stays lost.
func (d *Device) ClearFault() (fired bool) {
	d.faults.mu.Lock()
	defer d.faults.mu.Unlock()
	fired = d.faults.fired
	d.faults.armed, d.faults.seen, d.faults.fired = nil, 0, false
	return fired
}

// Calls returns how many calls at site the device has made since Open
// (counted only under Options.Faults; 0 otherwise).
func (d *Device) Calls(site Site) int {
	d.faults.mu.Lock()
	defer d.faults.mu.Unlock()
	if site < 0 || site >= sites {
		return 0
	}
	return d.faults.counts[site]
}

// Lost returns ErrDeviceLost once the device has been lost (a call
// returned VK_ERROR_DEVICE_LOST, or a fault was injected), nil before.
// Every call that would use the device then fails; Release still works.
func (d *Device) Lost() error {
	if d.faults.lost.Load() {
		return fmt.Errorf("%w: the device was lost earlier; release what it holds and open another", ErrDeviceLost)
	}
	return nil
}

// call is what the device does before a call at site: it fails with the
// armed fault when its turn has come, or because the device is lost.
func (d *Device) call(site Site, name string) error {
	if d.faults.lost.Load() {
		return &Result{Call: name, Code: vk.ErrorDeviceLost}
	}
	if !d.faults.on {
		return nil
	}
	d.faults.mu.Lock()
	defer d.faults.mu.Unlock()
	d.faults.counts[site]++
	f := d.faults.armed
	if f == nil || f.Site != site || d.faults.fired {
		return nil
	}
	if d.faults.seen++; d.faults.seen < f.Nth {
		return nil
	}
	d.faults.fired = true
	code := vk.ErrorOutOfDeviceMemory
	if errors.Is(f.Err, ErrDeviceLost) {
		code = vk.ErrorDeviceLost
		d.faults.lost.Store(true)
	}
	return &Result{Call: name + " (injected)", Code: code}
}

// result turns r into an error naming the call, and marks the device lost
// when r says so.
func (d *Device) result(name string, r vk.Result) error {
	if r == vk.ErrorDeviceLost {
		d.faults.lost.Store(true)
	}
	return check(name, r)
}
