package vk_test

import (
	"math/rand"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/vk/vktest"
)

func faultDevice(t *testing.T) *vk.Device {
	opts := vk.OptionsFromEnv()
	opts.Faults = true
	return vktest.OpenWith(t, opts)
}

func TestInjectFaultNeedsTheOption(t *testing.T) {
	dev := vktest.Open(t)
	require.ErrorIs(t, dev.InjectFault(vk.Fault{Site: vk.Allocation, Nth: 1, Err: vk.ErrOutOfMemory}), vk.ErrUnsupported)
	fdev := faultDevice(t)
	require.Error(t, fdev.InjectFault(vk.Fault{Site: vk.Allocation, Nth: 0, Err: vk.ErrOutOfMemory}), "call 0")
	require.Error(t, fdev.InjectFault(vk.Fault{Site: vk.Site(7), Nth: 1, Err: vk.ErrOutOfMemory}), "unknown site")
	require.Error(t, fdev.InjectFault(vk.Fault{Site: vk.Submission, Nth: 1, Err: vk.ErrReleased}), "an error no driver returns")
}

// TestOutOfMemoryFaults makes the Nth call at each site fail with out of
// memory: that call returns ErrOutOfMemory, leaves no object alive, and
// the next call succeeds.
func TestOutOfMemoryFaults(t *testing.T) {
	dev := faultDevice(t)
	data := make([]float32, 777)
	for i := range data {
		data[i] = rand.Float32() - 0.5
	}
	ops := map[vk.Site]func() error{
		// Three buffers: the Nth allocation fails.
		vk.Allocation: func() error {
			var bufs []*vk.Buffer
			defer func() {
				for _, b := range bufs {
					require.NoError(t, b.Release())
				}
			}()
			for range 3 {
				b, err := dev.NewBuffer(4*uint64(len(data)), vk.DeviceLocal)
				if err != nil {
					return err
				}
				bufs = append(bufs, b)
			}
			return nil
		},
		// Two host-visible buffers: each is mapped.
		vk.Mapping: func() error {
			for range 2 {
				b, err := dev.NewBuffer(64, vk.HostVisible)
				if err != nil {
					return err
				}
				require.NoError(t, b.Release())
			}
			return nil
		},
		// A write and a read back through staging: two submissions.
		vk.Submission: func() error {
			b, err := dev.NewBuffer(4*uint64(len(data)), vk.DeviceLocal)
			require.NoError(t, err)
			defer func() { require.NoError(t, b.Release()) }()
			if err := b.WriteFloat32(0, data); err != nil {
				return err
			}
			out := make([]float32, len(data))
			if err := b.ReadFloat32(0, out); err != nil {
				return err
			}
			require.Equal(t, data, out)
			return nil
		},
	}
	for site, op := range ops {
		require.NoError(t, op(), "%v: warm-up", site) // the staging buffer exists from here on
		before, held := dev.Calls(site), dev.Allocated()
		require.NoError(t, op())
		calls := dev.Calls(site) - before
		require.Positive(t, calls, "%v: the op makes no call at its site", site)
		for k := 1; k <= calls; k++ {
			require.NoError(t, dev.InjectFault(vk.Fault{Site: site, Nth: k, Err: vk.ErrOutOfMemory}))
			err := op()
			require.True(t, dev.ClearFault(), "%v call %d: the fault did not fire", site, k)
			require.ErrorIs(t, err, vk.ErrOutOfMemory, "%v call %d", site, k)
			require.Equal(t, held, dev.Allocated(), "%v call %d: memory left allocated", site, k)
			require.NoError(t, dev.Lost())
			require.NoError(t, op(), "%v call %d: the call after out of memory", site, k)
		}
		require.NoError(t, dev.InjectFault(vk.Fault{Site: site, Nth: calls + 1, Err: vk.ErrOutOfMemory}))
		require.NoError(t, op())
		require.False(t, dev.ClearFault(), "%v: a fault past the op's calls fired", site)
	}
}

// TestDeviceLostFault loses the device at a submission: that call and
// every later one return ErrDeviceLost, and everything still releases.
func TestDeviceLostFault(t *testing.T) {
	dev := faultDevice(t)
	b, err := dev.NewBuffer(4096, vk.DeviceLocal)
	require.NoError(t, err)
	host, err := dev.NewBuffer(64, vk.HostVisible)
	require.NoError(t, err)
	require.NoError(t, dev.InjectFault(vk.Fault{Site: vk.Submission, Nth: 1, Err: vk.ErrDeviceLost}))
	require.ErrorIs(t, b.WriteUint32(0, []uint32{1, 2, 3}), vk.ErrDeviceLost)
	require.True(t, dev.ClearFault())
	require.ErrorIs(t, dev.Lost(), vk.ErrDeviceLost)
	require.ErrorIs(t, b.WriteUint32(0, []uint32{1}), vk.ErrDeviceLost, "still lost")
	require.ErrorIs(t, host.WriteUint32(0, []uint32{1}), vk.ErrDeviceLost, "mapped memory too")
	_, err = dev.NewBuffer(64, vk.DeviceLocal)
	require.ErrorIs(t, err, vk.ErrDeviceLost)
	_, err = dev.NewCommands()
	require.ErrorIs(t, err, vk.ErrDeviceLost)
	require.ErrorIs(t, dev.Run(func(*vk.Commands) {}), vk.ErrDeviceLost)
	require.ErrorIs(t, dev.WaitIdle(), vk.ErrDeviceLost)
	require.NoError(t, b.Release())
	require.NoError(t, host.Release())
	// vktest releases the device when the test ends, and fails it if that
	// fails.
}
