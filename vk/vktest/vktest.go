// Package vktest opens Vulkan devices for tests: it skips, saying why, when
// no device is present (or fails, when VKSPARSE_REQUIRE_DEVICE is set, as in
// CI), and fails the test on validation errors and on objects not released.
package vktest

import (
	"errors"
	"os"
	"strings"
	"testing"

	"github.com/vksparse/vksparse/vk"
)

// Open returns a device chosen from the environment (VKSPARSE_DEVICE,
// VKSPARSE_VALIDATE) and releases it when the test ends, failing the test if
// the validation layer reported an error or an object was left alive.
func Open(t testing.TB) *vk.Device {
	t.Helper()
	return OpenWith(t, vk.OptionsFromEnv())
}

// OpenWith is Open with the options given instead of the environment's.
func OpenWith(t testing.TB, opts vk.Options) *vk.Device {
	t.Helper()
	dev, err := vk.Open(opts)
	if err != nil {
		if os.Getenv("VKSPARSE_REQUIRE_DEVICE") == "" && (errors.Is(err, vk.ErrNoLoader) || errors.Is(err, vk.ErrNoDevice)) {
			t.Skipf("no Vulkan device to test on (%v); set VK_DRIVER_FILES to a software renderer such as SwiftShader", err)
		}
		t.Fatalf("opening a Vulkan device: %v", err)
	}
	t.Cleanup(func() {
		Check(t, dev)
		if err := dev.Release(); err != nil {
			t.Errorf("%v", err)
		}
	})
	return dev
}

// HostLogic skips t, saying why, where VKSPARSE_HOST_TESTS=off. It marks a
// test whose outcome rests on the library's host-side control (recovery
// from faults, the dense fallback's switching, timing and pricing), not on
// the renderer's arithmetic, so that a run of the tests on several
// renderers (CI's) may take it on one of them only.
func HostLogic(t testing.TB) {
	t.Helper()
	if os.Getenv("VKSPARSE_HOST_TESTS") == "off" {
		t.Skip("host-side logic, the same on every renderer: tested on another renderer's pass (VKSPARSE_HOST_TESTS=off)")
	}
}

// Check fails t if the validation layer has reported errors on dev.
func Check(t testing.TB, dev *vk.Device) {
	t.Helper()
	msgs, errs := dev.ValidationMessages()
	if errs > 0 {
		t.Errorf("validation layer reported %d errors:\n%s", errs, strings.Join(msgs, "\n"))
	}
}
