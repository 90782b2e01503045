package vk

import (
	"testing"

	"github.com/stretchr/testify/require"
	vk "github.com/vulkan-go/vulkan"
)

// TestValidationCatchesMisuse records an invalid fill directly (bypassing
// the checks of Commands.Fill) and expects the layer to report it.
func TestValidationCatchesMisuse(t *testing.T) {
	opts := OptionsFromEnv()
	if !opts.Validate {
		t.Skip("VKSPARSE_VALIDATE is not set: the validation layer is off")
	}
	dev, err := Open(opts)
	if err != nil {
		t.Skipf("no device: %v", err)
	}
	buf, err := dev.NewBuffer(64, DeviceLocal)
	require.NoError(t, err)
	_, before := dev.ValidationMessages()
	require.NoError(t, dev.Run(func(c *Commands) {
		vk.CmdFillBuffer(c.cb, buf.buffer, 2, 6, 0) // offset and size must be multiples of 4
	}))
	msgs, after := dev.ValidationMessages()
	require.Greater(t, after, before, "the layer should have reported the misaligned fill")
	require.NotEmpty(t, msgs)
	require.NoError(t, buf.Release())
	require.NoError(t, dev.Release())
}
