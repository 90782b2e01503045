package sparse

import (
	"errors"
	"fmt"
	"sort"
	"time"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/shaders"
	"github.com/vksparse/vksparse/vk"
)

// Dense is dense split-K decode attention in one dispatch: every chunk of
// tokens of every KV head is one workgroup per block of its query heads
// (up to 8; defaultGroup), which reads each K/V row once for the block and
// writes the chunk's partial softmax (max, sum and unnormalised output per
// query head); the last workgroup of each head block to finish merges the
// chunks' partials into the output.
type Dense struct {
	dev   *vk.Device
	heads Heads
	denseShape
	partial   *vk.Pipeline
	gather    *vk.Pipeline // attend_partial reading rows through token lists
	clustered *vk.Pipeline // attend_partial over taken clusters; nil where shared memory is short
	// Other specializations (pseudo-tokens, logits, single tokens) are
	// built on first use (variant).
	code []byte      // attend_partial's SPIR-V
	spec partialSpec // its specialization for dense attention
	// clusterSpec is its specialization for attention over clusters, with
	// tiles and score slots of its own.
	clusterSpec partialSpec
	// ChunkTokens fixes the tokens per chunk; 0 picks it from the sizes.
	ChunkTokens int
	opts        DenseOptions
	gatherMin   int // least tokens per chunk of gathered attention
	// kernels holds the selection kernels of every selector made from
	// this Dense, compiled once.
	kernels kernelCache
}

// DenseOptions tune the dense kernels; zero values pick for the device.
type DenseOptions struct {
	// ThreadsPerRow is how many threads share one K row in the score pass
	// (a power of two dividing Dim/8; above 1 it needs subgroup shuffles).
	ThreadsPerRow int
	// TreeReduce reduces through shared memory even where subgroup
	// arithmetic is available.
	TreeReduce bool
	// Workgroup is the threads per workgroup (a power of two); 0 = 256.
	Workgroup int
	// Tile is how many tokens a workgroup scores at once (the shared score
	// buffer holds group × Tile floats); 0 = 4096 / group.
	Tile int
	// Unroll is how many value rows a thread loads at once; 0 = 8.
	Unroll int
	// RowsPerThread is how many K rows a thread scores at once, each q
	// value read from shared memory serving all of them; 0 = chosen with
	// ThreadsPerRow, or 1 where ThreadsPerRow is set.
	RowsPerThread int
	// ClusterChunk is the clusters of a KV head that one workgroup of
	// attention over clusters takes; 0 = chosen from the index's size and
	// the sequences of a batch (clusterRun).
	ClusterChunk int
	// ClusterWindow is the clusters such a workgroup scans at once (a
	// power of two, at most Workgroup); 0 = chosen.
	ClusterWindow int
	// ClusterTile is how many tokens such a workgroup scores at once; 0 =
	// Tile where that is set, else 3584 / group.
	ClusterTile int
	// Group is the query heads of a KV head that one workgroup attends
	// for (a divisor of the GQA group, at most 8); 0 = defaultGroup's.
	Group int
	// Scores is how the selectors built on this Dense score centroids;
	// 0 = ScoresAuto.
	Scores ScoreKernel
}

// ScoreKernel is how selectors score 8-bit centroids.
type ScoreKernel int

const (
	// ScoresAuto takes integer dot products where the device accelerates
	// them (vk.Info.IntegerDotFast), float products elsewhere.
	ScoresAuto ScoreKernel = iota
	// ScoresFloat turns every code into a float and multiplies
	// (centroid_score, CentroidScoresRef).
	ScoresFloat
	// ScoresIntegerDot holds each query in two bytes and takes integer
	// dot products of four bytes (centroid_score_dot, CentroidScoresDotRef);
	// it needs vk.Info.IntegerDot and head dimensions of at most 512.
	ScoresIntegerDot
)

func boolWord(b bool) uint32 {
	if b {
		return 1
	}
	return 0
}

