package sparse

import (
	"errors"
	"fmt"
	"math"
	"slices"
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
	dev       *vk.Device
	heads     Heads
	group     int // query heads per workgroup
	tile      int
	partial   *vk.Pipeline
	gather    *vk.Pipeline // attend_partial reading rows through token lists
	clustered *vk.Pipeline // attend_partial over taken clusters; nil where shared memory is short
	// approx is attend_partial over taken clusters with pseudo-tokens of
	// the kept ones (PlanSelection), built on first use.
	approx *vk.Pipeline
	// logits is dense attend_partial that also writes its logits
	// (PlanLogits), built on first use.
	logits *vk.Pipeline
	code   []byte   // attend_partial's SPIR-V
	spec   []uint32 // its specialization, GATHER, APPROX and LOGITS 0
	// clusterSpec is spec with attention over clusters' tiles and score
	// slots.
	clusterSpec []uint32
	clusterTile int
	workgroup   int
	tpr         int  // threads sharing a K row in the score pass
	rpt         int  // K rows each thread scores at once
	tree        bool // reductions through shared memory only
	window      int  // clusters scanned at once by attention over clusters
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
}

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
	partialBindings       = 18
	partialPushWords      = 18
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
	tpr := opts.ThreadsPerRow
	if tpr == 0 {
		tpr = threadsPerRow(info, heads.Dim)
	}
	if tpr&(tpr-1) != 0 || (heads.Dim/8)%tpr != 0 || (tpr > 1 && (!info.SubgroupShuffle || info.SubgroupSize%uint32(tpr) != 0)) {
		return nil, fmt.Errorf("%w: %d threads per row with head dimension %d on a device with subgroups of %d (shuffle %v)", vk.ErrUnsupported, tpr, heads.Dim, info.SubgroupSize, info.SubgroupShuffle)
	}
	group := opts.Group
	if group == 0 {
		group = defaultGroup(heads.Group())
	}
	if group < 1 || group > 8 || heads.Group()%group != 0 {
		return nil, fmt.Errorf("%w: %d query heads per workgroup for groups of %d (a divisor, at most 8)", vk.ErrUnsupported, group, heads.Group())
	}
	wg := opts.Workgroup
	if wg == 0 {
		wg = min(denseWorkgroup, int(info.MaxWorkgroupInvocations))
	}
	tile := opts.Tile
	if tile == 0 {
		tile = scoreBudget / group
	}
	unroll := max(opts.Unroll, 0)
	if unroll == 0 {
		unroll = 8
	}
	rpt := opts.RowsPerThread
	if rpt == 0 {
		rpt = 1
		if opts.ThreadsPerRow == 0 {
			rpt = rowsPerThread(tpr)
		}
	}
	if rpt < 1 || rpt > 8 {
		return nil, fmt.Errorf("%w: %d rows per thread (at most 8)", vk.ErrUnsupported, rpt)
	}
	window := opts.ClusterWindow
	if window == 0 {
		window = min(wg, clusterWindow)
	}
	clusterTile := opts.ClusterTile
	if clusterTile == 0 {
		clusterTile = opts.Tile
	}
	if clusterTile == 0 {
		clusterTile = clusterScoreBudget / group
	}
	if opts.ClusterChunk < 0 || window&(window-1) != 0 || window > wg || window < 1 || clusterTile < 1 {
		return nil, fmt.Errorf("sparse: %d clusters per chunk, %d per window, tiles of %d, for workgroups of %d", opts.ClusterChunk, opts.ClusterWindow, clusterTile, wg)
	}
	tree := !info.SubgroupArithmetic || info.SubgroupSize < 4 || opts.TreeReduce
	reduceSlots := group * wg
	if !tree {
		reduceSlots = group * wg / 4 // one slot per subgroup of at least 4
	}
	// Score slots and shared bytes of attend_partial with tiles of t
	// tokens: queries, scores and reductions; its arrays for clusters
	// (lst, from, pre, subTotal) add 5 words where GATHER < 2 and
	// clusterShared's rest where GATHER = 2.
	scoreSlotsFor := func(t int) int { return max(group*t, 8*wg) }
	sharedFor := func(t int) int { return 4 * (group*heads.Dim + scoreSlotsFor(t) + reduceSlots) }
	scoreSlots, shared := scoreSlotsFor(tile), sharedFor(tile)
	switch {
	case wg&(wg-1) != 0 || wg > int(info.MaxWorkgroupInvocations) || wg < heads.Dim/4 || wg < 32:
		return nil, fmt.Errorf("%w: workgroup of %d threads (a power of two from %d to %d)", vk.ErrUnsupported, wg, max(32, heads.Dim/4), info.MaxWorkgroupInvocations)
	case tile <= 0 || shared+4*5 > int(info.SharedMemoryBytes):
		return nil, fmt.Errorf("%w: tiles of %d tokens need %d bytes of shared memory, device has %d", vk.ErrUnsupported, tile, shared+4*5, info.SharedMemoryBytes)
	}
	d := &Dense{dev: dev, heads: heads, group: group, tile: tile, workgroup: wg, tpr: tpr, rpt: rpt, tree: tree, opts: opts, gatherMin: gatherChunkMin, window: window, clusterTile: clusterTile}
	code, err := shaders.SPIRV("attend_partial")
	if err != nil {
		return nil, err
	}
	d.code = code
	d.spec = []uint32{uint32(wg), uint32(heads.Dim), uint32(group), uint32(d.tile), uint32(tpr), boolWord(!d.tree), uint32(unroll), uint32(scoreSlots), uint32(reduceSlots), 0, uint32(rpt), uint32(d.window), 0, 0}
	// Attention over clusters: its own tiles, so its own score slots, and
	// its arrays lst, from, pre and subTotal.
	d.clusterSpec = append([]uint32(nil), d.spec...)
	d.clusterSpec[3], d.clusterSpec[7] = uint32(clusterTile), uint32(scoreSlotsFor(clusterTile))
	clusterShared := sharedFor(clusterTile) + 4*(clusterTile+2*window+1+wg/4)
	kernel := func(name string, gather uint32) *vk.Pipeline {
		if err != nil {
			return nil
		}
		var p *vk.Pipeline
		p, err = d.kernel(name, gather, 0, 0)
		return p
	}
	d.partial = kernel("attend_partial", 0)
	d.gather = kernel("attend_partial (gather)", 1)
	if clusterShared <= int(info.SharedMemoryBytes) {
		d.clustered = kernel("attend_partial (clusters)", 2)
	}
	if err != nil {
		d.Release()
		return nil, err
	}
	return d, nil
}

