package sparse

import (
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/shaders"
	"github.com/vksparse/vksparse/vk"
)

// KMeans clusters the keys of a layer's KV heads on the GPU, as
// KMeansSpanRef does on the host: within spans of KMeansOptions.Span tokens
// (or over the whole range), the same initial rows (KMeansSpanInit),
// nearest centroid of the token's span in squared distance (computed as
// |c|² − 2k·c in float32, so near ties may break differently), means of
// members summed in ascending token order, empty clusters kept, at most
// MaxIter assignment steps, a span whose assignment changed nothing left
// as it is.
//
// All spans of all heads go through the same dispatches: five per step
// (assign, scan, scatter, sort, update) for the whole layer whatever the
// number of spans, and one before the first step for the initial
// centroids. What a step moves, per head of n tokens of dimension D in
// spans of S tokens with S/16 clusters each (C = n/16 in all, fp16 keys):
//
//   - assign: reads the keys (2nD bytes) and, per workgroup of 128 tokens
//     (256 on cooperative matrices), its span's centroids once (4·D·S/16
//     bytes; nDS/512 in all, nDS/1024 on cooperative matrices, mostly
//     from cache since a span's workgroups share them); writes the
//     assignment (4n) and counts the clusters (n atomics); 2n·D·S/16 flops
//     (twice that on cooperative matrices: hi and lo parts).
//   - scan: one workgroup per span; reads the sizes (4C), writes starts
//     and cursors (8C).
//   - scatter: reads the assignment (4n), n atomics, writes the members
//     (4n).
//   - sort: reads and writes the member lists (8n; a cluster of more than
//     1024 members rereads its span's assignment instead).
//   - update: reads the members (4n) and gathers their keys (2nD), writes
//     the centroids (4CD = nD/4), their norms (4C) and, on cooperative
//     matrices, their fp16 halves (nD/4).
//
// For a 131 072-token layer of 8 heads, D = 128, S = 2 048: 34 Gflop and
// about 0.6 GB of memory traffic per step (the keys twice: 0.54 GB), plus
// 0.54 GB of centroid reads served mostly by the cache; whole-context
// K-means (S = n) does 2.2 Tflop per step instead.
//
// Where the device has NVIDIA's cooperative matrices (vk.Info's
// CooperativeMatrixNV, a subgroup of 32, 16-bit storage) and the head
// dimension is a multiple of 16 up to 128, the assignment's dot products run
// on them: fp16 keys times each centroid's two fp16 parts (hi and the
// remainder lo), accumulated in fp32, as accurate as the float32 path.
// SetTensor(false) keeps to the float32 path, which every device runs.
// A KMeans keeps scratch buffers between clusterings; it is not safe for
// concurrent use.
type KMeans struct {
	dev                                 *vk.Device
	kvHeads, dim                        int
	assign, scan, scatter, sort, update *vk.Pipeline
	assignNV, updateNV                  *vk.Pipeline // nil without cooperative matrices
	tensor                              bool
	poison                              bool // tests: fill the outputs with kmeansPoison first
	// Scratch kept from one clustering to the next (grown as needed):
	// changed counts per step and head, scatter cursors, the centroids as
	// fp16 parts, and host memory that changed is copied to.
	changed, cursor, halves, readback *vk.Buffer
}

// KMeansOptions configure a clustering.
type KMeansOptions struct {
	AvgClusterSize int    // tokens per cluster on average; 0 = 16
	MaxIter        int    // at most this many assignment steps; 0 = 10
	Seed           uint64 // seeds KMeansSpanInit
	// Span, when positive, clusters the range within spans of Span tokens
	// (KMeansSpans: the last one may be shorter), each with its own
	// clusters and initial rows, so that the cost grows linearly with the
	// range; 0 (or a span ≥ the range) clusters the whole range at once,
	// whose cost grows with its square. KMeansDefaultSpan is the
	// recommended span. Either way the result is one index over the whole
	// range: span s's clusters follow span s−1's.
	Span int
	// Stages, when not nil, receives the GPU time of each kind of step
	// (timestamp queries around every dispatch), summed over the steps.
	Stages *KMeansStages
}

