package kvcache

import (
	"errors"
	"fmt"
	"slices"

	"github.com/vksparse/vksparse/vk"
)

// Clusters is a K-means index of a range of tokens of every KV head of a
// layer, on the device: C clusters per head with centroids (fp32), sizes,
// and member lists (token ids, ascending within a cluster, clusters laid
// out one after another from Starts).
type Clusters struct {
	KVHeads, HeadDim int
	C                int // clusters per head
	First, Count     int // the clustered tokens are [First, First+Count)
	Iterations       int // assignment steps run
	// Contiguous reports that the layer stores the clustered range in
	// cluster order (Layer.Reorder): slots First+Starts[c] … of a head
	// hold cluster c's members, in Members order.
	Contiguous bool
	// PageSize is the tokens of each page of a positional page index
	// (NewPages): cluster c holds the tokens First + PageSize·c …, the
	// last one maybe fewer. 0 for a K-means index, and for a page index
	// whose Starts another writer owns.
	PageSize int

	Centroids *vk.Buffer // float32 [KVHeads][C][HeadDim]; nil once quantized
	// Codes, Scales and DimScales hold the centroids in 8 bits in place of
	// Centroids once Quantize ran (what the selection kernels read, in
	// about a quarter of the memory), nil before: Codes the codes of every
	// row, [KVHeads][C][HeadDim] packed four to a word (PackCodes), Scales
	// each row's scale, float32 [KVHeads][C], DimScales each head's
	// dimension scales, float32 [KVHeads][HeadDim]; element i of head g's
	// centroid c is Scales[g][c]·DimScales[g][i]·code[g][c][i]
	// (QuantizeRows).
	Codes, Scales, DimScales *vk.Buffer
	Norms                    *vk.Buffer // float32 [KVHeads][C], |centroid|²
	Counts                   *vk.Buffer // uint32 [KVHeads][C], cluster sizes
	Starts                   *vk.Buffer // uint32 [KVHeads][C], Σ sizes of earlier clusters
	// Members, uint32 [KVHeads][Count], lists token ids in cluster order;
	// Assign, uint32 [KVHeads][Count], the cluster of token First+r. Both
	// are nil in a page index (NewPages), where members are the identity
	// and Starts and Counts say the rest.
	Members *vk.Buffer
	Assign  *vk.Buffer

	holds int // readers binding the buffers (Hold); Release refuses while any
}

// SingleTokens reports that every cluster c is the one token First + c:
// a positional index of pages of one token.
func (x *Clusters) SingleTokens() bool {
	return x.PageSize == 1 && x.C == x.Count && x.Contiguous
}

// Hold records a reader that binds the index's buffers (a plan): until
// its Drop, Release refuses. An index belongs to one goroutine at a time.
func (x *Clusters) Hold() { x.holds++ }

// Drop ends a Hold.
func (x *Clusters) Drop() {
	if x.holds > 0 {
		x.holds--
	}
}

// NewClusters allocates an index of c clusters over count tokens from first.
func NewClusters(dev *vk.Device, kvHeads, headDim, c, first, count int) (*Clusters, error) {
	return newClusters(dev, kvHeads, headDim, c, first, count, true, true)
}

// newClusters is NewClusters, without Centroids and Norms unless
// summaries, without Members and Assign unless members.
func newClusters(dev *vk.Device, kvHeads, headDim, c, first, count int, summaries, members bool) (*Clusters, error) {
	if c <= 0 || count <= 0 || c > count || first < 0 {
		return nil, fmt.Errorf("kvcache: %d clusters of tokens [%d, %d+%d)", c, first, first, count)
	}
	x := &Clusters{KVHeads: kvHeads, HeadDim: headDim, C: c, First: first, Count: count}
	h := uint64(kvHeads)
	var err error
	alloc := func(bytes uint64) *vk.Buffer {
		if err != nil {
			return nil
		}
		var b *vk.Buffer
		b, err = dev.NewBuffer(bytes, vk.DeviceLocal)
		return b
	}
	if summaries {
		x.Centroids = alloc(h * uint64(c*headDim) * 4)
		x.Norms = alloc(h * uint64(c) * 4)
	}
	x.Counts = alloc(h * uint64(c) * 4)
	x.Starts = alloc(h * uint64(c) * 4)
	if members {
		x.Members = alloc(h * uint64(count) * 4)
		x.Assign = alloc(h * uint64(count) * 4)
	}
	if err != nil {
		return nil, errors.Join(fmt.Errorf("kvcache: cluster index: %w", err), x.Release())
	}
	return x, nil
}