// Limits of the dense kernels.
const (
	denseWorkgroup   = 256
	scoreBudget      = 4096 // default shared floats for scores: group × tile
	defaultMaxChunk  = 512  // chunk slots per (sequence, head)
	targetWorkgroups = 512
	gatherChunkMin   = 512 // least tokens per chunk of gathered attention
	gatherWorkgroups = 256 // workgroups of gathered attention over long lists
	clusterChunkMin  = 64  // least clusters per chunk of attention over clusters
	// Clusters a workgroup of attention over clusters scans at once (at
	// most its threads), and tokens per tile there for groups of 4: on the
	// H100 at 131 072 tokens a run of 256 clusters scanned in one window
	// started its tiles about 5 µs sooner than in four windows of 64, and
	// tiles of 896 keep its shared memory small enough for two workgroups
	// per SM (with tiles of 1 024 a window of 256 took a second wave):
	// Tactic's attention 43.0 → 38.6 µs (llama), 53.0 → 50.7 (megabeam),
	// unchanged at 32 768 tokens (tiles of 768: 39.3 and 50.7).
	clusterWindow      = 256
	clusterScoreBudget = 3584 // default shared floats for scores there: group × tile
	// Workgroups of attention over many clusters: runs of 256 clusters at
	// 131 072 tokens and 64 at 32 768. On the H100 with the layer in
	// cluster order and the merge in the same dispatch, unions of 8–11 %
	// of 131 072 tokens took 37–47 µs so against 60–67 µs with 1 024
	// workgroups (runs of 64); at 32 768 runs of 64 stay best.
	clusterWorkgroups = 256
	// Sequences of a batch beyond which each one's attention over clusters
	// takes proportionally fewer, longer runs (clusterRun).
	clusterBatchSequences = 2
	// Clusters each thread of attention over single tokens decides per
	// window (attend_partial's UNIT): the ranks of its clusters for up to 8
	// query heads load together, so a window of a run costs one round
	// trip to memory for window·unitClusters tokens.
	unitClusters = 4
)

// NewDense compiles the dense attention kernels for heads.
func NewDense(dev *vk.Device, heads Heads) (*Dense, error) {
	return NewDenseWith(dev, heads, DenseOptions{})
}

// threadsPerRow picks how many threads share a K row: 8 where the subgroup
// can sum their partial products with shuffles, fewer where the head
// dimension or the subgroup do not allow 8, 1 without shuffles.
func threadsPerRow(info vk.Info, dim int) int {
	tpr := 8
	for tpr > 1 && ((dim/8)%tpr != 0 || !info.SubgroupShuffle || info.SubgroupSize%uint32(tpr) != 0) {
		tpr /= 2
	}
	return tpr
}

// defaultGroup returns the query heads a workgroup attends for in GQA
// groups of n: the largest divisor of n up to 4, or where that is 1, up to
// 8. A thread accumulates the output of every head of its workgroup, so
// that 8 heads take 210 registers a thread where 4 take 128: on the H100
// (64 query heads over 8 KV heads, D 128) dense attention took 100.6 µs at
// 32 768 tokens and 304 µs at 131 072 with workgroups of 8 heads (one an
// SM) against 72.2 and 244.5 with two workgroups of 4 reading the same
// rows; blocks of 2 were slower than of 4 (85.0 and 304.5 µs there, and
// 58.5 against 56.2, 207.6 against 188.9 for groups of 4).
func defaultGroup(n int) int {
	for _, most := range []int{4, 8} {
		for g := min(n, most); g > 1; g-- {
			if n%g == 0 {
				return g
			}
		}
	}
	return 1
}

// rowsPerThread picks how many K rows a thread scores at once for tpr
// threads per row: tpr/2, at least 1. On the NVIDIA H200 at 131 072 tokens
// (Hq 32, Hkv 8, D 128), 8 threads with 4 rows each took 161 µs, 4 with 2
// took 181, and 2 with 1 took 195.
func rowsPerThread(tpr int) int { return max(tpr/2, 1) }

// NewDenseWith compiles the dense attention kernels with explicit options.
func NewDenseWith(dev *vk.Device, heads Heads, opts DenseOptions) (*Dense, error) {
	if err := heads.Validate(); err != nil {
		return nil, err
	}
	info := dev.Info()
	shape, err := resolveShape(info, heads.Dim, heads.Group(), opts)
	if err != nil {
		return nil, err
	}
	if err := shape.fits(info, heads.Dim); err != nil {
		return nil, err
	}
	d := &Dense{dev: dev, heads: heads, denseShape: shape, opts: opts, gatherMin: gatherChunkMin}
	if d.code, err = shaders.SPIRV("attend_partial"); err != nil {
		return nil, err
	}
	d.spec, d.clusterSpec = shape.specs(heads.Dim)
	if err := d.compile(shape.clusterSharedBytes(heads.Dim) <= int(info.SharedMemoryBytes)); err != nil {
		return nil, errors.Join(err, d.Release())
	}
	return d, nil
}

