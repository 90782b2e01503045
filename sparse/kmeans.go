package sparse

import (
	"fmt"
	"math"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/shaders"
	"github.com/vksparse/vksparse/vk"
)

// KMeans clusters the keys of a layer's KV heads on the GPU, as KMeansRef
// does on the host: the same initial rows (KMeansInit), nearest centroid in
// squared distance (computed as |c|² − 2k·c in float32, so near ties may
// break differently), means of members summed in ascending token order,
// empty clusters kept, at most MaxIter assignment steps.
type KMeans struct {
	dev                                 *vk.Device
	kvHeads, dim                        int
	assign, scan, scatter, sort, update *vk.Pipeline
}

// KMeansOptions configure a clustering.
type KMeansOptions struct {
	AvgClusterSize int    // tokens per cluster on average; 0 = 16
	MaxIter        int    // at most this many assignment steps; 0 = 10
	Seed           uint64 // seeds KMeansInit
}

// NewKMeans compiles the clustering kernels for kvHeads heads of dim.
func NewKMeans(dev *vk.Device, kvHeads, dim int) (*KMeans, error) {
	if kvHeads <= 0 || dim <= 0 || dim%8 != 0 || dim > 256 {
		return nil, fmt.Errorf("sparse: KMeans over %d heads of dimension %d (a multiple of 8 up to 256)", kvHeads, dim)
	}
	bk := 8
	if dim%16 == 0 {
		bk = 16
	}
	km := &KMeans{dev: dev, kvHeads: kvHeads, dim: dim}
	kernels := []struct {
		p **vk.Pipeline
		k vk.Kernel
	}{
		{&km.assign, vk.Kernel{Name: "kmeans_assign", Bindings: 6, PushWords: 4, Specialization: []uint32{uint32(dim), uint32(bk)}}},
		{&km.scan, vk.Kernel{Name: "kmeans_scan", Bindings: 3, PushWords: 1}},
		{&km.scatter, vk.Kernel{Name: "kmeans_scatter", Bindings: 3, PushWords: 3}},
		{&km.sort, vk.Kernel{Name: "kmeans_sort", Bindings: 3, PushWords: 2}},
		{&km.update, vk.Kernel{Name: "kmeans_update", Bindings: 6, PushWords: 3, Specialization: []uint32{uint32(dim), uint32(dim / 2)}}},
	}
	for _, x := range kernels {
		code, err := shaders.SPIRV(x.k.Name)
		if err == nil {
			x.k.SPIRV = code
			*x.p, err = dev.NewPipeline(x.k)
		}
		if err != nil {
			km.Release()
			return nil, err
		}
	}
	return km, nil
}

// Release destroys the kernels.
func (km *KMeans) Release() error {
	for _, p := range []*vk.Pipeline{km.assign, km.scan, km.scatter, km.sort, km.update} {
		if p != nil {
			p.Release()
		}
	}
	return nil
}

// Cluster clusters tokens [first, first+count) of every KV head of layer
// into KMeansClusterCount(count, AvgClusterSize) clusters. The host waits
// for each assignment step to learn whether any token moved.
func (km *KMeans) Cluster(layer *kvcache.Layer, first, count int, opts KMeansOptions) (*kvcache.Clusters, error) {
	if opts.AvgClusterSize == 0 {
		opts.AvgClusterSize = KMeansDefaultAvgClusterSize
	}
	if opts.MaxIter == 0 {
		opts.MaxIter = KMeansDefaultIters
	}
	switch {
	case layer.KVHeads() != km.kvHeads || layer.HeadDim() != km.dim:
		return nil, fmt.Errorf("sparse: KMeans built for %d heads of %d, layer has %d of %d", km.kvHeads, km.dim, layer.KVHeads(), layer.HeadDim())
	case first < 0 || count <= 0 || first+count > layer.Len():
		return nil, fmt.Errorf("sparse: clustering tokens [%d, %d) of a cache of %d", first, first+count, layer.Len())
	case opts.MaxIter < 0 || opts.AvgClusterSize < 0:
		return nil, fmt.Errorf("sparse: KMeansOptions %+v", opts)
	}
	c, err := KMeansClusterCount(count, opts.AvgClusterSize)
	if err != nil {
		return nil, err
	}
	init, err := KMeansInit(count, c, opts.Seed)
	if err != nil {
		return nil, err
	}
	x, err := kvcache.NewClusters(km.dev, km.kvHeads, km.dim, c, first, count)
	if err != nil {
		return nil, err
	}
	if err := km.run(layer, x, init, opts.MaxIter); err != nil {
		x.Release()
		return nil, err
	}
	return x, nil
}

