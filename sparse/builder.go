package sparse

import (
	"errors"
	"math"
	"math/bits"

	"github.com/vksparse/vksparse/shaders"
	"github.com/vksparse/vksparse/vk"
)

// builder makes a selector's buffers and kernels one after another and
// keeps the first error: once one fails, the others return nil and err
// says why, so that a constructor checks once at the end.
type builder struct {
	dev  *vk.Device
	err  error
	bufs *[]*vk.Buffer // where the buffers made are recorded, for their owner to release
}

// words returns a device-local buffer of n 32-bit words (at least one).
func (b *builder) words(n int) *vk.Buffer {
	if b.err != nil {
		return nil
	}
	var buf *vk.Buffer
	buf, b.err = b.dev.NewBuffer(uint64(max(n, 1))*4, vk.DeviceLocal)
	*b.bufs = append(*b.bufs, buf)
	return buf
}

// kernel compiles the shader name with its bindings, push-constant words
// and specialization.
func (b *builder) kernel(name string, bindings, push int, spec ...uint32) *vk.Pipeline {
	if b.err != nil {
		return nil
	}
	var code []byte
	if code, b.err = shaders.SPIRV(name); b.err != nil {
		return nil
	}
	var pipe *vk.Pipeline
	pipe, b.err = b.dev.NewPipeline(vk.Kernel{Name: name, SPIRV: code, Bindings: bindings, PushWords: push, Specialization: spec})
	return pipe
}

// runKernelOnce builds the shader name, runs one dispatch of it over
// bindings with push and groups workgroups, waits, and releases it: the
// kernels a selector runs once, when it is made.
func runKernelOnce(dev *vk.Device, name string, spec []uint32, bindings []vk.Range, push []uint32, groups [3]uint32) error {
	b := &builder{dev: dev}
	pipe := b.kernel(name, len(bindings), len(push), spec...)
	if b.err != nil {
		return b.err
	}
	defer pipe.Release()
	bind, err := pipe.Bind(bindings...)
	if err != nil {
		return err
	}
	defer bind.Release()
	return dev.Run(func(c *vk.Commands) { c.Dispatch(pipe, bind, push, groups[0], groups[1], groups[2]) })
}

// releaseAll releases every object of xs that is not nil and returns
// their errors joined.
func releaseAll[T interface {
	comparable
	Release() error
}](xs ...T) error {
	var zero T
	var errs []error
	for _, x := range xs {
		if x != zero {
			errs = append(errs, x.Release())
		}
	}
	return errors.Join(errs...)
}

// massScale is the fixed-point scale of the binned top-p kernels: each of
// c terms in (0, 1] is summed as ⌊term·scale⌋ with integer atomics, so the
// total stays below 2^31.
func massScale(c int) float64 { return math.Ldexp(1, min(24, 31-bits.Len(uint(c)))) }
