package vk_test

import (
	"math/rand"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/shaders"
	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/vk/vktest"
)

// TestSharedBlocks makes small buffers of odd sizes (which share blocks of
// device memory) beside a large one (its own allocation), writes each a
// pattern of its own, and reads every one back: no buffer's data lands in
// another's. Releasing half and making more keeps the others' data, and
// Allocated counts exactly the live buffers' bytes throughout.
func TestSharedBlocks(t *testing.T) {
	dev := vktest.Open(t)
	rng := rand.New(rand.NewSource(3))
	base := dev.Allocated()
	type live struct {
		buf  *vk.Buffer
		data []uint32
	}
	var bufs []live
	make1 := func(words int) {
		b, err := dev.NewBuffer(uint64(words)*4, vk.DeviceLocal)
		require.NoError(t, err)
		data := make([]uint32, words)
		for i := range data {
			data[i] = rng.Uint32()
		}
		require.NoError(t, b.WriteUint32(0, data))
		bufs = append(bufs, live{b, data})
	}
	checkAll := func() {
		t.Helper()
		var held uint64
		for i, l := range bufs {
			got := make([]uint32, len(l.data))
			for j := range got {
				got[j] = 0xdeadbeef
			}
			require.NoError(t, l.buf.ReadUint32(0, got))
			require.Equal(t, l.data, got, "buffer %d of %d words", i, len(l.data))
			held += vk.Held(l.buf)
		}
		require.Equal(t, base+held, dev.Allocated())
	}
	for range 40 {
		make1(1 + rng.Intn(20000))
	}
	make1(3<<20/4 + 7) // past the shared size: its own allocation
	checkAll()
	require.Positive(t, dev.Reserved())
	for i := 0; i < len(bufs); i += 2 {
		require.NoError(t, bufs[i].buf.Release())
	}
	kept := bufs[:0]
	for i, l := range bufs {
		if i%2 == 1 {
			kept = append(kept, l)
		}
	}
	bufs = kept
	for range 30 {
		make1(1 + rng.Intn(60000))
	}
	checkAll()
	for _, l := range bufs {
		require.NoError(t, l.buf.Release())
		require.ErrorIs(t, l.buf.Release(), vk.ErrReleased)
	}
	require.Equal(t, base, dev.Allocated())
}

// TestSharedBlocksCopy copies between buffers that share a block: the
// copy lands in its own buffer and no neighbour is touched.
func TestSharedBlocksCopy(t *testing.T) {
	dev := vktest.Open(t)
	const n = 1001
	in := make([]float32, n)
	for i := range in {
		in[i] = rand.Float32()*4 - 2
	}
	a, err := dev.NewBuffer(n*4, vk.DeviceLocal)
	require.NoError(t, err)
	defer a.Release()
	guard, err := dev.NewBuffer(64, vk.DeviceLocal)
	require.NoError(t, err)
	defer guard.Release()
	require.NoError(t, a.WriteFloat32(0, in))
	poison := []uint32{0x7fc00001, 0x7fc00002, 0x7fc00003, 0x7fc00004}
	require.NoError(t, guard.WriteUint32(0, poison))
	b, err := dev.NewBuffer(n*4, vk.DeviceLocal)
	require.NoError(t, err)
	defer b.Release()
	require.NoError(t, dev.Run(func(c *vk.Commands) { c.Copy(a.All(), b.All()) }))
	out := make([]float32, n)
	require.NoError(t, b.ReadFloat32(0, out))
	require.Equal(t, in, out)
	back := make([]uint32, 4)
	require.NoError(t, guard.ReadUint32(0, back))
	require.Equal(t, poison, back, "a neighbour in the block was written")
}

