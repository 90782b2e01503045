package vk_test

import (
	"errors"
	"fmt"
	"math"
	"math/rand"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/shaders"
	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/vk/vktest"
)

func TestDeviceFacts(t *testing.T) {
	dev := vktest.Open(t)
	info := dev.Info()
	t.Logf("%s (%s, %s), driver %s, subgroup %d, shared %d B, max range %d B", info.Name, info.Type, info.Vendor, info.Driver, info.SubgroupSize, info.SharedMemoryBytes, info.MaxStorageBufferRange)
	require.NotEmpty(t, info.Name)
	require.GreaterOrEqual(t, info.MaxWorkgroupInvocations, uint32(128))
	require.GreaterOrEqual(t, info.SharedMemoryBytes, uint32(16384))
	require.Greater(t, info.SubgroupSize, uint32(0))
	require.GreaterOrEqual(t, info.MaxStorageBufferRange, uint64(1<<27))
	require.Greater(t, info.TimestampPeriodNs, 0.0)

	all, err := vk.Devices()
	require.NoError(t, err)
	require.Greater(t, len(all), info.Index)
	require.Equal(t, info.Name, all[info.Index].Name)
}

func TestBufferRoundTrip(t *testing.T) {
	dev := vktest.Open(t)
	for _, kind := range []vk.Memory{vk.DeviceLocal, vk.HostVisible} {
		buf, err := dev.NewBuffer(4*1001, kind)
		require.NoError(t, err)
		in := make([]float32, 1001)
		for i := range in {
			in[i] = rand.Float32()*2 - 1
		}
		require.NoError(t, buf.WriteFloat32(0, in))
		out := make([]float32, 1001)
		require.NoError(t, buf.ReadFloat32(0, out))
		require.Equal(t, in, out)
		// A partial write at an offset leaves the rest alone.
		require.NoError(t, buf.WriteFloat32(8, []float32{7, 8}))
		require.NoError(t, buf.ReadFloat32(0, out[:4]))
		require.Equal(t, []float32{in[0], in[1], 7, 8}, out[:4])
		require.Error(t, buf.WriteFloat32(4*1000, []float32{1, 2}), "write past the end")
		require.NoError(t, buf.Release())
		require.ErrorIs(t, buf.Release(), vk.ErrReleased)
	}
}

func TestCommandUpdate(t *testing.T) {
	dev := vktest.Open(t)
	buf, err := dev.NewBuffer(4*40000, vk.DeviceLocal)
	require.NoError(t, err)
	defer buf.Release()
	in := make([]uint32, 39990) // more than one 64 KiB piece
	for i := range in {
		in[i] = rand.Uint32()
	}
	require.NoError(t, dev.Run(func(cmd *vk.Commands) {
		cmd.Fill(buf.All(), 7)
		cmd.Barrier()
		cmd.Update(buf.Slice(8, 4*39990), in)
	}))
	out := make([]uint32, 40000)
	require.NoError(t, buf.ReadUint32(0, out))
	require.Equal(t, []uint32{7, 7}, out[:2])
	require.Equal(t, in, out[2:39992])
	require.Equal(t, []uint32{7, 7, 7, 7, 7, 7, 7, 7}, out[39992:])
	require.Error(t, dev.Run(func(cmd *vk.Commands) { cmd.Update(buf.Slice(0, 4), in[:2]) }), "more words than the range holds")
}

func TestOversizedBufferIsUnsupported(t *testing.T) {
	dev := vktest.Open(t)
	_, err := dev.NewBuffer(dev.Info().MaxAllocation+1, vk.DeviceLocal)
	require.ErrorIs(t, err, vk.ErrUnsupported)
	require.ErrorContains(t, err, "largest allocation")
}

// TestDispatchAndTimestamps runs the read probe on two workgroups of 32
// threads over 100 words, which must leave in each thread's word the XOR of
// the words it read, and checks that timestamps tick forward.
func TestDispatchAndTimestamps(t *testing.T) {
	dev := vktest.Open(t)
	code, err := shaders.SPIRV("read_probe")
	require.NoError(t, err)
	const wg, groups, words = 32, 2, 100
	pipe, err := dev.NewPipeline(vk.Kernel{Name: "read_probe", SPIRV: code, Bindings: 2, PushWords: 1, Specialization: []uint32{wg}})
	require.NoError(t, err)
	defer pipe.Release()
	src, _ := dev.NewBuffer(16*words, vk.DeviceLocal)
	out, _ := dev.NewBuffer(4*wg*groups, vk.DeviceLocal)
	for _, b := range []*vk.Buffer{src, out} {
		defer b.Release()
	}
	in := make([]uint32, 4*words)
	for i := range in {
		in[i] = uint32(i)*2654435761 + 12345
	}
	require.NoError(t, src.WriteUint32(0, in))
	bind, err := pipe.Bind(src.All(), out.All())
	require.NoError(t, err)
	defer bind.Release()
	ts, err := dev.NewTimestamps(2)
	require.NoError(t, err)
	defer ts.Release()
	require.NoError(t, dev.Run(func(c *vk.Commands) {
		c.Reset(ts)
		c.Fill(out.All(), math.Float32bits(float32(math.NaN())))
		c.Barrier()
		c.Timestamp(ts, 0)
		c.Dispatch(pipe, bind, []uint32{words}, groups, 1, 1)
		c.Timestamp(ts, 1)
	}))
	got := make([]uint32, wg*groups)
	require.NoError(t, out.ReadUint32(0, got))
	for gid := range got {
		var want uint32
		for i := gid; i < words; i += wg * groups {
			want ^= in[4*i] ^ in[4*i+1] ^ in[4*i+2] ^ in[4*i+3]
		}
		require.Equal(t, want, got[gid], "thread %d", gid)
	}
	el, err := ts.Elapsed(0, 1)
	require.NoError(t, err)
	require.GreaterOrEqual(t, el.Nanoseconds(), int64(0))
	ds, err := ts.Durations(2)
	require.NoError(t, err)
	require.Equal(t, el, ds[1])
	_, err = ts.Durations(3)
	require.Error(t, err, "more queries than the pool holds")

	// Recording errors surface at End, before anything runs.
	err = dev.Run(func(c *vk.Commands) { c.Dispatch(pipe, bind, []uint32{1, 1}, 1, 1, 1) })
	require.ErrorContains(t, err, "push-constant")
	_, err = pipe.Bind(src.All())
	require.Error(t, err)
}