// buildApprox builds attention over clusters with pseudo-tokens (d.approx)
// the first time a plan needs it.
func (d *Dense) buildApprox() error {
	if d.approx != nil {
		return nil
	}
	var err error
	d.approx, err = d.kernel("attend_partial (clusters, pseudo-tokens)", 2, 1, 0)
	return err
}

// buildLogits builds dense attention that writes its logits (d.logits)
// the first time a plan needs it.
func (d *Dense) buildLogits() error {
	if d.logits != nil {
		return nil
	}
	var err error
	d.logits, err = d.kernel("attend_partial (dense, logits)", 0, 0, 1)
	return err
}

// kernel builds attend_partial with GATHER gather, APPROX approx and
// LOGITS logits.
func (d *Dense) kernel(name string, gather, approx, logits uint32) (*vk.Pipeline, error) {
	base := d.spec
	if gather == 2 {
		base = d.clusterSpec
	}
	spec := append([]uint32(nil), base...)
	spec[9], spec[12], spec[13] = gather, approx, logits
	return d.dev.NewPipeline(vk.Kernel{Name: name, SPIRV: d.code, Bindings: partialBindings, PushWords: partialPushWords, Specialization: spec})
}

// headBlocks returns the head blocks of a sequence: each KV head's query
// heads, group at a time.
func (d *Dense) headBlocks() int { return d.heads.KV * (d.heads.Group() / d.group) }

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
	for _, p := range []*vk.Pipeline{d.partial, d.gather, d.clustered, d.approx, d.logits} {
		if p != nil {
			errs = append(errs, p.Release())
		}
	}
	errs = append(errs, d.kernels.release())
	return errors.Join(errs...)
}

// DensePlan holds the buffers and bindings that attend one batch of
// sequences; record it again after the sequences grow.
type DensePlan struct {
	d         *Dense
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
	// With token lists (PlanGather): the lists' stride, the tokens per
	// chunk, and the lists and their lengths per KV head.
	gatherStride, gatherChunk int
	tokens, tokCounts         *vk.Buffer
	// With clusters (PlanClusters): the index, the clusters per chunk, and
	// the ranks and cuts that decide which clusters are taken.
	clusters     *kvcache.Clusters
	clusterChunk int
	fixedRuns    bool // clusterChunk set by the selection (Selection.RunClusters)
	rank, cut    vk.Range
	// runs, when set, is the runs of clusters per head block ([KV][blocks])
	// in place of equal runs (SetRuns); mostRuns caps each.
	runs     []int
	mostRuns int
	// approx holds the pseudo-tokens' buffers (PlanSelection); nil without.
	approx *Approximation
	// logits, with PlanLogits, receives every logit, float32 [Hq][Len] of
	// the one sequence (rows of Len floats from the start).
	logits *vk.Buffer
	// held: the plan holds its sequences and index (kvcache Hold), so
	// that they are not released under it.
	held bool
}

