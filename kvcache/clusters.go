package kvcache

import (
	"errors"
	"fmt"

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

	Centroids *vk.Buffer // float32 [KVHeads][C][HeadDim]; nil once quantized
	// Codes and Scales hold the centroids in 8 bits in place of Centroids
	// once Quantize ran (what the selection kernels read, in a quarter of
	// the memory), nil before: Codes the codes of every row, [KVHeads][C]
	// [HeadDim] packed four to a word (PackCodes), Scales each row's scale,
	// float32 [KVHeads][C]; centroid c's element i is Scales[c]·code[c][i]
	// (QuantizeRows).
	Codes, Scales *vk.Buffer
	Norms         *vk.Buffer // float32 [KVHeads][C], |centroid|²
	Counts        *vk.Buffer // uint32 [KVHeads][C], cluster sizes
	Starts        *vk.Buffer // uint32 [KVHeads][C], Σ sizes of earlier clusters
	// Members, uint32 [KVHeads][Count], lists token ids in cluster order;
	// Assign, uint32 [KVHeads][Count], the cluster of token First+r. Both
	// are nil in a page index (NewPages), where members are the identity
	// and Starts and Counts say the rest.
	Members *vk.Buffer
	Assign  *vk.Buffer

	holds int // readers binding the buffers (Hold); Release refuses while any
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
	for _, b := range []*vk.Buffer{x.Centroids, x.Codes, x.Scales, x.Norms, x.Counts, x.Starts, x.Members, x.Assign} {
		if b != nil {
			errs = append(errs, b.Release())
		}
	}
	x.Centroids, x.Codes, x.Scales, x.Norms, x.Counts, x.Starts, x.Members, x.Assign = nil, nil, nil, nil, nil, nil, nil, nil
	return errors.Join(errs...)
}

// HostClusters is one KV head's index read back to the host.
type HostClusters struct {
	Centroids []float32 // C×HeadDim
	Members   [][]int32 // token ids per cluster, ascending
	Assign    []int32   // cluster of token First+r
}

// Read copies head g's index to the host.
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
			words, scales := make([]uint32, len(cent)/4), make([]float32, x.C)
			if err := errors.Join(x.Codes.ReadUint32(uint64(g)*c4/4*uint64(x.HeadDim), words), x.Scales.ReadFloat32(uint64(g)*c4, scales)); err != nil {
				return err
			}
			for i, k := range UnpackCodes(words) {
				cent[i] = scales[i/x.HeadDim] * float32(k)
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
// after x's in every head. x and next are left as they were; the caller
// owns all three.
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
	j, err := newClusters(dev, x.KVHeads, x.HeadDim, x.C+next.C, x.First, x.Count+next.Count, !coded, true)
	if err == nil && coded {
		j.Norms, err = dev.NewBuffer(uint64(x.KVHeads*j.C)*4, vk.DeviceLocal)
		if err == nil {
			j.Codes, err = dev.NewBuffer(uint64(x.KVHeads*j.C*x.HeadDim), vk.DeviceLocal)
		}
		if err == nil {
			j.Scales, err = dev.NewBuffer(uint64(x.KVHeads*j.C)*4, vk.DeviceLocal)
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
	return vk.Held(x.Centroids, x.Codes, x.Scales, x.Norms, x.Counts, x.Starts, x.Members, x.Assign)
}

// Quantize stores the centroids in 8 bits (QuantizeRows) in Codes and
// Scales and releases the float32 ones: the selection kernels read 8-bit
// centroids, and an index kept for decoding takes a quarter of the memory
// so. An index already quantized is left as it is; on error it is left as
// it was.
func (x *Clusters) Quantize(dev *vk.Device) error {
	if x.Codes != nil {
		return nil
	}
	if x.Centroids == nil {
		return fmt.Errorf("kvcache: Quantize of an index without centroids")
	}
	codes, scales, err := x.ReadCodes()
	if err != nil {
		return err
	}
	var c, s *vk.Buffer
	c, err = dev.NewBuffer(uint64(len(codes))*4, vk.DeviceLocal)
	if err == nil {
		s, err = dev.NewBuffer(uint64(len(scales))*4, vk.DeviceLocal)
	}
	if err == nil {
		err = errors.Join(c.WriteUint32(0, codes), s.WriteFloat32(0, scales))
	}
	if err != nil {
		for _, b := range []*vk.Buffer{c, s} {
			if b != nil {
				err = errors.Join(err, b.Release())
			}
		}
		return err
	}
	err = x.Centroids.Release()
	x.Centroids, x.Codes, x.Scales = nil, c, s
	return err
}

// ReadCodes returns the float32 centroids of every head in 8 bits, as
// Quantize stores them: the packed codes (PackCodes) and the rows' scales.
func (x *Clusters) ReadCodes() (codes []uint32, scales []float32, err error) {
	switch {
	case x.Centroids == nil:
		return nil, nil, fmt.Errorf("kvcache: the index holds no float32 centroids")
	case x.HeadDim%4 != 0:
		return nil, nil, fmt.Errorf("kvcache: 8-bit centroids of dimension %d: codes are packed four to a word", x.HeadDim)
	}
	f := make([]float32, x.KVHeads*x.C*x.HeadDim)
	if err := x.Centroids.ReadFloat32(0, f); err != nil {
		return nil, nil, err
	}
	k, scales, err := QuantizeRows(f, x.HeadDim)
	if err != nil {
		return nil, nil, fmt.Errorf("kvcache: centroids in 8 bits: %w", err)
	}
	return PackCodes(k), scales, nil
}