// KMeansStages is the time a clustering spent in each kind of step.
type KMeansStages struct {
	Setup   time.Duration // host: buffers, bindings, recording (wall time)
	Init    time.Duration // initial centroids
	Assign  time.Duration // assignment steps
	Scan    time.Duration // prefix sums of the cluster sizes
	Scatter time.Duration // member lists
	Sort    time.Duration // member lists ordered
	Update  time.Duration // centroid updates
	GPU     time.Duration // the whole submission, first to last timestamp
}

// kmeansPoison is the word tests fill an index's outputs with before a
// clustering (a NaN as float32, an impossible token or start as uint32).
const kmeansPoison = 0x7FC0DEAD

// kmeansTensorWG is the cooperative-matrix assignment's workgroup: 8
// subgroups of 32 invocations, 32 tokens each.
const kmeansTensorWG = 256

// kmeansSortWG is the member sort's workgroup: one per cluster, which
// ranks up to 1024 members in shared memory and lists a larger cluster's
// members afresh from the assignment, in token order.
const kmeansSortWG = 64

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
		{&km.assign, vk.Kernel{Name: "kmeans_assign", Bindings: 6, PushWords: 7, Specialization: []uint32{uint32(dim), uint32(bk)}}},
		{&km.scan, vk.Kernel{Name: "kmeans_scan", Bindings: 4, PushWords: 4}},
		{&km.scatter, vk.Kernel{Name: "kmeans_scatter", Bindings: 4, PushWords: 5}},
		{&km.sort, vk.Kernel{Name: "kmeans_sort", Bindings: 5, PushWords: 6, Specialization: []uint32{kmeansSortWG}}},
		{&km.update, vk.Kernel{Name: "kmeans_update", Bindings: 8, PushWords: 8, Specialization: []uint32{uint32(dim), uint32(dim / 2), 0}}},
	}
	info := dev.Info()
	if info.CooperativeMatrixNV && info.SubgroupSize == 32 && info.SubgroupShuffle && info.Storage16Bit && info.Float16 &&
		dim%16 == 0 && dim <= 128 && info.MaxWorkgroupInvocations >= kmeansTensorWG {
		kernels = append(kernels,
			struct {
				p **vk.Pipeline
				k vk.Kernel
			}{&km.assignNV, vk.Kernel{Name: "kmeans_assign_nv", Bindings: 6, PushWords: 7, Specialization: []uint32{uint32(dim), kmeansTensorWG}}},
			struct {
				p **vk.Pipeline
				k vk.Kernel
			}{&km.updateNV, vk.Kernel{Name: "kmeans_update", Bindings: 8, PushWords: 8, Specialization: []uint32{uint32(dim), uint32(dim / 2), 1}}})
	}
	for i, x := range kernels {
		code, err := shaders.SPIRV(x.k.Name)
		if err == nil {
			x.k.SPIRV = code
			*x.p, err = dev.NewPipeline(x.k)
		}
		if err != nil && i >= 5 {
			// The tensor path is an option: without it, the float32 path.
			km.releaseTensor()
			break
		}
		if err != nil {
			return nil, errors.Join(err, km.release())
		}
	}
	km.tensor = km.assignNV != nil && km.updateNV != nil
	return km, nil
}

func (km *KMeans) releaseTensor() error {
	err := releaseAll(km.assignNV, km.updateNV)
	km.assignNV, km.updateNV = nil, nil
	return err
}

// Tensor reports whether assignment steps run on cooperative matrices.
func (km *KMeans) Tensor() bool { return km.tensor }

// SetTensor chooses the cooperative-matrix assignment (where the device has
// it) or the float32 one; it reports the choice in effect.
func (km *KMeans) SetTensor(on bool) bool {
	km.tensor = on && km.assignNV != nil && km.updateNV != nil
	return km.tensor
}

// Release destroys the kernels and the scratch buffers.
func (km *KMeans) Release() error {
	if km.scan == nil {
		return vk.ErrReleased
	}
	return km.release()
}

// release destroys whatever kernels and scratch buffers km holds.
func (km *KMeans) release() error {
	err := errors.Join(releaseAll(km.assign, km.scan, km.scatter, km.sort, km.update), km.releaseTensor(),
		releaseAll(km.changed, km.cursor, km.halves, km.readback))
	km.assign, km.scan, km.scatter, km.sort, km.update = nil, nil, nil, nil, nil
	km.changed, km.cursor, km.halves, km.readback = nil, nil, nil, nil
	return err
}