// TestUpload copies into several device-local and host-visible buffers in
// one call: each lands at its offset, the rest of each buffer keeps its
// poison, and a call with one range outside its buffer copies nothing.
func TestUpload(t *testing.T) {
	dev := vktest.Open(t)
	rng := rand.New(rand.NewSource(9))
	var bufs []*vk.Buffer
	for i, kind := range []vk.Memory{vk.DeviceLocal, vk.HostVisible, vk.DeviceLocal} {
		b, err := dev.NewBuffer(uint64(400+i*37)*4, kind)
		require.NoError(t, err)
		defer b.Release()
		poison := make([]uint32, b.Size()/4)
		for j := range poison {
			poison[j] = 0xffc00000 | uint32(j)
		}
		require.NoError(t, b.WriteUint32(0, poison))
		bufs = append(bufs, b)
	}
	words := func(n int) []uint32 {
		w := make([]uint32, n)
		for i := range w {
			w[i] = rng.Uint32() & 0x3fffffff
		}
		return w
	}
	raw := func(w []uint32) []byte {
		b := make([]byte, 4*len(w))
		for i, x := range w {
			b[4*i], b[4*i+1], b[4*i+2], b[4*i+3] = byte(x), byte(x>>8), byte(x>>16), byte(x>>24)
		}
		return b
	}
	type piece struct {
		buf, at int
		data    []uint32
	}
	pieces := []piece{{0, 3, words(17)}, {1, 0, words(5)}, {2, 101, words(300)}, {0, 250, words(1)}}
	var ups []vk.Upload
	for _, p := range pieces {
		ups = append(ups, vk.Upload{To: bufs[p.buf], Offset: uint64(p.at) * 4, Data: raw(p.data)})
	}
	require.NoError(t, dev.Upload(ups...))
	for i, b := range bufs {
		want := make([]uint32, b.Size()/4)
		for j := range want {
			want[j] = 0xffc00000 | uint32(j)
		}
		for _, p := range pieces {
			if p.buf == i {
				copy(want[p.at:], p.data)
			}
		}
		got := make([]uint32, len(want))
		require.NoError(t, b.ReadUint32(0, got))
		require.Equal(t, want, got, "buffer %d", i)
	}
	// One range outside its buffer: nothing is copied.
	snapshot := make([]uint32, bufs[0].Size()/4)
	require.NoError(t, bufs[0].ReadUint32(0, snapshot))
	err := dev.Upload(vk.Upload{To: bufs[0], Offset: 0, Data: raw(words(8))}, vk.Upload{To: bufs[2], Offset: bufs[2].Size() - 4, Data: raw(words(2))})
	require.Error(t, err)
	got := make([]uint32, len(snapshot))
	require.NoError(t, bufs[0].ReadUint32(0, got))
	require.Equal(t, snapshot, got, "a refused upload wrote the first buffer")
}

// TestUploadOneSubmission counts submissions: several device-local uploads
// take one.
func TestUploadOneSubmission(t *testing.T) {
	dev := faultDevice(t)
	a, err := dev.NewBuffer(1024, vk.DeviceLocal)
	require.NoError(t, err)
	defer a.Release()
	b, err := dev.NewBuffer(512, vk.DeviceLocal)
	require.NoError(t, err)
	defer b.Release()
	before := dev.Calls(vk.Submission)
	require.NoError(t, dev.Upload(vk.Upload{To: a, Data: make([]byte, 100)}, vk.Upload{To: b, Offset: 8, Data: []byte{1, 2, 3}}, vk.Upload{To: a, Offset: 500, Data: []byte{4}}))
	require.Equal(t, 1, dev.Calls(vk.Submission)-before)
}

// TestSharedPipeline asks twice for one kernel and once for another
// specialization: the same kernel gives the same pipeline, the other a
// new one; Release on a shared pipeline leaves it usable, and the device
// releases with no object reported alive.
func TestSharedPipeline(t *testing.T) {
	dev := vktest.Open(t)
	code, err := shaders.SPIRV("read_probe")
	require.NoError(t, err)
	k := vk.Kernel{Name: "read_probe", SPIRV: code, Bindings: 2, PushWords: 1, Specialization: []uint32{32}}
	p1, err := dev.SharedPipeline(k)
	require.NoError(t, err)
	p2, err := dev.SharedPipeline(k)
	require.NoError(t, err)
	require.Same(t, p1, p2)
	k2 := k
	k2.Specialization = append([]uint32{}, k.Specialization...)
	k2.Specialization[0]++
	p3, err := dev.SharedPipeline(k2)
	require.NoError(t, err)
	require.NotSame(t, p1, p3)
	require.NoError(t, p1.Release())
	buf, err := dev.NewBuffer(256, vk.DeviceLocal)
	require.NoError(t, err)
	defer buf.Release()
	bind, err := p1.Bind(buf.All(), buf.All())
	require.NoError(t, err, "a shared pipeline after Release")
	require.NoError(t, bind.Release())
}

// TestDoKeepsCommandBuffers runs Do many times: after the first, no call
// allocates a command buffer.
func TestDoKeepsCommandBuffers(t *testing.T) {
	dev := faultDevice(t)
	require.NoError(t, dev.Run(func(*vk.Commands) {}))
	before := dev.Calls(vk.Allocation)
	for range 20 {
		require.NoError(t, dev.Run(func(*vk.Commands) {}))
	}
	require.Equal(t, before, dev.Calls(vk.Allocation))
}
