package sparse

import (
	"errors"
	"fmt"
	"math"
	"math/bits"
	"sort"
	"sync"

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
	// cache, when set, holds the kernels: compiled once for a Dense and
	// shared (not released by the selector that asked first).
	cache *kernelCache
}

// kernelCache holds the kernels compiled for one Dense, by name and
// specialization, for every selector and plan made from it (all the
// layers and sequences of a model) to share: the selection kernels and
// attend_partial's variants (Dense.variant); Dense.Release releases them.
// It is safe for concurrent use.
type kernelCache struct {
	mu    sync.Mutex
	pipes map[string]*vk.Pipeline
}

// get returns the kernel, compiling it on first use.
func (k *kernelCache) get(dev *vk.Device, name string, bindings, push int, spec []uint32) (*vk.Pipeline, error) {
	key := fmt.Sprint(name, bindings, push, spec)
	k.mu.Lock()
	defer k.mu.Unlock()
	if p, ok := k.pipes[key]; ok {
		return p, nil
	}
	code, err := shaders.SPIRV(name)
	if err != nil {
		return nil, err
	}
	p, err := dev.NewPipeline(vk.Kernel{Name: name, SPIRV: code, Bindings: bindings, PushWords: push, Specialization: spec})
	if err != nil {
		return nil, err
	}
	if k.pipes == nil {
		k.pipes = map[string]*vk.Pipeline{}
	}
	k.pipes[key] = p
	return p, nil
}

// Kernels names the kernels compiled for this Dense on first use so far
// (the selection kernels and attend_partial's variants, each once,
// whatever the selectors and plans made from it), with their
// specializations.
func (d *Dense) Kernels() []string {
	d.kernels.mu.Lock()
	defer d.kernels.mu.Unlock()
	names := make([]string, 0, len(d.kernels.pipes))
	for key := range d.kernels.pipes {
		names = append(names, key)
	}
	sort.Strings(names)
	return names
}

// release frees every kernel of the cache.
func (k *kernelCache) release() error {
	k.mu.Lock()
	defer k.mu.Unlock()
	var errs []error
	for _, p := range k.pipes {
		errs = append(errs, p.Release())
	}
	k.pipes = nil
	return errors.Join(errs...)
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
	if b.cache != nil {
		var pipe *vk.Pipeline
		pipe, b.err = b.cache.get(b.dev, name, bindings, push, spec)
		return pipe
	}
	var code []byte
	if code, b.err = shaders.SPIRV(name); b.err != nil {
		return nil
	}
	var pipe *vk.Pipeline
	pipe, b.err = b.dev.NewPipeline(vk.Kernel{Name: name, SPIRV: code, Bindings: bindings, PushWords: push, Specialization: spec})
	return pipe
}

// runKernelOnce runs one dispatch of the shader name over bindings with
// push and groups workgroups, and waits: the kernels a selector runs once,
// when it is made. The device compiles the shader once (vk.SharedPipeline).
func runKernelOnce(dev *vk.Device, name string, spec []uint32, bindings []vk.Range, push []uint32, groups [3]uint32) error {
	code, err := shaders.SPIRV(name)
	if err != nil {
		return err
	}
	pipe, err := dev.SharedPipeline(vk.Kernel{Name: name, SPIRV: code, Bindings: len(bindings), PushWords: len(push), Specialization: spec})
	if err != nil {
		return err
	}
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