// denseShape is how the dense kernels divide their work, every option
// resolved for a device and a head geometry.
type denseShape struct {
	group       int  // query heads per workgroup
	workgroup   int  // threads per workgroup
	tile        int  // tokens dense attention scores at once
	unroll      int  // value rows a thread loads at once
	tpr         int  // threads sharing a K row in the score pass
	rpt         int  // K rows each thread scores at once
	tree        bool // reductions through shared memory only
	window      int  // clusters scanned at once by attention over clusters
	clusterTile int  // tokens attention over clusters scores at once
	dotScores   bool // centroids scored by integer dot products
}

// resolveShape picks what opts leave at zero for heads of dimension dim
// in GQA groups of groupSize, and refuses what the device or the kernel
// cannot run.
func resolveShape(info vk.Info, dim, groupSize int, opts DenseOptions) (denseShape, error) {
	s := denseShape{tpr: opts.ThreadsPerRow, group: opts.Group, workgroup: opts.Workgroup, tile: opts.Tile, unroll: max(opts.Unroll, 0),
		rpt: opts.RowsPerThread, window: opts.ClusterWindow, clusterTile: opts.ClusterTile}
	if s.tpr == 0 {
		s.tpr = threadsPerRow(info, dim)
	}
	if s.tpr&(s.tpr-1) != 0 || (dim/8)%s.tpr != 0 || (s.tpr > 1 && (!info.SubgroupShuffle || info.SubgroupSize%uint32(s.tpr) != 0)) {
		return s, fmt.Errorf("%w: %d threads per row with head dimension %d on a device with subgroups of %d (shuffle %v)", vk.ErrUnsupported, s.tpr, dim, info.SubgroupSize, info.SubgroupShuffle)
	}
	if s.group == 0 {
		s.group = defaultGroup(groupSize)
	}
	if s.group < 1 || s.group > 8 || groupSize%s.group != 0 {
		return s, fmt.Errorf("%w: %d query heads per workgroup for groups of %d (a divisor, at most 8)", vk.ErrUnsupported, s.group, groupSize)
	}
	switch opts.Scores {
	case ScoresAuto:
		s.dotScores = scoresByDot(info, dim)
	case ScoresFloat:
	case ScoresIntegerDot:
		if !info.IntegerDot || dim > maxDotDim {
			return s, fmt.Errorf("%w: centroid scores by integer dot products with head dimension %d (at most %d) on %s (integer dot products: %v)", vk.ErrUnsupported, dim, maxDotDim, info.Name, info.IntegerDot)
		}
		s.dotScores = true
	default:
		return s, fmt.Errorf("sparse: DenseOptions.Scores %d is not a ScoreKernel", opts.Scores)
	}
	if s.workgroup == 0 {
		s.workgroup = min(denseWorkgroup, int(info.MaxWorkgroupInvocations))
	}
	if s.tile == 0 {
		s.tile = scoreBudget / s.group
	}
	if s.unroll == 0 {
		s.unroll = 8
	}
	if s.rpt == 0 {
		s.rpt = 1
		if opts.ThreadsPerRow == 0 {
			s.rpt = rowsPerThread(s.tpr)
		}
	}
	if s.rpt < 1 || s.rpt > 8 {
		return s, fmt.Errorf("%w: %d rows per thread (at most 8)", vk.ErrUnsupported, s.rpt)
	}
	if s.window == 0 {
		s.window = min(s.workgroup, clusterWindow)
	}
	if s.clusterTile == 0 {
		s.clusterTile = opts.Tile
	}
	if s.clusterTile == 0 {
		s.clusterTile = clusterScoreBudget / s.group
	}
	if opts.ClusterChunk < 0 || s.window&(s.window-1) != 0 || s.window > s.workgroup || s.window < 1 || s.clusterTile < 1 {
		return s, fmt.Errorf("sparse: %d clusters per chunk, %d per window, tiles of %d, for workgroups of %d", opts.ClusterChunk, opts.ClusterWindow, s.clusterTile, s.workgroup)
	}
	s.tree = !info.SubgroupArithmetic || info.SubgroupSize < 4 || opts.TreeReduce
	return s, nil
}