// scratch returns *b, replaced by a new buffer when smaller than size.
func (km *KMeans) scratch(b **vk.Buffer, size uint64, kind vk.Memory) (*vk.Buffer, error) {
	if *b != nil && (*b).Size() >= size {
		return *b, nil
	}
	if *b != nil {
		err := (*b).Release()
		*b = nil
		if err != nil {
			return nil, err
		}
	}
	nb, err := km.dev.NewBuffer(size, kind)
	if err != nil {
		return nil, err
	}
	*b = nb
	return nb, nil
}

// Cluster clusters tokens [first, first+count) of every KV head of layer:
// within the spans KMeansSpans(count, Span, AvgClusterSize), into
// KMeansClusterCount(span's tokens, AvgClusterSize) clusters each (with
// Span 0, KMeansClusterCount(count, AvgClusterSize) clusters over the whole
// range). All steps run in one submission; a span whose assignment changed
// nothing skips the rest (its result stays what it would be), and the host
// learns the number of steps at the end: Iterations is the most any span
// ran.
func (km *KMeans) Cluster(layer *kvcache.Layer, first, count int, opts KMeansOptions) (*kvcache.Clusters, error) {
	if km.scan == nil {
		return nil, vk.ErrReleased
	}
	start := time.Now()
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
	case opts.MaxIter < 0 || opts.AvgClusterSize < 0 || opts.Span < 0:
		return nil, fmt.Errorf("sparse: KMeansOptions %+v", opts)
	}
	spans, err := KMeansSpans(count, opts.Span, opts.AvgClusterSize)
	if err != nil {
		return nil, err
	}
	init, err := KMeansSpanInit(spans, opts.Seed)
	if err != nil {
		return nil, err
	}
	x, err := kvcache.NewClusters(km.dev, km.kvHeads, km.dim, len(init), first, count)
	if err != nil {
		return nil, err
	}
	if err := km.run(layer, x, init, spans[0].Count, spans[0].Clusters, len(spans), opts.MaxIter, start, opts.Stages); err != nil {
		return nil, errors.Join(err, x.Release())
	}
	return x, nil
}

