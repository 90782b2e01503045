package lm

import (
	"errors"
	"fmt"

	"github.com/vksparse/vksparse/shaders"
	"github.com/vksparse/vksparse/vk"
)

// Products says where a Runner's prefill computes its matrix products.
type Products int

const (
	// ProductsAuto computes them on the GPU unless the device is a
	// software renderer (a CPU device), where gonum on the host is faster.
	ProductsAuto Products = iota
	// ProductsCPU computes them on the host (gonum).
	ProductsCPU
	// ProductsGPU computes them on the device (shaders/matmul_t.comp).
	ProductsGPU
)

// productTile is the side of the blocks of y a matmul_t workgroup
// computes (its T): 16 × 16 threads.
const productTile = 16

// gpuProducts computes y = x wᵀ for the model's weight matrices on the
// GPU in float32: the weights are uploaded once; each product uploads x,
// runs one dispatch and reads y back.
type gpuProducts struct {
	dev     *vk.Device
	pipe    *vk.Pipeline
	cmd     *vk.Commands
	x, y    *vk.Buffer
	weights map[*float32]*vk.Buffer // by a matrix's first element
	binds   map[*float32]*vk.Binding
}

// newGPUProducts uploads every weight matrix of w and sizes the operands
// for products of up to rows rows.
func newGPUProducts(dev *vk.Device, w *Weights, rows int) (*gpuProducts, error) {
	g := &gpuProducts{dev: dev, weights: map[*float32]*vk.Buffer{}, binds: map[*float32]*vk.Binding{}}
	code, err := shaders.SPIRV("matmul_t")
	if err == nil {
		g.pipe, err = dev.NewPipeline(vk.Kernel{Name: "matmul_t", SPIRV: code, Bindings: 3, PushWords: 3, Specialization: []uint32{productTile}})
	}
	if err == nil {
		g.cmd, err = dev.NewCommands()
	}
	c := w.Config
	widest := max(c.Dim, c.Hidden, c.Vocab, c.Heads*c.HeadDim)
	if err == nil {
		g.x, err = dev.NewBuffer(uint64(rows*widest)*4, vk.DeviceLocal)
	}
	if err == nil {
		g.y, err = dev.NewBuffer(uint64(rows*widest)*4, vk.DeviceLocal)
	}
	matrices := [][]float32{w.Head}
	for _, l := range w.Layers {
		matrices = append(matrices, l.Wq, l.Wk, l.Wv, l.Wo, l.W1, l.W3, l.W2)
	}
	for _, m := range matrices {
		if err != nil {
			break
		}
		var b *vk.Buffer
		if b, err = dev.NewBuffer(uint64(len(m))*4, vk.DeviceLocal); err != nil {
			break
		}
		g.weights[&m[0]] = b
		if err = b.WriteFloat32(0, m); err == nil {
			g.binds[&m[0]], err = g.pipe.Bind(g.x.All(), b.All(), g.y.All())
		}
	}
	if err != nil {
		return nil, errors.Join(fmt.Errorf("lm: the GPU's products: %w", err), g.release())
	}
	return g, nil
}

// mul is a productFunc on the GPU.
func (g *gpuProducts) mul(y, x []float32, rows, in int, w []float32, out int) error {
	bind, ok := g.binds[&w[0]]
	switch {
	case !ok:
		return fmt.Errorf("lm: a product with a matrix the GPU does not hold")
	case uint64(rows*in)*4 > g.x.Size() || uint64(rows*out)*4 > g.y.Size():
		return fmt.Errorf("lm: a product of %d rows × %d → %d beyond the GPU's operands", rows, in, out)
	}
	if err := g.x.WriteFloat32(0, x[:rows*in]); err != nil {
		return err
	}
	if err := g.cmd.Begin(); err != nil {
		return err
	}
	g.cmd.Barrier() // x's upload before the product
	g.cmd.Dispatch(g.pipe, bind, []uint32{uint32(rows), uint32(in), uint32(out)},
		uint32((out+productTile-1)/productTile), uint32((rows+productTile-1)/productTile), 1)
	g.cmd.Barrier() // the product before y's read-back
	if err := g.cmd.End(); err != nil {
		return err
	}
	if err := g.cmd.Submit(); err != nil {
		return err
	}
	return g.y.ReadFloat32(0, y[:rows*out])
}

// release frees the weights, operands, bindings, commands and kernel.
func (g *gpuProducts) release() error {
	var errs []error
	for _, b := range g.binds {
		errs = append(errs, b.Release())
	}
	for _, b := range g.weights {
		errs = append(errs, b.Release())
	}
	for _, b := range []*vk.Buffer{g.x, g.y} {
		if b != nil {
			errs = append(errs, b.Release())
		}
	}
	if g.cmd != nil {
		errs = append(errs, g.cmd.Release())
	}
	if g.pipe != nil {
		errs = append(errs, g.pipe.Release())
	}
	g.binds, g.weights, g.x, g.y, g.cmd, g.pipe = nil, nil, nil, nil, nil, nil
	return errors.Join(errs...)
}

// matmulTRef returns y[r][o] = Σ_i x[r][i]·w[o][i] in float64, x [rows][in]
// and w [out][in] row-major: what matmul_t computes in float32.
func matmulTRef(x, w []float64, rows, in, out int) []float64 {
	y := make([]float64, rows*out)
	for r := 0; r < rows; r++ {
		for o := 0; o < out; o++ {
			var s float64
			for i := 0; i < in; i++ {
				s += x[r*in+i] * w[o*in+i]
			}
			y[r*out+o] = s
		}
	}
	return y
}