// reduceSlots returns attend_partial's shared floats for reductions: one
// per thread and head with the tree, one per subgroup (of at least 4
// threads) and head with subgroup arithmetic.
func (s denseShape) reduceSlots() int {
	if s.tree {
		return s.group * s.workgroup
	}
	return s.group * s.workgroup / 4
}

// scoreSlots returns attend_partial's shared floats for the scores of
// tiles of t tokens, at least 8 a thread (its final sums reuse them).
func (s denseShape) scoreSlots(t int) int { return max(s.group*t, 8*s.workgroup) }

// sharedBytes returns attend_partial's shared memory for tiles of t
// tokens, without the arrays of attention over clusters: queries, scores
// and reductions.
func (s denseShape) sharedBytes(dim, t int) int {
	return 4 * (s.group*dim + s.scoreSlots(t) + s.reduceSlots())
}

// clusterSharedBytes returns the shared memory of attention over
// clusters: sharedBytes for its tiles, and a tile's token ids, a window's
// member offsets and prefix sums, and the subgroup totals of their scan.
func (s denseShape) clusterSharedBytes(dim int) int {
	return s.sharedBytes(dim, s.clusterTile) + 4*(s.clusterTile+2*s.window+1+s.workgroup/4)
}

// fits refuses a workgroup size the device or the kernel cannot run, and
// dense tiles whose shared memory (with one word for each array of
// attention over clusters) exceeds the device's.
func (s denseShape) fits(info vk.Info, dim int) error {
	shared := s.sharedBytes(dim, s.tile) + 4*5
	switch {
	case s.workgroup&(s.workgroup-1) != 0 || s.workgroup > int(info.MaxWorkgroupInvocations) || s.workgroup < dim/4 || s.workgroup < 32:
		return fmt.Errorf("%w: workgroup of %d threads (a power of two from %d to %d)", vk.ErrUnsupported, s.workgroup, max(32, dim/4), info.MaxWorkgroupInvocations)
	case s.tile <= 0 || shared > int(info.SharedMemoryBytes):
		return fmt.Errorf("%w: tiles of %d tokens need %d bytes of shared memory, device has %d", vk.ErrUnsupported, s.tile, shared, info.SharedMemoryBytes)
	}
	return nil
}

// specs returns attend_partial's specialization for dense attention and
// for attention over clusters (its own tiles and score slots).
func (s denseShape) specs(dim int) (dense, clusters partialSpec) {
	dense = partialSpec{
		Workgroup: uint32(s.workgroup), Dim: uint32(dim), Group: uint32(s.group), Tile: uint32(s.tile),
		ThreadsPerRow: uint32(s.tpr), SubgroupReduce: boolWord(!s.tree), Unroll: uint32(s.unroll),
		ScoreSlots: uint32(s.scoreSlots(s.tile)), ReduceSlots: uint32(s.reduceSlots()), Gather: gatherNone,
		RowsPerThread: uint32(s.rpt), Window: uint32(s.window),
	}
	clusters = dense
	clusters.Tile, clusters.ScoreSlots, clusters.Gather = uint32(s.clusterTile), uint32(s.scoreSlots(s.clusterTile)), gatherClusters
	return dense, clusters
}

// compile builds dense attention, attention over token lists and, with
// clusters, attention over clusters.
func (d *Dense) compile(clusters bool) error {
	var err error
	if d.partial, err = d.kernel("attend_partial", d.spec); err != nil {
		return err
	}
	lists := d.spec
	lists.Gather = gatherLists
	if d.gather, err = d.kernel("attend_partial (gather)", lists); err != nil {
		return err
	}
	if clusters {
		d.clustered, err = d.kernel("attend_partial (clusters)", d.clusterSpec)
	}
	return err
}