// Release frees the index's buffers and returns their errors joined; it
// refuses while a plan holds them.
func (x *Clusters) Release() error {
	if x.holds > 0 {
		return fmt.Errorf("kvcache: the index is read by %d plans: release them first", x.holds)
	}
	var errs []error
	for _, b := range []*vk.Buffer{x.Centroids, x.Codes, x.Scales, x.DimScales, x.Norms, x.Counts, x.Starts, x.Members, x.Assign} {
		if b != nil {
			errs = append(errs, b.Release())
		}
	}
	x.Centroids, x.Codes, x.Scales, x.DimScales, x.Norms, x.Counts, x.Starts, x.Members, x.Assign = nil, nil, nil, nil, nil, nil, nil, nil, nil
	return errors.Join(errs...)
}

// HostClusters is one KV head's index read back to the host.
type HostClusters struct {
	Centroids []float32 // C×HeadDim
	Members   [][]int32 // token ids per cluster, ascending
	Assign    []int32   // cluster of token First+r
}

// Read copies head g's index to the host; 8-bit centroids are read back
// as Decode gives them.
func (x *Clusters) Read(g int) (*HostClusters, error) {
	if g < 0 || g >= x.KVHeads {
		return nil, fmt.Errorf("kvcache: head %d of %d", g, x.KVHeads)
	}
	cent := make([]float32, x.C*x.HeadDim)
	counts := make([]uint32, x.C)
	starts := make([]uint32, x.C)
	members := make([]uint32, x.Count)
	assign := make([]uint32, x.Count)
	c4, n4 := uint64(x.C)*4, uint64(x.Count)*4
	readCentroids := func() error {
		switch {
		case x.Codes != nil:
			d := x.HeadDim
			words, scales, dims := make([]uint32, len(cent)/4), make([]float32, x.C), make([]float32, d)
			if err := errors.Join(x.Codes.ReadUint32(uint64(g)*c4/4*uint64(d), words), x.Scales.ReadFloat32(uint64(g)*c4, scales),
				x.DimScales.ReadFloat32(uint64(g*d)*4, dims)); err != nil {
				return err
			}
			for i, k := range UnpackCodes(words) {
				cent[i] = Decode(scales[i/d], dims[i%d], k)
			}
		case x.Centroids != nil:
			return x.Centroids.ReadFloat32(uint64(g)*c4*uint64(x.HeadDim), cent)
		}
		return nil // a page index: no key summaries, zero centroids
	}
	readMembers := func() error {
		if x.Members != nil {
			return errors.Join(x.Members.ReadUint32(uint64(g)*n4, members), x.Assign.ReadUint32(uint64(g)*n4, assign))
		}
		// A page index: the identity, each token in the page whose range
		// holds it.
		for r := range members {
			members[r] = uint32(x.First + r)
		}
		for c := range counts {
			for r := starts[c]; r < starts[c]+counts[c] && int(r) < x.Count; r++ {
				assign[r] = uint32(c)
			}
		}
		return nil
	}
	for _, read := range []func() error{
		readCentroids,
		func() error { return x.Counts.ReadUint32(uint64(g)*c4, counts) },
		func() error { return x.Starts.ReadUint32(uint64(g)*c4, starts) },
		readMembers,
	} {
		if err := read(); err != nil {
			return nil, err
		}
	}
	h := &HostClusters{Centroids: cent, Members: make([][]int32, x.C), Assign: make([]int32, x.Count)}
	for c := range h.Members {
		if int(starts[c])+int(counts[c]) > x.Count {
			return nil, fmt.Errorf("kvcache: cluster %d range [%d, +%d) outside %d members", c, starts[c], counts[c], x.Count)
		}
		for _, t := range members[starts[c] : starts[c]+counts[c]] {
			h.Members[c] = append(h.Members[c], int32(t))
		}
	}
	for i, a := range assign {
		h.Assign[i] = int32(a)
	}
	return h, nil
}

