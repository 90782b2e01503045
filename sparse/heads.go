package sparse

import (
	"fmt"
	"math"

	"github.com/vksparse/vksparse/kvcache"
)

// Heads is the attention geometry of a layer.
type Heads struct {
	Query int // query heads
	KV    int // key/value heads; Query is a multiple of KV (GQA)
	Dim   int // head dimension, a multiple of 8, at most 256
}

// Group returns the number of query heads per KV head.
func (h Heads) Group() int { return h.Query / h.KV }

// Scale returns the attention scale 1/√Dim that multiplies every q·k.
func (h Heads) Scale() float64 { return 1 / math.Sqrt(float64(h.Dim)) }

// GroupQueries returns the query heads of KV head g from q ([Hq][D]
// float32) as float64 rows, [Group][D]: what the float64 references take.
func (h Heads) GroupQueries(q []float32, g int) [][]float64 {
	qs := make([][]float64, 0, h.Group())
	for hh := g * h.Group(); hh < (g+1)*h.Group(); hh++ {
		qh := make([]float64, h.Dim)
		for i := range qh {
			qh[i] = float64(q[hh*h.Dim+i])
		}
		qs = append(qs, qh)
	}
	return qs
}

// scaleBits returns Scale as the float32 bits a kernel's push constants
// take.
func (h Heads) scaleBits() uint32 { return math.Float32bits(float32(h.Scale())) }

// Validate reports a geometry the kernels cannot run.
func (h Heads) Validate() error {
	switch {
	case h.Query <= 0 || h.KV <= 0:
		return fmt.Errorf("sparse: heads %d query / %d kv must be positive", h.Query, h.KV)
	case h.Query%h.KV != 0:
		return fmt.Errorf("sparse: %d query heads is not a multiple of %d KV heads", h.Query, h.KV)
	case h.Dim <= 0 || h.Dim%8 != 0 || h.Dim > 256:
		return fmt.Errorf("sparse: head dimension %d unsupported (a multiple of 8 up to 256)", h.Dim)
	}
	return nil
}

// checkIndex refuses an index x or a layer of other heads or head
// dimension than h, and an index of tokens the layer does not store: x
// must cover tokens [First, First+Count) within the layer's length.
func (h Heads) checkIndex(layer *kvcache.Layer, x *kvcache.Clusters) error {
	switch {
	case x.KVHeads != h.KV || x.HeadDim != h.Dim || layer.KVHeads() != h.KV || layer.HeadDim() != h.Dim:
		return fmt.Errorf("sparse: an index of %d heads of %d and a cache of %d of %d for kernels of %d of %d", x.KVHeads, x.HeadDim, layer.KVHeads(), layer.HeadDim(), h.KV, h.Dim)
	case x.First < 0 || x.First+x.Count > layer.Len():
		return fmt.Errorf("sparse: indexed tokens [%d, %d) beyond the %d stored", x.First, x.First+x.Count, layer.Len())
	}
	return nil
}
