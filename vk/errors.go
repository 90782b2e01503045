package vk

import (
	"errors"
	"fmt"

	vk "github.com/vulkan-go/vulkan"
)

// Sentinel errors; test with errors.Is.
var (
	// ErrNoLoader: the Vulkan loader library could not be opened.
	ErrNoLoader = errors.New("vk: Vulkan loader not found (install libvulkan1, e.g. `apt-get install libvulkan1`)")
	// ErrNoDevice: the loader found no usable Vulkan device.
	ErrNoDevice = errors.New("vk: no Vulkan device found (install a driver: mesa-vulkan-drivers for lavapipe, chromium-common for SwiftShader, or your GPU vendor's driver)")
	// ErrDeviceLost: the device was lost (VK_ERROR_DEVICE_LOST).
	ErrDeviceLost = errors.New("vk: device lost")
	// ErrOutOfMemory: host or device memory ran out.
	ErrOutOfMemory = errors.New("vk: out of memory")
	// ErrUnsupported: the device lacks a feature, extension, layer or limit the request needs.
	ErrUnsupported = errors.New("vk: unsupported")
	// ErrReleased: the object was used after Release.
	ErrReleased = errors.New("vk: object already released")
)

// Result is a failed VkResult, named by the call that returned it.
type Result struct {
	Call string
	Code vk.Result
}

func (r *Result) Error() string { return fmt.Sprintf("vk: %s failed: %s", r.Call, resultName(r.Code)) }

// Unwrap maps the code onto a sentinel error where one applies.
func (r *Result) Unwrap() error {
	switch r.Code {
	case vk.ErrorDeviceLost:
		return ErrDeviceLost
	case vk.ErrorOutOfDeviceMemory, vk.ErrorOutOfHostMemory:
		return ErrOutOfMemory
	case vk.ErrorFeatureNotPresent, vk.ErrorExtensionNotPresent, vk.ErrorLayerNotPresent, vk.ErrorIncompatibleDriver, vk.ErrorFormatNotSupported:
		return ErrUnsupported
	}
	return nil
}

// check turns a VkResult into an error naming the call.
func check(call string, r vk.Result) error {
	if r == vk.Success {
		return nil
	}
	return &Result{Call: call, Code: r}
}

func resultName(r vk.Result) string {
	names := map[vk.Result]string{
		vk.NotReady: "VK_NOT_READY", vk.Timeout: "VK_TIMEOUT", vk.Incomplete: "VK_INCOMPLETE",
		vk.ErrorOutOfHostMemory: "VK_ERROR_OUT_OF_HOST_MEMORY", vk.ErrorOutOfDeviceMemory: "VK_ERROR_OUT_OF_DEVICE_MEMORY",
		vk.ErrorInitializationFailed: "VK_ERROR_INITIALIZATION_FAILED", vk.ErrorDeviceLost: "VK_ERROR_DEVICE_LOST",
		vk.ErrorMemoryMapFailed: "VK_ERROR_MEMORY_MAP_FAILED", vk.ErrorLayerNotPresent: "VK_ERROR_LAYER_NOT_PRESENT",
		vk.ErrorExtensionNotPresent: "VK_ERROR_EXTENSION_NOT_PRESENT", vk.ErrorFeatureNotPresent: "VK_ERROR_FEATURE_NOT_PRESENT",
		vk.ErrorIncompatibleDriver: "VK_ERROR_INCOMPATIBLE_DRIVER", vk.ErrorTooManyObjects: "VK_ERROR_TOO_MANY_OBJECTS",
		vk.ErrorFormatNotSupported: "VK_ERROR_FORMAT_NOT_SUPPORTED", vk.ErrorFragmentedPool: "VK_ERROR_FRAGMENTED_POOL",
		vk.ErrorOutOfPoolMemory: "VK_ERROR_OUT_OF_POOL_MEMORY",
	}
	if n, ok := names[r]; ok {
		return n
	}
	return fmt.Sprintf("VkResult(%d)", int32(r))
}