// Join returns a new index over x's tokens followed by next's: next must
// start where x ends and index the same heads. Its clusters are x's, then
// next's (cluster x.C+c is next's cluster c), with next's members placed
// after x's in every head. Both hold float32 centroids, or both 8-bit ones
// under the same dimension scales (next quantized with QuantizeLike(x)),
// which the joined index keeps. x and next are left as they were; the
// caller owns all three.
func (x *Clusters) Join(dev *vk.Device, next *Clusters) (*Clusters, error) {
	if next.KVHeads != x.KVHeads || next.HeadDim != x.HeadDim || next.First != x.First+x.Count {
		return nil, fmt.Errorf("kvcache: joining an index of tokens [%d, %d) (%d heads of %d) after one of [%d, %d) (%d heads of %d)",
			next.First, next.First+next.Count, next.KVHeads, next.HeadDim, x.First, x.First+x.Count, x.KVHeads, x.HeadDim)
	}
	coded := x.Codes != nil
	switch {
	case (x.Centroids == nil && !coded) || (next.Centroids == nil && next.Codes == nil):
		return nil, fmt.Errorf("kvcache: joining a page index (no centroids): make pages over the whole range instead")
	case coded != (next.Codes != nil):
		return nil, fmt.Errorf("kvcache: joining an index with 8-bit centroids and one with float32 (Quantize both)")
	}
	var dims []float32
	if coded {
		var err error
		if dims, err = x.readDimScales(); err == nil {
			var nd []float32
			if nd, err = next.readDimScales(); err == nil && !slices.Equal(dims, nd) {
				err = fmt.Errorf("kvcache: joining 8-bit indexes of different dimension scales (QuantizeLike the first)")
			}
		}
		if err != nil {
			return nil, err
		}
	}
	j, err := newClusters(dev, x.KVHeads, x.HeadDim, x.C+next.C, x.First, x.Count+next.Count, !coded, true)
	if err == nil && coded {
		j.Norms, err = dev.NewBuffer(uint64(x.KVHeads*j.C)*4, vk.DeviceLocal)
		if err == nil {
			j.Codes, err = dev.NewBuffer(uint64(x.KVHeads*j.C*x.HeadDim), vk.DeviceLocal)
		}
		if err == nil {
			j.Scales, err = dev.NewBuffer(uint64(x.KVHeads*j.C)*4, vk.DeviceLocal)
		}
		if err == nil {
			j.DimScales, err = dev.NewBuffer(uint64(len(dims))*4, vk.DeviceLocal)
		}
		if err == nil {
			err = j.DimScales.WriteFloat32(0, dims)
		}
		if err != nil {
			err = errors.Join(err, j.Release())
		}
	}
	if err != nil {
		return nil, err
	}
	j.Iterations = max(x.Iterations, next.Iterations)
	j.Contiguous = x.Contiguous && next.Contiguous
	// next's starts and assignments are shifted by x's member and cluster
	// counts, on the host: they are small (one word per cluster or token of
	// next).
	starts := make([]uint32, next.KVHeads*next.C)
	assign := make([]uint32, next.KVHeads*next.Count)
	if err := errors.Join(next.Starts.ReadUint32(0, starts), next.Assign.ReadUint32(0, assign)); err != nil {
		return nil, errors.Join(err, j.Release())
	}
	for i := range starts {
		starts[i] += uint32(x.Count)
	}
	for i := range assign {
		assign[i] += uint32(x.C)
	}
	err = dev.Run(func(c *vk.Commands) {
		for g := 0; g < x.KVHeads; g++ {
			// Per head: x's rows, then next's, of a buffer with `per` words
			// per cluster (or per token) in each.
			join := func(dst, a, b *vk.Buffer, na, nb, per int) {
				wa, wb := uint64(na*per)*4, uint64(nb*per)*4
				c.Copy(a.Slice(uint64(g)*wa, wa), dst.Slice(uint64(g)*(wa+wb), wa))
				if b != nil {
					c.Copy(b.Slice(uint64(g)*wb, wb), dst.Slice(uint64(g)*(wa+wb)+wa, wb))
				}
			}
			if coded {
				join(j.Codes, x.Codes, next.Codes, x.C, next.C, x.HeadDim/4)
				join(j.Scales, x.Scales, next.Scales, x.C, next.C, 1)
			} else {
				join(j.Centroids, x.Centroids, next.Centroids, x.C, next.C, x.HeadDim)
			}
			join(j.Norms, x.Norms, next.Norms, x.C, next.C, 1)
			join(j.Counts, x.Counts, next.Counts, x.C, next.C, 1)
			join(j.Starts, x.Starts, nil, x.C, next.C, 1)
			join(j.Members, x.Members, next.Members, x.Count, next.Count, 1)
			join(j.Assign, x.Assign, nil, x.Count, next.Count, 1)
		}
	})
	if err == nil {
		for g := 0; g < x.KVHeads; g++ {
			c4, n4 := uint64(j.C)*4, uint64(j.Count)*4
			err = errors.Join(err,
				j.Starts.WriteUint32(uint64(g)*c4+uint64(x.C)*4, starts[g*next.C:(g+1)*next.C]),
				j.Assign.WriteUint32(uint64(g)*n4+uint64(x.Count)*4, assign[g*next.Count:(g+1)*next.Count]))
		}
	}
	if err != nil {
		return nil, errors.Join(fmt.Errorf("kvcache: joining cluster indexes: %w", err), j.Release())
	}
	return j, nil
}