type segment struct {
	kvBase, kvCount int
	bind            *vk.Binding
}

// Plan prepares attention over the sequences (one query per sequence).
func (d *Dense) Plan(seqs []*kvcache.Layer) (*DensePlan, error) {
	return d.PlanChunks(seqs, defaultMaxChunk)
}

// PlanLogits prepares dense attention over one sequence that also writes
// every logit scale·q_h·k_t it computes into Logits, float32 [Hq][Len]
// (DELTA's token scores read them).
func (d *Dense) PlanLogits(layer *kvcache.Layer) (*DensePlan, error) {
	if err := d.buildLogits(); err != nil {
		return nil, err
	}
	if layer.KVHeads() != d.heads.KV || layer.HeadDim() != d.heads.Dim {
		return nil, fmt.Errorf("sparse: a sequence of %d KV heads of %d, kernels want %d of %d", layer.KVHeads(), layer.HeadDim(), d.heads.KV, d.heads.Dim)
	}
	p := &DensePlan{d: d, seqs: []*kvcache.Layer{layer}, maxChunks: defaultMaxChunk}
	var err error
	if p.logits, err = d.dev.NewBuffer(uint64(d.heads.Query)*uint64(layer.Capacity())*4, vk.DeviceLocal); err == nil {
		err = p.allocate()
	}
	if err != nil {
		p.Release()
		return nil, err
	}
	return p, nil
}

// Logits returns where a PlanLogits plan writes its logits, float32
// [Hq][Len] (nil for other plans).
func (p *DensePlan) Logits() *vk.Buffer { return p.logits }