// TestReleaseReportsLeaks checks that releasing a device under a live
// object reports it and keeps the device open until the object goes.
func TestReleaseReportsLeaks(t *testing.T) {
	dev, err := vk.Open(vk.OptionsFromEnv())
	if errors.Is(err, vk.ErrNoDevice) || errors.Is(err, vk.ErrNoLoader) {
		vktest.Open(t) // skips or fails as the environment says
	}
	require.NoError(t, err)
	buf, err := dev.NewBuffer(64, vk.DeviceLocal)
	require.NoError(t, err)
	err = dev.Release()
	require.ErrorContains(t, err, "1 objects not released")
	// The device stays open for the object still alive.
	require.NoError(t, buf.WriteUint32(0, []uint32{7}))
	got := make([]uint32, 1)
	require.NoError(t, buf.ReadUint32(0, got))
	require.Equal(t, uint32(7), got[0])
	require.NoError(t, buf.Release())
	require.NoError(t, dev.Release())
	require.ErrorIs(t, dev.Release(), vk.ErrReleased)
}

// TestOpenReleaseMany opens and releases a device more times than NVIDIA's
// driver allows instances to be created and destroyed in one process
// (about 30), running a fill on each, with validation when the environment
// asks for it.
func TestOpenReleaseMany(t *testing.T) {
	first := vktest.Open(t).Info()
	for i := 0; i < 40; i++ {
		dev, err := vk.Open(vk.OptionsFromEnv())
		require.NoError(t, err, "open %d", i)
		require.Equal(t, first.Name, dev.Info().Name)
		buf, err := dev.NewBuffer(64, vk.DeviceLocal)
		require.NoError(t, err)
		require.NoError(t, dev.Run(func(c *vk.Commands) { c.Fill(buf.All(), uint32(i)) }))
		got := make([]uint32, 16)
		require.NoError(t, buf.ReadUint32(0, got))
		require.Equal(t, uint32(i), got[15], "open %d", i)
		require.NoError(t, buf.Release())
		vktest.Check(t, dev)
		require.NoError(t, dev.Release(), "release %d", i)
	}
}

func TestBadSelection(t *testing.T) {
	_, err := vk.Open(vk.Options{Select: "no device has this name"})
	if errors.Is(err, vk.ErrNoLoader) {
		t.Skip("no Vulkan loader")
	}
	require.ErrorIs(t, err, vk.ErrNoDevice)
}

// TestConcurrentUse has goroutines write, fill and read their own buffers
// of one device at once (the validation layer, when on, checks that the
// shared queue and the pools are used as Vulkan requires).
func TestConcurrentUse(t *testing.T) {
	dev := vktest.Open(t)
	const workers, rounds, words = 6, 10, 3000
	errs := make(chan error, workers)
	for w := 0; w < workers; w++ {
		go func(w int) {
			errs <- func() error {
				buf, err := dev.NewBuffer(4*words, vk.DeviceLocal)
				if err != nil {
					return err
				}
				defer buf.Release()
				rng := rand.New(rand.NewSource(int64(w)))
				in := make([]uint32, words)
				out := make([]uint32, words)
				for r := 0; r < rounds; r++ {
					for i := range in {
						in[i] = rng.Uint32()
					}
					if err := buf.WriteUint32(0, in); err != nil {
						return err
					}
					if err := buf.ReadUint32(0, out); err != nil {
						return err
					}
					if !slices.Equal(in, out) {
						return fmt.Errorf("worker %d round %d read back other data", w, r)
					}
					fill := uint32(w*1000 + r)
					if err := dev.Run(func(c *vk.Commands) { c.Fill(buf.All(), fill) }); err != nil {
						return err
					}
					if err := buf.ReadUint32(0, out[:1]); err != nil {
						return err
					}
					if out[0] != fill {
						return fmt.Errorf("worker %d round %d: fill %d read back as %d", w, r, fill, out[0])
					}
				}
				return nil
			}()
		}(w)
	}
	for w := 0; w < workers; w++ {
		require.NoError(t, <-errs)
	}
	require.NoError(t, dev.WaitIdle())
}

