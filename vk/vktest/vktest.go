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

// Check fails t if the validation layer has reported errors on dev.
func Check(t testing.TB, dev *vk.Device) {
	t.Helper()
	msgs, errs := dev.ValidationMessages()
	if errs > 0 {
		t.Errorf("validation layer reported %d errors:\n%s", errs, strings.Join(msgs, "\n"))
	}
}