// run clusters x's tokens from the initial rows init (relative to
// x.First) within spans of span tokens with spanClusters clusters each
// (but the last of the spans).
func (km *KMeans) run(layer *kvcache.Layer, x *kvcache.Clusters, init []int, span, spanClusters, spans, maxIter int, start time.Time, stages *KMeansStages) error {
	dev, h, c, n := km.dev, km.kvHeads, x.C, x.Count
	tensor := km.tensor && n >= 16
	headWords := uint32(layer.HeadBytes() / 4)
	// The initial centroids are the update of one-member clusters: cluster
	// j's member is token First+init[j], listed at the start of Members.
	rows := make([]uint32, c)
	for j, r := range init {
		rows[j] = uint32(x.First + r)
	}
	// Tokens that changed cluster, per step, head and span.
	changedBytes := uint64(4 * h * spans * maxIter)
	changed, err := km.scratch(&km.changed, changedBytes, vk.DeviceLocal)
	if err != nil {
		return err
	}
	readback, err := km.scratch(&km.readback, changedBytes, vk.HostVisible)
	if err != nil {
		return err
	}
	cursor, err := km.scratch(&km.cursor, uint64(4*h*c), vk.DeviceLocal)
	if err != nil {
		return err
	}
	halves := x.Norms // bound but unused by the float32 path
	if tensor {
		if halves, err = km.scratch(&km.halves, uint64(4*h*c*km.dim), vk.DeviceLocal); err != nil {
			return err
		}
	}

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
	assign, update := km.assign, km.update
	var bAssign *vk.Binding
	if tensor {
		assign, update = km.assignNV, km.updateNV
		bAssign = bind(assign, keys, halves.All(), x.Norms.All(), x.Assign.All(), x.Counts.All(), changed.All())
	} else {
		bAssign = bind(assign, keys, x.Centroids.All(), x.Norms.All(), x.Assign.All(), x.Counts.All(), changed.All())
	}
	bScan := bind(km.scan, x.Counts.All(), x.Starts.All(), cursor.All(), changed.All())
	bScatter := bind(km.scatter, x.Assign.All(), cursor.All(), x.Members.All(), changed.All())
	bSort := bind(km.sort, x.Starts.All(), x.Counts.All(), x.Members.All(), changed.All(), x.Assign.All())
	bUpdate := bind(update, keys, x.Starts.All(), x.Counts.All(), x.Members.All(), x.Centroids.All(), x.Norms.All(), changed.All(), halves.All())
	if err != nil {
		return err
	}
	var ts *vk.Timestamps
	if stages != nil {
		if ts, err = dev.NewTimestamps(2 + 5*maxIter); err != nil {
			return err
		}
		defer ts.Release()
	}
	hh, cc, nn, first := uint32(h), uint32(c), uint32(n), uint32(x.First)
	ss, cs := uint32(span), uint32(spanClusters)
	// The assignment's workgroups each take tokens of one span.
	assignGroups := uint32(spans * ceilDiv(span, 128))
	if tensor {
		assignGroups = uint32(spans * ceilDiv(span, kmeansTensorWG))
	}
	sortGroups := uint32(min(c, 65535)) // one workgroup per cluster, striding beyond
	stamp := 0
	record := func(cmd *vk.Commands) {
		if ts == nil {
			return
		}
		cmd.Timestamp(ts, stamp)
		stamp++
	}
	err = dev.Run(func(cmd *vk.Commands) {
		if ts != nil {
			cmd.Reset(ts)
		}
		if km.poison {
			// Tests: whatever the clustering leaves unwritten shows.
			for _, b := range []*vk.Buffer{x.Centroids, x.Norms, x.Starts, x.Members} {
				cmd.Fill(b.All(), kmeansPoison)
			}
			cmd.Barrier()
		}
		cmd.Update(x.Members.All(), rows)
		cmd.Fill(x.Assign.All(), math.MaxUint32)
		cmd.Fill(x.Counts.All(), 0)
		cmd.Fill(changed.All(), 0)
		cmd.Barrier()
		record(cmd)
		cmd.Dispatch(update, bUpdate, []uint32{nn, headWords, cc, 0, 1, 0, ss, cs}, cc, hh, 1)
		cmd.Barrier()
		record(cmd)
		for it := uint32(0); it < uint32(maxIter); it++ {
			cmd.Dispatch(assign, bAssign, []uint32{nn, first, headWords, cc, it, ss, cs}, assignGroups, hh, 1)
			cmd.Barrier()
			record(cmd)
			cmd.Dispatch(km.scan, bScan, []uint32{cc, it, ss, cs}, uint32(spans), hh, 1)
			cmd.Barrier()
			record(cmd)
			cmd.Dispatch(km.scatter, bScatter, []uint32{nn, first, cc, it, ss}, uint32(ceilDiv(n, 256)), hh, 1)
			cmd.Barrier()
			record(cmd)
			cmd.Dispatch(km.sort, bSort, []uint32{nn, cc, it, first, ss, cs}, sortGroups, hh, 1)
			cmd.Barrier()
			record(cmd)
			zero := uint32(0)
			if int(it) < maxIter-1 {
				zero = 1 // the next assignment counts afresh
			}
			cmd.Dispatch(update, bUpdate, []uint32{nn, headWords, cc, it, 0, zero, ss, cs}, cc, hh, 1)
			cmd.Barrier()
			record(cmd)
		}
		cmd.Copy(changed.Slice(0, changedBytes), readback.Slice(0, changedBytes))
		if stages != nil {
			stages.Setup = time.Since(start)
		}
	})
	if err != nil {
		return err
	}
	got := make([]uint32, h*spans*maxIter)
	if err := readback.ReadUint32(0, got); err != nil {
		return err
	}
	// Steps run: up to the first in which no span of any head changed.
	x.Iterations = maxIter
	for it := 0; it < maxIter; it++ {
		moved := false
		for _, m := range got[it*h*spans : (it+1)*h*spans] {
			moved = moved || m > 0
		}
		if !moved {
			x.Iterations = it + 1
			break
		}
	}
	if ts != nil {
		d, err := ts.Durations(stamp)
		if err != nil {
			return err
		}
		stages.Init = d[1]
		for it := 0; it < maxIter; it++ {
			b := 1 + 5*it
			stages.Assign += d[b+1]
			stages.Scan += d[b+2]
			stages.Scatter += d[b+3]
			stages.Sort += d[b+4]
			stages.Update += d[b+5]
		}
		stages.GPU, err = ts.Elapsed(0, stamp-1)
		if err != nil {
			return err
		}
	}
	return nil
}
