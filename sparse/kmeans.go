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

// resolved returns o with its zero cluster size and steps set to the
// defaults, and refuses negative ones.
func (o KMeansOptions) resolved() (KMeansOptions, error) {
	if o.AvgClusterSize == 0 {
		o.AvgClusterSize = KMeansDefaultAvgClusterSize
	}
	if o.MaxIter == 0 {
		o.MaxIter = KMeansDefaultIters
	}
	if o.MaxIter < 0 || o.AvgClusterSize < 0 || o.Span < 0 {
		return o, fmt.Errorf("sparse: KMeansOptions %+v", o)
	}
	return o, nil
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

// NewKMeans compiles the clustering kernels for kvHeads heads of dim, and
// the cache's kernel that stores a clustered range in cluster order
// (kvcache.PrepareReorder).
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
	// Every clustering of a policy is stored in cluster order next.
	if err := kvcache.PrepareReorder(dev, dim); err != nil {
		return nil, errors.Join(err, km.release())
	}
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

// tensorFor reports whether a clustering of n tokens takes the tensor
// path.
func (km *KMeans) tensorFor(n int) bool { return km.tensor && n >= 16 }

// Reserve allocates the scratch that clustering count tokens with opts
// takes, so that the first Cluster of up to that size allocates only its
// index: on an NVIDIA H200 the first clustering of a 131 072-token layer
// spent 6 ms of its 16 allocating that scratch. Clusterings keep and reuse
// it either way, growing it for a larger one.
func (km *KMeans) Reserve(count int, opts KMeansOptions) error {
	if km.scan == nil {
		return vk.ErrReleased
	}
	opts, err := opts.resolved()
	if err != nil {
		return err
	}
	spans, err := KMeansSpans(count, opts.Span, opts.AvgClusterSize)
	if err != nil {
		return err
	}
	last := spans[len(spans)-1]
	_, err = km.runScratch(last.FirstCluster+last.Clusters, len(spans), opts.MaxIter, km.tensorFor(count), nil)
	return err
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
	opts, err := opts.resolved()
	if err != nil {
		return nil, err
	}
	switch {
	case layer.KVHeads() != km.kvHeads || layer.HeadDim() != km.dim:
		return nil, fmt.Errorf("sparse: KMeans built for %d heads of %d, layer has %d of %d", km.kvHeads, km.dim, layer.KVHeads(), layer.HeadDim())
	case first < 0 || count <= 0 || first+count > layer.Len():
		return nil, fmt.Errorf("sparse: clustering tokens [%d, %d) of a cache of %d", first, first+count, layer.Len())
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
func (km *KMeans) run(layer *kvcache.Layer, x *kvcache.Clusters, init []int, span, spanClusters, spans, maxIter int, start time.Time, stages *KMeansStages) (err error) {
	dev, h, c, n := km.dev, km.kvHeads, x.C, x.Count
	tensor := km.tensorFor(n)
	// The initial centroids are the update of one-member clusters: cluster
	// j's member is token First+init[j], listed at the start of Members.
	rows := make([]uint32, c)
	for j, r := range init {
		rows[j] = uint32(x.First + r)
	}
	sc, err := km.runScratch(c, spans, maxIter, tensor, x)
	if err != nil {
		return err
	}
	k, err := km.bindRun(layer, x, sc, tensor)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, k.release()) }()
	var ts *vk.Timestamps
	if stages != nil {
		if ts, err = dev.NewTimestamps(2 + 5*maxIter); err != nil {
			return err
		}
		defer func() { err = errors.Join(err, ts.Release()) }()
	}
	shape := kmeansShape{
		h: uint32(h), c: uint32(c), n: uint32(n), first: uint32(x.First), headWords: uint32(layer.HeadBytes() / 4),
		span: uint32(span), spanClusters: uint32(spanClusters), spans: uint32(spans), maxIter: maxIter,
		assignGroups: uint32(spans * ceilDiv(span, 128)),
		sortGroups:   uint32(min(c, 65535)), // one workgroup per cluster, striding beyond
	}
	if tensor {
		shape.assignGroups = uint32(spans * ceilDiv(span, kmeansTensorWG)) // each takes tokens of one span
	}
	stamp := 0
	err = dev.Run(func(cmd *vk.Commands) {
		stamp = km.record(cmd, x, rows, sc, k, shape, ts)
		if stages != nil {
			stages.Setup = time.Since(start)
		}
	})
	if err != nil {
		return err
	}
	got := make([]uint32, h*spans*maxIter)
	if err := sc.readback.ReadUint32(0, got); err != nil {
		return err
	}
	x.Iterations = iterationsRun(got, h*spans, maxIter)
	if ts != nil {
		return stages.add(ts, stamp, maxIter)
	}
	return nil
}

// kmeansScratch is the scratch of a clustering: the tokens that changed
// cluster per step, head and span (on the device and read back), each
// cluster's cursor for the scatter, and the fp16 centroids of the tensor
// path (the index's norms, bound but unused, on the float32 path).
type kmeansScratch struct {
	changed, readback, cursor, halves *vk.Buffer
	changedBytes                      uint64
}

// runScratch returns the scratch of a clustering of c clusters a head in
// spans spans, for at most maxIter steps, from km's kept buffers (grown
// where smaller); the float32 path binds x's norms in place of the fp16
// centroids (x may be nil where only the buffers are wanted).
func (km *KMeans) runScratch(c, spans, maxIter int, tensor bool, x *kvcache.Clusters) (kmeansScratch, error) {
	h := km.kvHeads
	sc := kmeansScratch{changedBytes: uint64(4 * h * spans * maxIter)}
	if x != nil {
		sc.halves = x.Norms
	}
	var err error
	if sc.changed, err = km.scratch(&km.changed, sc.changedBytes, vk.DeviceLocal); err != nil {
		return sc, err
	}
	if sc.readback, err = km.scratch(&km.readback, sc.changedBytes, vk.HostVisible); err != nil {
		return sc, err
	}
	if sc.cursor, err = km.scratch(&km.cursor, uint64(4*h*c), vk.DeviceLocal); err != nil {
		return sc, err
	}
	if tensor {
		sc.halves, err = km.scratch(&km.halves, uint64(4*h*c*km.dim), vk.DeviceLocal)
	}
	return sc, err
}

// kmeansBound is the clustering's kernels bound to one index: the
// assignment and update of the path in use, the scan, scatter and sort.
type kmeansBound struct {
	assign, update                           *vk.Pipeline
	bAssign, bScan, bScatter, bSort, bUpdate *vk.Binding
}

// release frees the bindings.
func (k *kmeansBound) release() error {
	return releaseAll(k.bAssign, k.bScan, k.bScatter, k.bSort, k.bUpdate)
}

// bindRun binds the kernels of the path in use (tensor or float32) to
// layer's keys, the index x and the scratch.
func (km *KMeans) bindRun(layer *kvcache.Layer, x *kvcache.Clusters, sc kmeansScratch, tensor bool) (*kmeansBound, error) {
	var err error
	bind := func(p *vk.Pipeline, r ...vk.Range) *vk.Binding {
		if err != nil {
			return nil
		}
		var b *vk.Binding
		b, err = p.Bind(r...)
		return b
	}
	keys, changed := layer.Keys().All(), sc.changed.All()
	k := &kmeansBound{assign: km.assign, update: km.update}
	if tensor {
		k.assign, k.update = km.assignNV, km.updateNV
		k.bAssign = bind(k.assign, keys, sc.halves.All(), x.Norms.All(), x.Assign.All(), x.Counts.All(), changed)
	} else {
		k.bAssign = bind(k.assign, keys, x.Centroids.All(), x.Norms.All(), x.Assign.All(), x.Counts.All(), changed)
	}
	k.bScan = bind(km.scan, x.Counts.All(), x.Starts.All(), sc.cursor.All(), changed)
	k.bScatter = bind(km.scatter, x.Assign.All(), sc.cursor.All(), x.Members.All(), changed)
	k.bSort = bind(km.sort, x.Starts.All(), x.Counts.All(), x.Members.All(), changed, x.Assign.All())
	k.bUpdate = bind(k.update, keys, x.Starts.All(), x.Counts.All(), x.Members.All(), x.Centroids.All(), x.Norms.All(), changed, sc.halves.All())
	if err != nil {
		return nil, errors.Join(err, k.release())
	}
	return k, nil
}

// kmeansShape is the push constants and grid sizes of a clustering's
// dispatches.
type kmeansShape struct {
	h, c, n, first, headWords uint32
	span, spanClusters, spans uint32
	assignGroups, sortGroups  uint32
	maxIter                   int
}

// record appends a whole clustering to cmd: the outputs cleared (poisoned
// first in tests), the initial centroids as the update of the one-member
// clusters of rows, then maxIter steps of assignment, scan, scatter, sort
// and update, each behind a barrier, and the changed counts copied for
// reading back. With ts, it writes a timestamp after the initial update
// and after every dispatch, and returns the timestamps written.
func (km *KMeans) record(cmd *vk.Commands, x *kvcache.Clusters, rows []uint32, sc kmeansScratch, k *kmeansBound, s kmeansShape, ts *vk.Timestamps) int {
	stamp := 0
	mark := func() {
		if ts != nil {
			cmd.Timestamp(ts, stamp)
			stamp++
		}
	}
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
	cmd.Fill(sc.changed.All(), 0)
	cmd.Barrier()
	mark()
	cmd.Dispatch(k.update, k.bUpdate, []uint32{s.n, s.headWords, s.c, 0, 1, 0, s.span, s.spanClusters}, s.c, s.h, 1)
	cmd.Barrier()
	mark()
	for it := uint32(0); it < uint32(s.maxIter); it++ {
		cmd.Dispatch(k.assign, k.bAssign, []uint32{s.n, s.first, s.headWords, s.c, it, s.span, s.spanClusters}, s.assignGroups, s.h, 1)
		cmd.Barrier()
		mark()
		cmd.Dispatch(km.scan, k.bScan, []uint32{s.c, it, s.span, s.spanClusters}, s.spans, s.h, 1)
		cmd.Barrier()
		mark()
		cmd.Dispatch(km.scatter, k.bScatter, []uint32{s.n, s.first, s.c, it, s.span}, uint32(ceilDiv(int(s.n), 256)), s.h, 1)
		cmd.Barrier()
		mark()
		cmd.Dispatch(km.sort, k.bSort, []uint32{s.n, s.c, it, s.first, s.span, s.spanClusters}, s.sortGroups, s.h, 1)
		cmd.Barrier()
		mark()
		zero := uint32(0)
		if int(it) < s.maxIter-1 {
			zero = 1 // the next assignment counts afresh
		}
		cmd.Dispatch(k.update, k.bUpdate, []uint32{s.n, s.headWords, s.c, it, 0, zero, s.span, s.spanClusters}, s.c, s.h, 1)
		cmd.Barrier()
		mark()
	}
	cmd.Copy(sc.changed.Slice(0, sc.changedBytes), sc.readback.Slice(0, sc.changedBytes))
	return stamp
}

// iterationsRun returns the steps a clustering ran, from the tokens that
// changed cluster per step for each of its groups (heads × spans): up to
// the first step in which none changed, else maxIter.
func iterationsRun(changed []uint32, groups, maxIter int) int {
	for it := 0; it < maxIter; it++ {
		moved := false
		for _, m := range changed[it*groups : (it+1)*groups] {
			moved = moved || m > 0
		}
		if !moved {
			return it + 1
		}
	}
	return maxIter
}

// add adds the stages' GPU times from the stamp timestamps of a
// clustering of maxIter steps (KMeans.record) and sets GPU to the whole.
func (st *KMeansStages) add(ts *vk.Timestamps, stamp, maxIter int) error {
	d, err := ts.Durations(stamp)
	if err != nil {
		return err
	}
	st.Init = d[1]
	for it := 0; it < maxIter; it++ {
		b := 1 + 5*it
		st.Assign += d[b+1]
		st.Scan += d[b+2]
		st.Scatter += d[b+3]
		st.Sort += d[b+4]
		st.Update += d[b+5]
	}
	st.GPU, err = ts.Elapsed(0, stamp-1)
	return err
}
