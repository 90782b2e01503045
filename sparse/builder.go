package sparse

import (
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