// PlanChunks is Plan with at most maxChunks chunks per sequence and head
// (Plan takes 512): fewer chunks, longer each, for batches of many
// sequences that fill the device without splitting them finely, whose
// partials then take less memory.
func (d *Dense) PlanChunks(seqs []*kvcache.Layer, maxChunks int) (*DensePlan, error) {
	if len(seqs) == 0 {
		return nil, fmt.Errorf("sparse: Plan of an empty batch")
	}
	if maxChunks <= 0 || maxChunks > defaultMaxChunk {
		return nil, fmt.Errorf("sparse: %d chunks per sequence outside [1, %d]", maxChunks, defaultMaxChunk)
	}
	h := d.heads
	for i, s := range seqs {
		if s.KVHeads() != h.KV || s.HeadDim() != h.Dim {
			return nil, fmt.Errorf("sparse: sequence %d has %d KV heads of %d, kernels want %d of %d", i, s.KVHeads(), s.HeadDim(), h.KV, h.Dim)
		}
	}
	p := &DensePlan{d: d, seqs: seqs, maxChunks: maxChunks}
	if err := p.allocate(); err != nil {
		p.Release()
		return nil, err
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
	if p.gatherStride > 0 {
		p.tokens = alloc(uint64(h.KV*p.gatherStride) * 4)
		p.tokCounts = alloc(uint64(h.KV) * 4)
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
	if p.clusters != nil {
		p.clusters.Hold()
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

// bind makes the bindings of every sequence's KV head ranges.
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
			pipe, lists, counts := d.partial, p.query.All(), p.query.All() // unused bindings get a valid range
			index := []vk.Range{lists, lists, lists, lists, lists}
			pseudo := []vk.Range{lists, lists, lists}
			taken := p.taken.All()
			switch {
			case p.gatherStride > 0:
				pipe, lists, counts = d.gather, p.tokens.All(), p.tokCounts.All()
			case p.clusters != nil:
				x := p.clusters
				members := x.Members
				if members == nil {
					members = x.Starts // a page index; attend_partial reads no members
				}
				pipe, index = d.clustered, []vk.Range{p.rank, p.cut, x.Starts.All(), x.Counts.All(), members.All()}
				if a := p.approx; a != nil {
					pipe, pseudo = d.approx, []vk.Range{a.Logits, a.Keep, a.Means}
				}
			case p.logits != nil:
				pipe, taken = d.logits, p.logits.All()
			}
			ranges := append([]vk.Range{p.query.All(), s.Keys().Slice(off, size), s.Values().Slice(off, size), p.parts[0], p.parts[1], lists, counts}, index...)
			ranges = append(ranges, p.arrivals.All(), p.OutputRange())
			ranges = append(append(ranges, pseudo...), taken)
			bind, err := pipe.Bind(ranges...)
			if err != nil {
				return err
			}
			segs = append(segs, segment{kvBase: base, kvCount: count, bind: bind})
		}
		p.segments = append(p.segments, segs)
	}
	return nil
}

// Release frees the plan's buffers and bindings.
func (p *DensePlan) Release() error {
	p.unbind()
	if p.ws != nil {
		delete(p.ws.plans, p)
		p.ws = nil
	}
	p.clock.release()
	if p.held {
		for _, s := range p.seqs {
			s.Drop()
		}
		if p.clusters != nil {
			p.clusters.Drop()
		}
		p.held = false
	}
	for _, r := range []interface{ Release() error }{p.query, p.partO, p.partML, p.arrivals, p.taken, p.out, p.tokens, p.tokCounts, p.logits} {
		r.Release() // each tolerates a nil receiver
	}
	return nil
}

// unbind releases the plan's bindings.
func (p *DensePlan) unbind() {
	for _, segs := range p.segments {
		for _, s := range segs {
			s.bind.Release()
		}
	}
	p.segments = nil
}

// chunkFor picks tokens per chunk for a sequence of n tokens: about 512
// workgroups in all, but chunks of at least a tile (or of a quarter of that
// many workgroups' share) so that long contexts are not split finer than
// pays; at most maxChunks chunks per sequence.
func (p *DensePlan) chunkFor(n int) int {
	d := p.d
	c := d.ChunkTokens
	if c <= 0 {
		total := 0
		for _, s := range p.seqs {
			total += s.Len()
		}
		blocks := d.headBlocks()
		fine := ceilDiv(ceilDiv(total*blocks, targetWorkgroups), 64) * 64
		coarse := ceilDiv(ceilDiv(total*blocks, targetWorkgroups/4), 64) * 64
		c = max(fine, min(d.tile, coarse))
	}
	return max(c, 1, ceilDiv(n, p.maxChunks))
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
func (p *DensePlan) Record(c *vk.Commands) error {
	h, d := p.d.heads, p.d
	if p.gatherStride > 0 {
		return p.recordGather(c)
	}
	if p.clusters != nil {
		return p.recordClusters(c)
	}
	for b, s := range p.seqs {
		n := s.Len()
		if n == 0 {
			return fmt.Errorf("sparse: sequence %d is empty", b)
		}
		chunk := p.chunkFor(n)
		nc := ceilDiv(n, chunk)
		if nc > p.maxChunks {
			return fmt.Errorf("sparse: sequence %d of %d tokens needs %d chunks, plan has %d", b, n, nc, p.maxChunks)
		}
		blocks := h.Group() / d.group
		for _, seg := range p.segments[b] {
			push := []uint32{uint32(n), uint32(s.HeadBytes() / 16), uint32(seg.kvBase), uint32(b), uint32(chunk), uint32(p.maxChunks),
				math.Float32bits(float32(1 / math.Sqrt(float64(h.Dim)))), uint32(h.Query), uint32(h.Group()), 0, 0, 0, 0, 0, 0, 0, 0, 0}
			pipe := d.partial
			if p.logits != nil {
				pipe = d.logits
			}
			c.Dispatch(pipe, seg.bind, push, uint32(nc), uint32(seg.kvCount*blocks), 1)
		}
	}
	return nil
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
// float32: its own buffer, or the range SetOutput gave.
func (p *DensePlan) OutputRange() vk.Range {
	if p.outTo.Buffer != nil {
		return p.outTo
	}
	return p.out.All()
}

// SetOutput makes the plan write its output into r (at least B·Hq·D
// float32) instead of its own buffer, so that a caller gathering several
// plans' outputs reads them where they land; a zero Range goes back to
// the plan's own buffer. On error the plan writes where it did.
func (p *DensePlan) SetOutput(r vk.Range) error {
	h := p.d.heads
	if want := uint64(len(p.seqs)*h.Query*h.Dim) * 4; r.Buffer != nil && r.Size < want {
		return fmt.Errorf("sparse: an output range of %d bytes for %d", r.Size, want)
	}
	if p.segments == nil {
		return vk.ErrReleased
	}
	old := p.outTo
	p.unbind()
	p.outTo = r
	if err := p.bind(); err != nil {
		p.unbind()
		p.outTo = old
		return errors.Join(err, p.bind())
	}
	return nil
}

func (p *DensePlan) run() error { return runOnce(p.d.dev, p.Record) }

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

// release frees the stopwatch's objects.
func (w *stopwatch) release() {
	if w.stamps != nil {
		w.stamps.Release()
	}
	if w.cmd != nil {
		w.cmd.Release()
	}
	w.stamps, w.cmd = nil, nil
}

// runOnce records record into a fresh command buffer, submits it and waits.
func runOnce(dev *vk.Device, record func(*vk.Commands) error) error {
	c, err := dev.NewCommands()
	if err != nil {
		return err
	}
	defer c.Release()
	if err := c.Begin(); err != nil {
		return err
	}
	if err := record(c); err != nil {
		c.End()
		return err
	}
	if err := c.End(); err != nil {
		return err
	}
	return c.Submit()
}

func ceilDiv(a, b int) int { return (a + b - 1) / b }

// PlanGather prepares attention of one sequence over a list of tokens per
// KV head (at most stride each): every query head of KV head g attends
// exactly the tokens of list g. The lists live on the device (Tokens,
// TokenCounts) so that GPU kernels can fill them; the kernel sizes the
// chunks from the counts on the device.
func (d *Dense) PlanGather(layer *kvcache.Layer, stride int) (*DensePlan, error) {
	if stride <= 0 || stride > layer.Capacity() {
		return nil, fmt.Errorf("sparse: token lists of %d entries for a cache of capacity %d", stride, layer.Capacity())
	}
	if layer.KVHeads() != d.heads.KV || layer.HeadDim() != d.heads.Dim {
		return nil, fmt.Errorf("sparse: the cache has %d KV heads of %d, kernels want %d of %d", layer.KVHeads(), layer.HeadDim(), d.heads.KV, d.heads.Dim)
	}
	// Chunks of at least gatherMin tokens, sized on the device from
	// the lists' total length so that all lists take about
	// gatherWorkgroups chunks together, spread as the lengths are; a list
	// never takes more, so that is the grid per head.
	chunks := max(1, min(gatherWorkgroups/max(1, d.heads.Group()/d.group), ceilDiv(stride*d.heads.KV, d.gatherMin)))
	p := &DensePlan{d: d, seqs: []*kvcache.Layer{layer}, maxChunks: chunks, gatherStride: stride, gatherChunk: d.gatherMin}
	if err := p.allocate(); err != nil {
		p.Release()
		return nil, err
	}
	return p, nil
}

// Tokens returns the token lists, uint32 [KVHeads][stride] (PlanGather).
func (p *DensePlan) Tokens() *vk.Buffer { return p.tokens }

// TokenCounts returns the list lengths, uint32 [KVHeads] (PlanGather).
func (p *DensePlan) TokenCounts() *vk.Buffer { return p.tokCounts }

// GatherChunk returns the least tokens per chunk of a PlanGather plan.
func (p *DensePlan) GatherChunk() int { return p.gatherChunk }

// SetTokens uploads one token list per KV head (each non-empty, at most
// the plan's stride, tokens below the cache's length).
func (p *DensePlan) SetTokens(lists [][]int32) error {
	h := p.d.heads
	if p.gatherStride == 0 {
		return fmt.Errorf("sparse: SetTokens on a plan without token lists")
	}
	if len(lists) != h.KV {
		return fmt.Errorf("sparse: %d token lists for %d KV heads", len(lists), h.KV)
	}
	flat := make([]uint32, h.KV*p.gatherStride)
	counts := make([]uint32, h.KV)
	n := p.seqs[0].Len()
	for g, l := range lists {
		if len(l) == 0 || len(l) > p.gatherStride {
			return fmt.Errorf("sparse: token list %d has %d entries (1 to %d allowed)", g, len(l), p.gatherStride)
		}
		for i, t := range l {
			if t < 0 || int(t) >= n {
				return fmt.Errorf("sparse: token list %d entry %d is %d, outside the %d stored tokens", g, i, t, n)
			}
			flat[g*p.gatherStride+i] = uint32(t)
		}
		counts[g] = uint32(len(l))
	}
	return errors.Join(p.tokens.WriteUint32(0, flat), p.tokCounts.WriteUint32(0, counts))
}

// recordGather records attention over the token lists in one dispatch: a
// fixed grid of maxChunks chunks per head block, sized on the device from
// the list lengths; workgroups past a head's last chunk exit at once, and
// the last of the others in each head block to finish merges them.
func (p *DensePlan) recordGather(c *vk.Commands) error {
	h, d := p.d.heads, p.d
	blocks := h.Group() / d.group
	for _, seg := range p.segments[0] {
		push := []uint32{uint32(p.gatherStride), uint32(p.seqs[0].HeadBytes() / 16), uint32(seg.kvBase), 0, uint32(p.gatherChunk), uint32(p.maxChunks),
			math.Float32bits(float32(1 / math.Sqrt(float64(h.Dim)))), uint32(h.Query), uint32(h.Group()), 0, 0, 0, 0, 0, 0, 0, 0, 0}
		c.Dispatch(d.gather, seg.bind, push, uint32(p.maxChunks), uint32(seg.kvCount*blocks), 1)
	}
	return nil
}

// PlanClusters prepares attention of one sequence over a clustered cache,
// stored in cluster order (clusters.Contiguous, kvcache.Layer.Reorder):
// every query head of KV head g attends the tokens outside the clusters
// ([0, First) and [First+Count, n)) and the members of every cluster c of
// g that some query head h of g takes, rank[h][c] < cut[h] (uint32 ranges
// [Hq][C] and [Hq], written by earlier kernels; the caller keeps them
// alive). Workgroups take fixed runs of clusters and skip those not taken,
// so no token list is built.
func (d *Dense) PlanClusters(layer *kvcache.Layer, clusters *kvcache.Clusters, rank, cut vk.Range) (*DensePlan, error) {
	return d.PlanSelection(layer, Selection{Clusters: clusters, Rank: rank, Cut: cut})
}

// PlanSelection prepares attention of one sequence over a policy's
// selection: PlanClusters over sel's clusters, ranks and cuts, and, where
// sel.Approx is set, each query head h also attends one pseudo-token per
// cluster c of its KV head g that no head of g takes and that h keeps,
// rank[h][c] < Approx.Keep[h]: logit Approx.Logits[h][c], value
// Approx.Means[g][c] (Double-P's Eq. 8–9).
func (d *Dense) PlanSelection(layer *kvcache.Layer, sel Selection) (*DensePlan, error) {
	h, clusters, rank, cut := d.heads, sel.Clusters, sel.Rank, sel.Cut
	if clusters == nil {
		return nil, fmt.Errorf("sparse: a selection without clusters")
	}
	switch {
	case d.clustered == nil:
		return nil, fmt.Errorf("%w: attention over clusters needs more shared memory than the device has", vk.ErrUnsupported)
	case layer.KVHeads() != h.KV || layer.HeadDim() != h.Dim:
		return nil, fmt.Errorf("sparse: the cache has %d KV heads of %d, kernels want %d of %d", layer.KVHeads(), layer.HeadDim(), h.KV, h.Dim)
	case clusters.KVHeads != h.KV || clusters.First+clusters.Count > layer.Capacity():
		return nil, fmt.Errorf("sparse: an index of %d KV heads over tokens [%d, %d) for a cache of %d heads and capacity %d", clusters.KVHeads, clusters.First, clusters.First+clusters.Count, h.KV, layer.Capacity())
	case rank.Size < uint64(h.Query*clusters.C)*4 || cut.Size < uint64(h.Query)*4:
		return nil, fmt.Errorf("sparse: ranks of %d bytes and cuts of %d for %d query heads of %d clusters", rank.Size, cut.Size, h.Query, clusters.C)
	case !clusters.Contiguous:
		return nil, fmt.Errorf("sparse: attention over clusters reads them as runs of slots: put the layer in cluster order first (kvcache.Layer.Reorder)")
	}
	blocks := h.Group() / d.group
	per := d.opts.ClusterChunk
	if sel.RunClusters > 0 {
		per = sel.RunClusters
	}
	if per <= 0 {
		per = clusterRun(clusters.C, h.KV*blocks, 1)
	}
	most := min(runTableMost, max(1, runTableSpread*ceilDiv(clusters.C, per)))
	chunks := max(ceilDiv(clusters.C, per), most) + ceilDiv(layer.Capacity()-clusters.Count, d.clusterTile)
	if a := sel.Approx; a != nil {
		c := uint64(h.Query * clusters.C)
		if a.Keep.Size < uint64(h.Query)*4 || a.Logits.Size < c*4 || a.Means.Size < uint64(h.KV*clusters.C*h.Dim)*2 {
			return nil, fmt.Errorf("sparse: pseudo-tokens with keeps of %d bytes, logits of %d and means of %d for %d query heads of %d clusters", a.Keep.Size, a.Logits.Size, a.Means.Size, h.Query, clusters.C)
		}
		if err := d.buildApprox(); err != nil {
			return nil, err
		}
	}
	p := &DensePlan{d: d, seqs: []*kvcache.Layer{layer}, maxChunks: chunks, clusters: clusters, clusterChunk: per, fixedRuns: sel.RunClusters > 0, rank: rank, cut: cut, approx: sel.Approx, mostRuns: most}
	if err := p.allocate(); err != nil {
		p.Release()
		return nil, err
	}
	return p, nil
}

// recordClusters records attention over the taken clusters and the fixed
// tokens (recordClusterAttention).
func (p *DensePlan) recordClusters(c *vk.Commands) error {
	return p.recordClusterAttention(c, 1)
}

// clusterRun returns the clusters of a KV head that a run of attention
// over clusters takes, for KV heads of c clusters, blocks head blocks in
// all and sequences sequences sharing the dispatch: at least
// clusterChunkMin, enough for about clusterWorkgroups workgroups a
// sequence, and, beyond clusterBatchSequences sequences, about
// clusterBatchSequences·clusterWorkgroups in all. Each run's workgroup
// costs its queries, its windows' scans, its partial and its arrival
// whatever it attends; a batch's several waves of them even out the runs'
// members without as many of those fixed costs. On the H100 (llama, P 0.9,
// batch 8, runs balanced by the step before) attention took 80, 77 and 89
// µs at 32 768 tokens with 1, 2 and 4 waves of runs, 213, 177 and 175 at
// 131 072; with equal runs 117, 92 and 89 µs with 8, 4 and 2 waves.
func clusterRun(c, blocks, sequences int) int {
	target := clusterWorkgroups
	if sequences > clusterBatchSequences {
		target = max(1, clusterBatchSequences*clusterWorkgroups/sequences)
	}
	return max(clusterChunkMin, ceilDiv(c*blocks, target))
}

// runClusters returns the clusters of a run when the plans of sequences
// sequences share a stage's dispatches: Selection.RunClusters or
// DenseOptions.ClusterChunk where set, clusterRun otherwise.
func (p *DensePlan) runClusters(sequences int) int {
	if p.d.opts.ClusterChunk > 0 || p.fixedRuns {
		return p.clusterChunk
	}
	return clusterRun(p.clusters.C, p.d.headBlocks(), sequences)
}

// Runs of attention over clusters set per head block (DensePlan.SetRuns):
// a dispatch's table holds up to runTableBlocks blocks, a byte each; a
// block takes at most runTableSpread times the equal runs of one sequence.
const (
	runTableBlocks = 8
	runTableMost   = 255
	runTableSpread = 4
)

// SetRuns sets how many runs of clusters each head block of attention
// over clusters takes (runs[g·blocks + j] for block j of KV head g, each
// from 1 to MostRuns), in place of equal runs; nil restores equal runs.
// The output is the same either way: runs only divide the work. Dispatches
// over more than runTableBlocks head blocks keep equal runs.
func (p *DensePlan) SetRuns(runs []int) error {
	if p.clusters == nil {
		return fmt.Errorf("sparse: runs of clusters for a plan without clusters")
	}
	blocks := p.d.headBlocks()
	if runs != nil && len(runs) != blocks {
		return fmt.Errorf("sparse: %d runs for %d head blocks", len(runs), blocks)
	}
	for j, r := range runs {
		if r < 1 || r > p.mostRuns {
			return fmt.Errorf("sparse: %d runs for head block %d, want 1 to %d", r, j, p.mostRuns)
		}
	}
	p.runs = slices.Clone(runs)
	return nil
}

// MostRuns is the most runs SetRuns gives a head block.
func (p *DensePlan) MostRuns() int { return p.mostRuns }

// Taken returns the rows each head block attended in the last attention
// over clusters that ran ([KV][blocks], as SetRuns): the members of the
// clusters taken and the pseudo-tokens, not the fixed tokens.
func (p *DensePlan) Taken() ([]uint32, error) {
	out := make([]uint32, p.d.headBlocks())
	return out, p.taken.ReadUint32(0, out)
}

// Rebalance sets the runs per head block (SetRuns) for the next attention
// over clusters from the rows each block attended in the last one
// (Taken): balancedRuns over the equal runs' total when sequences plans
// share the stage, within runBounds. Until some block has attended a row,
// and where more equal runs than a table holds are chosen, the blocks keep
// equal runs.
func (p *DensePlan) Rebalance(sequences int) error {
	if p.clusters == nil {
		return fmt.Errorf("sparse: Rebalance of a plan without clusters")
	}
	taken, err := p.Taken()
	if err != nil {
		return err
	}
	equal := ceilDiv(p.clusters.C, p.runClusters(sequences))
	least, most := runBounds(p.clusters.C, equal, p.d.window)
	most = min(most, p.mostRuns)
	if least > most {
		return p.SetRuns(nil) // more equal runs than a table holds
	}
	return p.SetRuns(balancedRuns(taken, equal*len(taken), least, most))
}

// runBounds returns the fewest and most runs a head block of c clusters
// gets when balanced around equal runs of a block: at least 1/runLeast of
// them, and no fewer than make runs of runScanWindows windows of window
// clusters (each window's scan costs a workgroup about 2 µs on the H100),
// but never more than equal; at most runTableSpread times equal.
func runBounds(c, equal, window int) (least, most int) {
	least = min(equal, max(1, equal/runLeast, ceilDiv(c, runScanWindows*window)))
	return least, runTableSpread * equal
}

// A head block keeps at least 1/runLeast of its equal runs, and runs of at
// most runScanWindows windows. On the H100 (P 0.9, 131 072 tokens in
// clusters of 16: runs of 2 048 clusters at the least) balanced runs took
// Tactic's attention 39 → 37 µs on llama and 51 → 45 on megabeam keeping an
// eighth, against 40 and 47 keeping a quarter and 41 and 45 a sixteenth,
// and Double-P's 62 → 56 on llama. Without the bound on windows, the
// token oracle's clusters of one token left runs of 32 768 clusters, and
// its attention took 245 µs against 74.
const (
	runLeast       = 8
	runScanWindows = 8
)

// balancedRuns shares total runs among blocks in proportion to the members
// each attends (largest remainders), each between least and most; nil
// where no block attends a member.
func balancedRuns(members []uint32, total, least, most int) []int {
	sum := 0.0
	for _, m := range members {
		sum += float64(m)
	}
	if sum == 0 {
		return nil
	}
	runs := make([]int, len(members))
	left := total
	for i := range runs {
		runs[i] = least
		left -= least
	}
	// Shares of what is left, in proportion and within most.
	type part struct {
		i    int
		frac float64
	}
	var parts []part
	given := total - left
	for i, m := range members {
		share := float64(left) * float64(m) / sum
		add := min(int(share), most-runs[i])
		runs[i] += add
		given += add
		parts = append(parts, part{i, share - float64(int(share))})
	}
	sort.Slice(parts, func(a, b int) bool { return parts[a].frac > parts[b].frac })
	for _, pt := range parts {
		if given >= total {
			break
		}
		if runs[pt.i] < most {
			runs[pt.i]++
			given++
		}
	}
	return runs
}

// recordClusterAttention records the whole attention over the taken
// clusters and the fixed tokens in one dispatch per range of KV heads, for
// a stage that sequences plans share: a workgroup per run of clusters
// (runClusters, or the plan's runs per head block), then one per tile of
// fixed tokens, each writing its partial (m = −∞ where it attends
// nothing), and the last workgroup of each head block merging them into
// the output.
func (p *DensePlan) recordClusterAttention(c *vk.Commands, sequences int) error {
	h, d, x := p.d.heads, p.d, p.clusters
	n := p.seqs[0].Len()
	end := x.First + x.Count
	if n < end {
		return fmt.Errorf("sparse: the cache holds %d tokens, its clusters end at %d", n, end)
	}
	per := p.runClusters(sequences)
	cc := ceilDiv(x.C, per)
	fixed := ceilDiv(n-x.Count, d.clusterTile)
	total := cc + fixed
	pipe := d.clustered
	if p.approx != nil {
		pipe = d.approx // each run's workgroup then folds in its range's pseudo-tokens
	}
	blocks := h.Group() / d.group
	for _, seg := range p.segments[0] {
		push := []uint32{uint32(n), uint32(p.seqs[0].HeadBytes() / 16), uint32(seg.kvBase), 0, uint32(per), uint32(p.maxChunks),
			math.Float32bits(float32(1 / math.Sqrt(float64(h.Dim)))), uint32(h.Query), uint32(h.Group()),
			uint32(x.C), uint32(cc), uint32(x.Count), uint32(x.First), uint32(end), 0, 0, 0, uint32(fixed)}
		nb := seg.kvCount * blocks
		if p.runs == nil || nb > runTableBlocks {
			c.Dispatch(pipe, seg.bind, push, uint32(total), uint32(nb), 1)
			continue
		}
		grid := 0
		for j, r := range p.runs[seg.kvBase*blocks : seg.kvBase*blocks+nb] {
			push[15+j/4] |= uint32(r) << (8 * (j % 4))
			grid += r + fixed
		}
		push[14] = uint32(nb)
		c.Dispatch(pipe, seg.bind, push, uint32(grid), 1, 1)
	}
	return nil
}