// variant returns attend_partial specialized by spec, compiled the first
// time a plan asks for it and kept with the selection kernels until
// Release.
func (d *Dense) variant(spec partialSpec) (*vk.Pipeline, error) {
	return d.kernels.get(d.dev, "attend_partial", partialBindings, partialPushWords, spec.words())
}

// kernel builds attend_partial specialized by spec.
func (d *Dense) kernel(name string, spec partialSpec) (*vk.Pipeline, error) {
	return d.dev.NewPipeline(vk.Kernel{Name: name, SPIRV: d.code, Bindings: partialBindings, PushWords: partialPushWords, Specialization: spec.words()})
}

// blocksPerKV returns the head blocks of a KV head: its query heads,
// group at a time.
func (d *Dense) blocksPerKV() int { return d.heads.Group() / d.group }

// headBlocks returns the head blocks of a sequence: each KV head's query
// heads, group at a time.
func (d *Dense) headBlocks() int { return d.heads.KV * d.blocksPerKV() }

// ThreadsPerRow returns how many threads share a K row in the score pass.
func (d *Dense) ThreadsPerRow() int { return d.tpr }

// Options returns the options the kernels were built with (zero: chosen).
func (d *Dense) Options() DenseOptions {
	o := d.opts
	o.ThreadsPerRow, o.TreeReduce, o.Workgroup, o.Tile, o.Group = d.tpr, d.tree, d.workgroup, d.tile, d.group
	if o.Unroll == 0 {
		o.Unroll = 8
	}
	o.RowsPerThread, o.ClusterWindow, o.ClusterTile = d.rpt, d.window, d.clusterTile
	return o
}

// TreeReduce reports whether reductions go through shared memory only.
func (d *Dense) TreeReduce() bool { return d.tree }

// Heads returns the geometry the kernels were built for.
func (d *Dense) Heads() Heads { return d.heads }

// Release destroys the kernels.
func (d *Dense) Release() error {
	var errs []error
	for _, p := range []*vk.Pipeline{d.partial, d.gather, d.clustered} {
		if p != nil {
			errs = append(errs, p.Release())
		}
	}
	errs = append(errs, d.kernels.release())
	return errors.Join(errs...)
}

// DensePlan holds the buffers and bindings that attend one batch of
// sequences; record it again after the sequences grow. Its mode decides
// which tokens it attends: every token of each sequence (Plan, PlanChunks,
// PlanLogits), one list of tokens per KV head (PlanGather) or a selection
// of clusters (PlanClusters, PlanSelection).
type DensePlan struct {
	d         *Dense
	mode      planMode // nil once released
	seqs      []*kvcache.Layer
	maxChunks int
	query     *vk.Buffer
	partO     *vk.Buffer // per chunk: unnormalised output, [B][Hq][maxChunks][D] float32
	partML    *vk.Buffer // per chunk: max and sum, [B][Hq][maxChunks][2] float32
	// parts is where the partials lie: partO and partML, or a workspace's
	// regions (Share; the plan's own buffers are then released).
	parts [2]vk.Range
	ws    *Workspace
	// arrivals counts, per sequence and head block of group query heads
	// ([B][Hq/group][2] uint32), the workgroups that have written their
	// partials and the rows their runs attended (Taken); the last one
	// merges them and sets both back to 0.
	arrivals *vk.Buffer
	// taken holds, per sequence and head block ([B][Hq/group] uint32,
	// host-visible), the members of clusters and pseudo-tokens the block
	// attended in the last attention over clusters.
	taken    *vk.Buffer
	out      *vk.Buffer
	outTo    vk.Range    // where the output goes instead of out (SetOutput); none when Buffer is nil
	segments [][]segment // per sequence: KV head ranges bound together
	clock    stopwatch
	// held: the plan holds its sequences and index (kvcache Hold), so
	// that they are not released under it.
	held bool
}

// planMode is what differs between a DensePlan's modes: the kernel and
// the buffers of its own that it binds, and its dispatches. The plan holds
// what they share: queries, partials, counters, output and bindings.
type planMode interface {
	// bindings sets the mode's buffers in b and returns the kernel of d
	// that reads them.
	bindings(d *Dense, b *partialBuffers) *vk.Pipeline
	// record appends p's attention to c, for a stage whose dispatches
	// sequences plans share.
	record(c *vk.Commands, p *DensePlan, sequences int) error
	// bytes returns the device memory of the mode's own buffers.
	bytes() uint64
	// release frees the mode's own buffers.
	release() error
}