func (km *KMeans) run(layer *kvcache.Layer, x *kvcache.Clusters, init []int, maxIter int) error {
	dev, h, c, n := km.dev, km.kvHeads, x.C, x.Count
	headWords := uint32(layer.HeadBytes() / 4)
	// The initial centroids are the update of one-member clusters.
	members := make([]uint32, h*n)
	starts := make([]uint32, h*c)
	ones := make([]uint32, h*c)
	for g := 0; g < h; g++ {
		for j, r := range init {
			members[g*n+j] = uint32(x.First + r)
			starts[g*c+j] = uint32(j)
			ones[g*c+j] = 1
		}
	}
	for _, err := range []error{x.Members.WriteUint32(0, members), x.Starts.WriteUint32(0, starts), x.Counts.WriteUint32(0, ones)} {
		if err != nil {
			return err
		}
	}
	changed, err := dev.NewBuffer(uint64(4*h), vk.HostVisible)
	if err != nil {
		return err
	}
	defer changed.Release()
	cursor, err := dev.NewBuffer(uint64(4*h*c), vk.DeviceLocal)
	if err != nil {
		return err
	}
	defer cursor.Release()

	var binds []*vk.Binding
	bind := func(p *vk.Pipeline, r ...vk.Range) *vk.Binding {
		if err != nil {
			return nil
		}
		var b *vk.Binding
		b, err = p.Bind(r...)
		binds = append(binds, b)
		return b
	}
	defer func() {
		for _, b := range binds {
			if b != nil {
				b.Release()
			}
		}
	}()
	keys := layer.Keys().All()
	bAssign := bind(km.assign, keys, x.Centroids.All(), x.Norms.All(), x.Assign.All(), x.Counts.All(), changed.All())
	bScan := bind(km.scan, x.Counts.All(), x.Starts.All(), cursor.All())
	bScatter := bind(km.scatter, x.Assign.All(), cursor.All(), x.Members.All())
	bSort := bind(km.sort, x.Starts.All(), x.Counts.All(), x.Members.All())
	bUpdate := bind(km.update, keys, x.Starts.All(), x.Counts.All(), x.Members.All(), x.Centroids.All(), x.Norms.All())
	if err != nil {
		return err
	}
	hh, cc, nn := uint32(h), uint32(c), uint32(n)
	update := func(cmd *vk.Commands) {
		cmd.Dispatch(km.update, bUpdate, []uint32{nn, headWords, cc}, cc, hh, 1)
		cmd.Barrier()
	}
	if err := dev.Run(func(cmd *vk.Commands) {
		cmd.Fill(x.Assign.All(), math.MaxUint32)
		update(cmd)
	}); err != nil {
		return err
	}
	got := make([]uint32, h)
	for x.Iterations = 1; x.Iterations <= maxIter; x.Iterations++ {
		err := dev.Run(func(cmd *vk.Commands) {
			cmd.Fill(x.Counts.All(), 0)
			cmd.Fill(changed.All(), 0)
			cmd.Barrier()
			cmd.Dispatch(km.assign, bAssign, []uint32{nn, uint32(x.First), headWords, cc}, uint32(ceilDiv(n, 128)), hh, 1)
		})
		if err == nil {
			err = changed.ReadUint32(0, got)
		}
		if err != nil {
			return err
		}
		moved := false
		for _, m := range got {
			moved = moved || m > 0
		}
		if !moved {
			break
		}
		if err := dev.Run(func(cmd *vk.Commands) {
			cmd.Dispatch(km.scan, bScan, []uint32{cc}, hh, 1, 1)
			cmd.Barrier()
			cmd.Dispatch(km.scatter, bScatter, []uint32{nn, uint32(x.First), cc}, uint32(ceilDiv(n, 256)), hh, 1)
			cmd.Barrier()
			cmd.Dispatch(km.sort, bSort, []uint32{nn, cc}, uint32(ceilDiv(c, 64)), hh, 1)
			cmd.Barrier()
			update(cmd)
		}); err != nil {
			return err
		}
	}
	x.Iterations = min(x.Iterations, maxIter)
	return nil
}