// TestOversizedBufferIsOutOfMemory asks for more than the device-local
// memory holds, where that is below the largest allocation.
func TestOversizedBufferIsOutOfMemory(t *testing.T) {
	dev := vktest.Open(t)
	info := dev.Info()
	if info.DeviceLocalBytes == 0 || info.DeviceLocalBytes >= info.MaxAllocation {
		t.Skipf("device-local memory (%d bytes) is not below the largest allocation (%d bytes)", info.DeviceLocalBytes, info.MaxAllocation)
	}
	_, err := dev.NewBuffer(info.DeviceLocalBytes+1, vk.DeviceLocal)
	require.ErrorIs(t, err, vk.ErrOutOfMemory)
}

// TestPipelineStatistics asks a pipeline for its compiler statistics: on a
// device opened without Options.Statistics, or whose driver reports none,
// the answer is ErrUnsupported; with them, every statistic has a name and
// a value, and the list is not empty.
func TestPipelineStatistics(t *testing.T) {
	code, err := shaders.SPIRV("read_probe")
	require.NoError(t, err)
	for _, want := range []bool{false, true} {
		t.Run(fmt.Sprintf("statistics=%v", want), func(t *testing.T) {
			opts := vk.OptionsFromEnv()
			opts.Statistics = want
			dev := vktest.OpenWith(t, opts)
			pipe, err := dev.NewPipeline(vk.Kernel{Name: "read_probe", SPIRV: code, Bindings: 2, PushWords: 1, Specialization: []uint32{32}})
			require.NoError(t, err)
			defer pipe.Release()
			stats, err := pipe.Statistics()
			if !want || !dev.Info().ExecutableStatistics {
				require.ErrorIs(t, err, vk.ErrUnsupported)
				t.Logf("%s: no statistics (driver reports them: %v)", dev.Info().Name, dev.Info().ExecutableStatistics)
				return
			}
			require.NoError(t, err)
			require.NotEmpty(t, stats)
			for _, s := range stats {
				require.NotEmpty(t, s.Name)
				require.NotEmpty(t, s.Value, "statistic %q", s.Name)
			}
			t.Logf("%s: %v", dev.Info().Name, stats)
		})
	}
}

// TestAllocatedCountsLiveBuffers checks that Allocated grows by at least
// each buffer's size while it lives and falls back once it is released.
func TestAllocatedCountsLiveBuffers(t *testing.T) {
	dev := vktest.Open(t)
	before := dev.Allocated()
	a, err := dev.NewBuffer(1<<20, vk.DeviceLocal)
	require.NoError(t, err)
	b, err := dev.NewBuffer(4099, vk.HostVisible)
	require.NoError(t, err)
	require.GreaterOrEqual(t, dev.Allocated(), before+1<<20+4099)
	require.NoError(t, a.Release())
	require.GreaterOrEqual(t, dev.Allocated(), before+4099)
	require.Less(t, dev.Allocated(), before+1<<20)
	require.NoError(t, b.Release())
	require.Equal(t, before, dev.Allocated())
}

// TestTimeRuns times runs of a fill that grows with the run, and checks
// that every timed run is reported, sorted, that the runs ran (the buffer
// holds the last run's word) and that bad counts and a failing run are
// refused.
func TestTimeRuns(t *testing.T) {
	dev := vktest.Open(t)
	buf, err := dev.NewBuffer(1<<20, vk.DeviceLocal)
	require.NoError(t, err)
	defer buf.Release()
	c, err := dev.NewCommands()
	require.NoError(t, err)
	defer c.Release()
	runs := 0
	times, err := dev.TimeRuns(c, 2, 5, func(c *vk.Commands) error {
		runs++
		c.Barrier()
		c.Fill(buf.All(), uint32(runs))
		return nil
	})
	require.NoError(t, err)
	require.Equal(t, 7, runs, "warm-up and timed runs recorded")
	require.Len(t, times, 5)
	require.True(t, slices.IsSorted(times))
	word := make([]uint32, 1)
	require.NoError(t, buf.ReadUint32(1<<20-4, word))
	require.Equal(t, uint32(7), word[0], "the last run's fill")
	_, err = dev.TimeRuns(c, 0, 0, func(*vk.Commands) error { return nil })
	require.Error(t, err)
	_, err = dev.TimeRuns(c, -1, 3, func(*vk.Commands) error { return nil })
	require.Error(t, err)
	_, err = dev.TimeRuns(c, 0, 3, func(*vk.Commands) error { return fmt.Errorf("broken") })
	require.ErrorContains(t, err, "broken")
	_, err = dev.TimeRuns(c, 0, 1, func(*vk.Commands) error { return nil })
	require.NoError(t, err, "the command buffer is usable after a failed run")
}