type segment struct {
	kvBase, kvCount int
	bind            *vk.Binding
}

// newPlan makes a plan of mode over seqs with maxChunks chunk slots per
// sequence and head: its buffers, bindings and holds. On error it releases
// what it made, mode's buffers included.
func (d *Dense) newPlan(seqs []*kvcache.Layer, maxChunks int, mode planMode) (*DensePlan, error) {
	p := &DensePlan{d: d, mode: mode, seqs: seqs, maxChunks: maxChunks}
	if err := p.allocate(); err != nil {
		return nil, errors.Join(err, p.Release())
	}
	return p, nil
}

func (p *DensePlan) allocate() error {
	d, h, dev := p.d, p.d.heads, p.d.dev
	b := uint64(len(p.seqs))
	var err error
	alloc := func(bytes uint64) *vk.Buffer {
		if err != nil {
			return nil
		}
		var buf *vk.Buffer
		buf, err = dev.NewBuffer(bytes, vk.DeviceLocal)
		return buf
	}
	slots := b * uint64(h.Query) * uint64(p.maxChunks)
	p.query = alloc(b * uint64(h.Query*h.Dim) * 4)
	p.partO = alloc(slots * uint64(h.Dim) * 4)
	p.partML = alloc(slots * 8)
	if err == nil {
		p.parts = [2]vk.Range{p.partO.All(), p.partML.All()}
	}
	p.arrivals = alloc(b * uint64(h.Query/d.group) * 8)
	p.out = alloc(b * uint64(h.Query*h.Dim) * 4)
	if err == nil {
		p.taken, err = dev.NewBuffer(b*uint64(h.Query/d.group)*4, vk.HostVisible)
	}
	if err == nil {
		// The counters start at 0; each dispatch leaves them at 0.
		err = dev.Run(func(c *vk.Commands) { c.Fill(p.arrivals.All(), 0) })
	}
	if err != nil {
		return err
	}
	if err := p.bind(); err != nil {
		return err
	}
	return p.hold()
}

// index returns the clusters a plan over a selection attends; nil for
// the other modes.
func (p *DensePlan) index() *kvcache.Clusters {
	if m, ok := p.mode.(*clusterMode); ok {
		return m.index
	}
	return nil
}

// hold holds the plan's sequences and index until Release.
func (p *DensePlan) hold() error {
	for i, s := range p.seqs {
		if err := s.Hold(); err != nil {
			for _, t := range p.seqs[:i] {
				t.Drop()
			}
			return err
		}
	}
	if x := p.index(); x != nil {
		x.Hold()
	}
	p.held = true
	return nil
}

// partBytes returns the bytes of the partials of one sequence: output,
// then maximum and sum.
func (p *DensePlan) partBytes() (o, ml uint64) {
	slots := uint64(p.d.heads.Query) * uint64(p.maxChunks)
	return slots * uint64(p.d.heads.Dim) * 4, slots * 8
}

// bind makes the bindings of every sequence's KV head ranges: the
// buffers every mode shares, and the mode's.
func (p *DensePlan) bind() error {
	d, h, dev := p.d, p.d.heads, p.d.dev
	maxRange := dev.Info().MaxStorageBufferRange
	for _, s := range p.seqs {
		headBytes := s.HeadBytes()
		perBinding := int(maxRange / headBytes)
		if perBinding == 0 {
			return fmt.Errorf("%w: one KV head of capacity %d (%d bytes) exceeds the device's storage-buffer range %d", vk.ErrUnsupported, s.Capacity(), headBytes, maxRange)
		}
		var segs []segment
		for base := 0; base < h.KV; base += perBinding {
			count := min(perBinding, h.KV-base)
			off, size := uint64(base)*headBytes, uint64(count)*headBytes
			bufs := partialBuffers{
				Queries: p.query.All(), Keys: s.Keys().Slice(off, size), Values: s.Values().Slice(off, size),
				PartialO: p.parts[0], PartialML: p.parts[1], Arrivals: p.arrivals.All(), Out: p.OutputRange(), Taken: p.taken.All(),
			}
			pipe := p.mode.bindings(d, &bufs)
			bind, err := pipe.Bind(bufs.ranges(p.query.All())...)
			if err != nil {
				for _, sg := range segs {
					err = errors.Join(err, sg.bind.Release())
				}
				return err
			}
			segs = append(segs, segment{kvBase: base, kvCount: count, bind: bind})
		}
		p.segments = append(p.segments, segs)
	}
	return nil
}