// Bytes returns the device memory the index holds (0 for nil).
func (x *Clusters) Bytes() uint64 {
	if x == nil {
		return 0
	}
	return vk.Held(x.Centroids, x.Codes, x.Scales, x.DimScales, x.Norms, x.Counts, x.Starts, x.Members, x.Assign)
}

// Quantize stores the centroids in 8 bits in Codes, Scales and DimScales
// and releases the float32 ones: each head's rows quantized against its
// own dimension scales (DimScales over its C centroids, then
// QuantizeRows). The selection kernels read 8-bit centroids, and an index
// kept for decoding takes about a quarter of the memory so. An index
// already quantized is left as it is; on error it is left as it was.
func (x *Clusters) Quantize(dev *vk.Device) error {
	return x.quantize(dev, nil)
}

// QuantizeLike is Quantize against the dimension scales of like, an index
// of the same heads already quantized, so that the two join (Join): rows
// beyond like's scales take a larger row scale, not clamped codes.
func (x *Clusters) QuantizeLike(dev *vk.Device, like *Clusters) error {
	if like.DimScales == nil || like.KVHeads != x.KVHeads || like.HeadDim != x.HeadDim {
		return fmt.Errorf("kvcache: QuantizeLike an index that is not quantized or of other heads")
	}
	dims, err := like.readDimScales()
	if err != nil {
		return err
	}
	return x.quantize(dev, dims)
}

func (x *Clusters) quantize(dev *vk.Device, dims []float32) error {
	if x.Codes != nil {
		return nil
	}
	if x.Centroids == nil {
		return fmt.Errorf("kvcache: Quantize of an index without centroids")
	}
	codes, scales, dims, err := x.readCodes(dims)
	if err != nil {
		return err
	}
	var bufs [3]*vk.Buffer
	for i, n := range []int{len(codes), len(scales), len(dims)} {
		if err == nil {
			bufs[i], err = dev.NewBuffer(uint64(n)*4, vk.DeviceLocal)
		}
	}
	if err == nil {
		err = errors.Join(bufs[0].WriteUint32(0, codes), bufs[1].WriteFloat32(0, scales), bufs[2].WriteFloat32(0, dims))
	}
	if err != nil {
		for _, b := range bufs {
			if b != nil {
				err = errors.Join(err, b.Release())
			}
		}
		return err
	}
	err = x.Centroids.Release()
	x.Centroids, x.Codes, x.Scales, x.DimScales = nil, bufs[0], bufs[1], bufs[2]
	return err
}

// ReadCodes returns the float32 centroids of every head in 8 bits, as
// Quantize stores them: the packed codes (PackCodes), the rows' scales and
// the heads' dimension scales.
func (x *Clusters) ReadCodes() (codes []uint32, scales, dims []float32, err error) {
	return x.readCodes(nil)
}

// readCodes quantizes the float32 centroids against dims, [KVHeads]
// [HeadDim], or each head's own (DimScales) where dims is nil.
func (x *Clusters) readCodes(dims []float32) (codes []uint32, scales, outDims []float32, err error) {
	switch {
	case x.Centroids == nil:
		return nil, nil, nil, fmt.Errorf("kvcache: the index holds no float32 centroids")
	case x.HeadDim%4 != 0:
		return nil, nil, nil, fmt.Errorf("kvcache: 8-bit centroids of dimension %d: codes are packed four to a word", x.HeadDim)
	}
	d, per := x.HeadDim, x.C*x.HeadDim
	f := make([]float32, x.KVHeads*per)
	if err := x.Centroids.ReadFloat32(0, f); err != nil {
		return nil, nil, nil, err
	}
	k := make([]int8, 0, len(f))
	for g := 0; g < x.KVHeads; g++ {
		rows := f[g*per : (g+1)*per]
		var m []float32
		if dims != nil {
			m = dims[g*d : (g+1)*d]
		} else if m, err = DimScales(rows, d); err != nil {
			return nil, nil, nil, fmt.Errorf("kvcache: centroids in 8 bits: %w", err)
		} else {
			outDims = append(outDims, m...)
		}
		kg, sg, err := QuantizeRows(rows, d, m)
		if err != nil {
			return nil, nil, nil, fmt.Errorf("kvcache: centroids in 8 bits: %w", err)
		}
		k, scales = append(k, kg...), append(scales, sg...)
	}
	if dims != nil {
		outDims = dims
	}
	return PackCodes(k), scales, outDims, nil
}

// readDimScales reads the dimension scales of a quantized index.
func (x *Clusters) readDimScales() ([]float32, error) {
	if x.DimScales == nil {
		return nil, fmt.Errorf("kvcache: the index holds no 8-bit centroids")
	}
	dims := make([]float32, x.KVHeads*x.HeadDim)
	return dims, x.DimScales.ReadFloat32(0, dims)
}