// rebind releases the plan's bindings, calls change and binds again.
// Where the new bindings cannot be made it calls undo (when not nil) and
// binds as before; moved reports whether the change stays. err joins what
// failed, the release of the old bindings included.
func (p *DensePlan) rebind(change, undo func()) (moved bool, err error) {
	released := p.unbind()
	change()
	bindErr := p.bind()
	if bindErr == nil {
		return true, released
	}
	errs := []error{released, bindErr, p.unbind()}
	if undo != nil {
		undo()
		errs = append(errs, p.bind())
	}
	return false, errors.Join(errs...)
}

// Release frees the plan's buffers and bindings, and its holds on its
// sequences and index; it returns the errors of what it released, and
// vk.ErrReleased the second time.
func (p *DensePlan) Release() error {
	if p.mode == nil {
		return vk.ErrReleased
	}
	errs := []error{p.unbind()}
	if p.ws != nil {
		delete(p.ws.plans, p)
		p.ws = nil
	}
	errs = append(errs, p.clock.release())
	if p.held {
		for _, s := range p.seqs {
			s.Drop()
		}
		if x := p.index(); x != nil {
			x.Drop()
		}
		p.held = false
	}
	errs = append(errs, releaseAll(p.query, p.partO, p.partML, p.arrivals, p.taken, p.out), p.mode.release())
	p.query, p.partO, p.partML, p.arrivals, p.taken, p.out, p.mode = nil, nil, nil, nil, nil, nil, nil
	return errors.Join(errs...)
}

// unbind releases the plan's bindings and returns their errors.
func (p *DensePlan) unbind() error {
	var errs []error
	for _, segs := range p.segments {
		for _, s := range segs {
			errs = append(errs, s.bind.Release())
		}
	}
	p.segments = nil
	return errors.Join(errs...)
}

// SetQuery uploads the queries, [batch][Hq][D] float32, after checking them
// (a refused query leaves the one uploaded before in place).
func (p *DensePlan) SetQuery(q []float32) error {
	if err := checkQuery(q, len(p.seqs), p.d.heads); err != nil {
		return err
	}
	return p.query.WriteFloat32(0, q)
}

// Record appends the attention to c, for the sequences' current lengths:
// per sequence (and range of KV heads bound together) one dispatch whose
// workgroups attend a chunk of tokens each and whose last workgroup per
// head block merges the chunks into the output, so no barrier is needed
// inside. Writes recorded earlier into c need a barrier before it
// (c.Barrier() after transfers, c.ComputeBarrier() after kernels, a
// previous Record of this plan included).
func (p *DensePlan) Record(c *vk.Commands) error { return p.recordStage(c, 1) }

// recordStage is Record for a stage whose dispatches sequences plans
// share (attention over clusters sizes its runs for them).
func (p *DensePlan) recordStage(c *vk.Commands, sequences int) error {
	if p.mode == nil || p.segments == nil {
		return vk.ErrReleased
	}
	return p.mode.record(c, p, sequences)
}

// push returns the push constants that every mode sets alike for the
// range seg of KV heads of sequence b.
func (p *DensePlan) push(b int, seg segment) partialPush {
	h := p.d.heads
	return partialPush{HeadStride: uint32(p.seqs[b].HeadBytes() / 16), KVBase: uint32(seg.kvBase), Seq: uint32(b),
		MaxChunks: uint32(p.maxChunks), Scale: float32(h.Scale()), QueryHeads: uint32(h.Query), GroupSize: uint32(h.Group())}
}

// Taken returns the rows each head block attended in the last attention
// over clusters that ran ([KV][blocks], as SetRuns): the members of the
// clusters taken and the pseudo-tokens, not the fixed tokens.
func (p *DensePlan) Taken() ([]uint32, error) {
	out := make([]uint32, p.d.headBlocks())
	return out, p.taken.ReadUint32(0, out)
}

// Attend computes attention for the queries q ([batch][Hq][D]) and returns
// the output, [batch][Hq][D].
func (p *DensePlan) Attend(q []float32) ([]float32, error) {
	if err := p.SetQuery(q); err != nil {
		return nil, err
	}
	if err := p.run(); err != nil {
		return nil, err
	}
	out := make([]float32, len(q))
	o := p.OutputRange()
	return out, o.Buffer.ReadFloat32(o.Offset, out)
}

// Output returns the buffer the attention output lands in.
func (p *DensePlan) Output() *vk.Buffer { return p.out }

// OutputRange returns where the plan writes its output, [B][Hq][D]
// float32: its own buffer, or the range SetOutput gave (a zero Range
// once released).
func (p *DensePlan) OutputRange() vk.Range {
	switch {
	case p.outTo.Buffer != nil:
		return p.outTo
	case p.out == nil: // released
		return vk.Range{}
	}
	return p.out.All()
}

// SetOutput makes the plan write its output into r (at least B·Hq·D
// float32) instead of its own buffer, so that a caller gathering several
// plans' outputs reads them where they land; a zero Range goes back to
// the plan's own buffer. Where the new bindings cannot be made the plan
// writes where it did.
func (p *DensePlan) SetOutput(r vk.Range) error {
	h := p.d.heads
	if want := uint64(len(p.seqs)*h.Query*h.Dim) * 4; r.Buffer != nil && r.Size < want {
		return fmt.Errorf("sparse: an output range of %d bytes for %d", r.Size, want)
	}
	if p.segments == nil {
		return vk.ErrReleased
	}
	old := p.outTo
	_, err := p.rebind(func() { p.outTo = r }, func() { p.outTo = old })
	return err
}

func (p *DensePlan) run() error { return p.d.dev.Do(p.Record) }

// Time records warmup+reps back-to-back runs of the attention in one
// submission, with a timestamp after each, so the GPU stays busy as in a
// decode loop; it returns the GPU times of the timed runs, sorted.
func (p *DensePlan) Time(warmup, reps int) ([]time.Duration, error) {
	return p.clock.time(p.d.dev, warmup, reps, p.Record)
}

// stopwatch times repeated recordings with timestamp queries.
type stopwatch struct {
	stamps *vk.Timestamps
	cmd    *vk.Commands
}

// time records warmup+reps runs of record back to back in one submission,
// a compute barrier before each (a run rewrites what the previous one
// used), and
// returns the timed runs' GPU times, sorted.
func (w *stopwatch) time(dev *vk.Device, warmup, reps int, record func(*vk.Commands) error) ([]time.Duration, error) {
	if reps <= 0 || warmup < 0 {
		return nil, fmt.Errorf("sparse: timing needs at least one timed run")
	}
	total := warmup + reps
	if w.cmd == nil {
		c, err := dev.NewCommands()
		if err != nil {
			return nil, err
		}
		w.cmd = c
	}
	if w.stamps == nil || w.stamps.Len() < total+1 {
		if w.stamps != nil {
			w.stamps.Release()
		}
		s, err := dev.NewTimestamps(total + 1)
		if err != nil {
			return nil, err
		}
		w.stamps = s
	}
	c := w.cmd
	if err := c.Begin(); err != nil {
		return nil, err
	}
	c.Reset(w.stamps)
	c.Timestamp(w.stamps, 0)
	for i := 0; i < total; i++ {
		c.ComputeBarrier()
		if err := record(c); err != nil {
			c.End()
			return nil, err
		}
		c.Timestamp(w.stamps, i+1)
	}
	if err := c.End(); err != nil {
		return nil, err
	}
	if err := c.Submit(); err != nil {
		return nil, err
	}
	ticks, err := w.stamps.Durations(total + 1)
	if err != nil {
		return nil, err
	}
	times := ticks[1+warmup:]
	sort.Slice(times, func(i, j int) bool { return times[i] < times[j] })
	return times, nil
}

// release frees the stopwatch's objects and returns their errors.
func (w *stopwatch) release() error {
	err := errors.Join(releaseAll(w.stamps), releaseAll(w.cmd))
	w.stamps, w.cmd = nil, nil
	return err
}

func ceilDiv(a, b int) int { return (a + b - 1) / b }
