package sparse

import (
	"errors"
	"fmt"
	"math"
	"slices"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/vk"
)

// TacticStep is a Tactic decode step of one sequence on the GPU, in one
// submission with no host round trip and three dependent dispatches:
// centroid scoring; the selection, whose workgroups each rank a query
// head's clusters by bins of their scores (ScoreBin) and sample their
// share of the exact part, the two sampling windows and the fixed tokens,
// the last of the head's to finish then fitting the budget of Alg. 1 at
// bin granularity (TacticBinnedBudgetRef states the computation; with
// TacticFit.Moments one workgroup a head instead sums its clusters' moment
// estimates by bin, over spreads the step computes from the layer when it
// takes an index, and cuts at once); and
// attention, for each KV head, over the union of the clusters its query
// heads select with the sinks and the recent tail (Dense.PlanSelection:
// the union is taken where the rows are read, with no token list). The
// layer's tokens before clusters.First are the sinks; those from
// clusters.First+clusters.Count on are the tail, attended in full. It is a
// Step whose selector is Tactic's; tactic is that selector, for the bins,
// cuts and scores it wrote.
type TacticStep struct {
	*Step
	tactic *tacticSelector
}

// tacticSelector is Tactic's selection (a Selector): the first two
// dispatches of a step, writing each cluster's bin and each head's cut.
type tacticSelector struct {
	d       *Dense
	seq     *kvcache.Layer
	p       float64
	fit     TacticFit
	kernels *tacticKernels
	// ownKernels is set when the step built its kernels (not a batch's).
	ownKernels bool
	// sequences is how many sequences' selections share the dispatches
	// (a batch's size; 1 for a step alone).
	sequences int
	// workgroups, where positive, replaces the selection's workgroups per
	// head that RecordStage picks (tests use it to run several).
	workgroups int
	// scoreWorkgroups, where positive, replaces scoreWorkgroups (tests use
	// it to score several groups of centroids per workgroup).
	scoreWorkgroups int
	tacticBound
}

// tacticBound is what a step holds for one cluster index: the index, the
// buffers sized by it and the kernels' bindings.
type tacticBound struct {
	clusters *kvcache.Clusters
	binds    struct{ score, selection *vk.Binding }
	bufs     []*vk.Buffer
	scores   *vk.Buffer // float32 [Hq][C]
	binOf    *vk.Buffer // uint32 [Hq][C]
	planBuf  *vk.Buffer // uint32 [Hq][16]: the plan and fit of each head (tactic_select)
	// sampled lists each selection workgroup's sampled clusters, uint32
	// pairs [Hq][C+maxSampleWorkgroups]: workgroup w's i-th from w·⌈C/W⌉,
	// (cluster·ScoreBins + bin, Σ e(t) over the cluster as float bits);
	// nil with the moment estimate, which samples none.
	sampled *vk.Buffer
	// fixedE holds, per head and workgroup, four words
	// [Hq][maxSampleWorkgroups]: Σ e(t) over its fixed tokens (float32),
	// the count of its sampled list and the tokens it sampled in each
	// window (uint32).
	fixedE   *vk.Buffer
	cut      *vk.Buffer // uint32 [Hq]
	extremes *vk.Buffer // uint32 [Hq][2]: keys of each head's best and worst score, 0 between steps
	// centroids are the index's centroids in 8 bits, [Hkv][C][D].
	centroids codedCentroids
	// fitArrived counts the selection's workgroups done per query head, 0
	// between steps.
	fitArrived *vk.Buffer
	// moments is set where the selection uses the moment estimate
	// (TacticFit.Moments); spreads, float32 [Hkv][C], and dimWeights,
	// float32 [Hkv][D], are then the index's (cluster_spread), else nil.
	moments             bool
	spreads, dimWeights *vk.Buffer
	// binSums holds, with the moment estimate, each selection
	// workgroup's estimates summed by bin, float32 [Hq][W][ScoreBins] for
	// the step's W workgroups a head, at most momentSlots.
	binSums     *vk.Buffer
	momentSlots int
}

// momentWorkgroups is the most selection workgroups per query head with
// the moment estimate, which takes one unless a test asks for more: each
// writes a sum per bin (tacticBound.binSums).
const momentWorkgroups = 4

// release frees the bindings and buffers.
func (b *tacticBound) release() error {
	err := errors.Join(releaseAll(b.binds.score, b.binds.selection), releaseAll(b.bufs...))
	*b = tacticBound{}
	return err
}

// The most workgroups of the selection per query head.
const maxSampleWorkgroups = 256

// selectWorkgroup is the most threads of a tactic_select workgroup (a
// power of two dividing ScoreBins). Fewer threads a workgroup spread a
// head's sampling over more workgroups, but every workgroup ranks all of
// its head's clusters and a dispatch should fit one wave: 512 balances the
// two (bench/README.md, "The selection's and the scores' shapes").
const selectWorkgroup = 512

// selectWave is the most selection workgroups a stage takes, a batch's
// sequences together, but for one a query head: about the workgroups the
// GPU runs at once (two on each of an H100's 132 SMs), since a second wave
// would rank all of its heads' clusters again.
const selectWave = 256

// selectionWidth returns the selection's workgroups per query head for
// about `sampled` clusters to sample a head, with `teams` teams a
// workgroup, when `sequences` sequences of `heads` query heads share the
// dispatch, one workgroup listing its head's clusters in `rounds` rounds
// (a round takes as many as it has threads). Of the wave
// selectWave/(sequences·heads) a head, it takes the most of: enough
// workgroups for about two clusters a team; a workgroup per SM (half the
// wave) while each team still has a cluster; enough for the listing to
// take selectRounds rounds. It is at most the wave and at least one.
// Every workgroup ranks all of its head's clusters, so more workgroups
// pay only where they share sampling or listing.
func selectionWidth(sampled, teams, sequences, heads, rounds int) int {
	wave := selectWave / (sequences * heads)
	perSM := max(min(ceilDiv(sampled, teams), wave/2), ceilDiv(rounds, selectRounds))
	return max(1, min(max(ceilDiv(sampled, 2*teams), perSM), wave))
}

// selectRounds is the rounds in which a selection workgroup lists its
// share of the clusters, where a wave allows (selectionWidth).
const selectRounds = 2

// selectSegment is the clusters of its share a selection workgroup lists
// at once, per thread (tactic_select's SEGS), before every team samples
// the segment's listed clusters. Two keep the kernel within 24 KB of
// shared memory, where NVIDIA's compiler still fits two workgroups of 512
// threads an SM (at four, 27 KB, it took 94 registers and the fit slowed
// by 12 µs; bench/README.md).
const selectSegment = 2

// selectShared returns the shared memory tactic_select takes with wg
// threads for heads of dim dimensions: the query, the bins' offsets and
// sums, a word and a vec4 per thread, the list of a segment
// (selectSegment words a thread), and a few words.
func selectShared(wg, dim int) int {
	return 4*dim + 2*4*(ScoreBins+1) + 4*wg + 16*wg + 4*selectSegment*wg + 48
}

// tacticKernels are the selection kernels of Tactic steps, shared by the
// steps of a batch.
type tacticKernels struct {
	score centroidScorer
	// selection is tactic_select: each head's clusters' bins, the
	// sampling, the fit and the budget's cut; moments the same with the
	// moment estimate (TacticFit.Moments). Each is built by the first
	// selector that uses it (selectionKernel); spec is their
	// specialization but the last constant.
	selection, moments *vk.Pipeline
	spec               []uint32
	// sampleTeams is the clusters a selection workgroup samples at once.
	sampleTeams int
	threads     int // of a selection workgroup
}

// release lets the kernels go: the Dense they came from holds them.
func (k *tacticKernels) release() error { return nil }

// selectionKernel returns tactic_select for dense's heads with the
// fitted curve, or with the moment estimate (MOMENTS = 1) where moments,
// building it the first time it is asked for: a step compiles only the
// variant it runs.
func (k *tacticKernels) selectionKernel(dense *Dense, moments bool) (*vk.Pipeline, error) {
	pipe := k.variant(moments)
	if *pipe == nil {
		b := &builder{dev: dense.dev, cache: &dense.kernels}
		*pipe = b.kernel("tactic_select", 15, 16, append(slices.Clone(k.spec), boolWord(moments))...)
		if b.err != nil {
			return nil, b.err
		}
	}
	return *pipe, nil
}

// NewTacticStep prepares decode steps at target mass p with the fit's
// parameters over layer, clustered as clusters says (the layer in cluster
// order: kvcache.Layer.Reorder).
func NewTacticStep(dense *Dense, layer *kvcache.Layer, clusters *kvcache.Clusters, p float64, fit TacticFit) (*TacticStep, error) {
	k, err := newTacticKernels(dense)
	if err != nil {
		return nil, err
	}
	sel, err := newTacticSelector(dense, k, layer, clusters, p, fit)
	if err != nil {
		return nil, errors.Join(err, k.release())
	}
	sel.ownKernels = true
	return newTacticStep(dense, layer, sel)
}

// newTacticStep makes the step of selector sel, which it then owns.
func newTacticStep(dense *Dense, layer *kvcache.Layer, sel *tacticSelector) (*TacticStep, error) {
	step, err := NewStep(dense, layer, sel)
	if err != nil {
		return nil, err
	}
	return &TacticStep{Step: step, tactic: sel}, nil
}

// variant returns where the selection kernel of the fitted curve, or of
// the moment estimate where moments, is kept.
func (k *tacticKernels) variant(moments bool) **vk.Pipeline {
	if moments {
		return &k.moments
	}
	return &k.selection
}

// newTacticSelector prepares Tactic's selection with kernels k (which it
// does not own).
func newTacticSelector(dense *Dense, k *tacticKernels, layer *kvcache.Layer, clusters *kvcache.Clusters, p float64, fit TacticFit) (*tacticSelector, error) {
	s := &tacticSelector{d: dense, seq: layer, p: p, fit: fit, kernels: k, sequences: 1}
	if err := errors.Join(dense.heads.checkIndex(layer, clusters), checkP(p), fit.validate()); err != nil {
		return nil, err
	}
	if _, err := k.selectionKernel(dense, fit.Moments); err != nil {
		return nil, err
	}
	var err error
	if s.tacticBound, err = s.allocate(clusters); err != nil {
		return nil, err
	}
	return s, nil
}

// newTacticKernels compiles the centroid scores' kernel for dense's heads
// and prepares the selection's (selectionKernel builds them).
func newTacticKernels(dense *Dense) (*tacticKernels, error) {
	h, dev := dense.heads, dense.dev
	b := &builder{dev: dev, cache: &dense.kernels}
	k := &tacticKernels{}
	// Selection: workgroups of up to selectWorkgroup threads, each ordering
	// all of a query head's clusters, fewer where its shared memory would
	// not fit.
	selectWG := min(perHeadWorkgroup(dev.Info()), selectWorkgroup)
	for selectWG > 64 && selectShared(int(selectWG), h.Dim) > int(dev.Info().SharedMemoryBytes) {
		selectWG /= 2
	}
	// Subgroup reductions and scans in the per-head passes where the dense
	// kernels use them (not with DenseOptions.TreeReduce).
	info := dev.Info()
	subgroups := func(threads uint32) uint32 {
		return boolWord(!dense.tree && info.SubgroupSize >= 4 && info.SubgroupSize <= threads)
	}
	k.score = centroidScores(b, dense, false)
	// Threads per sampled cluster: a power of two, 16 or 4 per row; where
	// shuffles work, at most a subgroup, which then sums by shuffles.
	tpr := dense.tpr // shuffles among tpr threads work on this device
	team, shuffle := max(16, 4*tpr), !dense.tree && info.SubgroupShuffle
	if shuffle {
		team = max(min(team, int(info.SubgroupSize)), tpr)
		shuffle = int(info.SubgroupSize)%team == 0
	}
	k.sampleTeams = int(selectWG) / team
	k.threads = int(selectWG)
	k.spec = []uint32{selectWG, uint32(h.Dim), uint32(tpr), uint32(rowsPerThread(tpr)), uint32(team), ScoreBins, 10, subgroups(selectWG), boolWord(shuffle), selectSegment}
	if b.err != nil {
		return nil, errors.Join(b.err, k.release())
	}
	return k, nil
}

// SetClusters moves the step onto another index of its layer (after the
// tail joined the index, say), keeping its kernels and query. On error the
// step is as it was.
func (t *TacticStep) SetClusters(clusters *kvcache.Clusters) error {
	sel := t.tactic
	if err := t.dense.heads.checkIndex(sel.seq, clusters); err != nil {
		return err
	}
	b, err := sel.allocate(clusters)
	if err != nil {
		return err
	}
	plan, err := t.dense.PlanSelection(t.layer, Selection{Clusters: clusters, Rank: b.binOf.All(), Cut: b.cut.All()})
	if err != nil {
		return errors.Join(err, b.release())
	}
	if t.plan.outTo.Buffer != nil {
		err = plan.SetOutput(t.plan.outTo) // the output stays where it was sent
	}
	if err == nil {
		err = b.bindKernels(sel.kernels, sel.seq, plan.query.All())
	}
	if err == nil && t.Step.query != nil {
		err = plan.SetQuery(t.Step.query)
	}
	if err != nil {
		return errors.Join(err, plan.Release(), b.release())
	}
	// The runs of the next step follow the old index's last union (where
	// that cannot be read, they start equal).
	if taken, err := t.plan.Taken(); err == nil {
		_ = plan.taken.WriteUint32(0, taken) // host-visible: fails only on a released buffer
	}
	old, oldPlan := sel.tacticBound, t.plan
	sel.tacticBound, t.plan = b, plan
	return errors.Join(old.release(), oldPlan.Release())
}

// allocate allocates the buffers an index needs (bindKernels binds them).
func (s *tacticSelector) allocate(clusters *kvcache.Clusters) (tacticBound, error) {
	h, dev := s.d.heads, s.d.dev
	x := tacticBound{clusters: clusters}
	b := &builder{dev: dev, bufs: &x.bufs}
	alloc := b.words
	hq, c := h.Query, clusters.C
	x.scores, x.binOf = alloc(hq*c), alloc(hq*c)
	x.planBuf, x.cut = alloc(hq*16), alloc(hq)
	x.extremes, x.fitArrived = alloc(2*hq), alloc(hq)
	x.fixedE = alloc(4 * hq * maxSampleWorkgroups)
	if x.moments = s.fit.Moments; !x.moments {
		x.sampled = alloc(2 * hq * (c + maxSampleWorkgroups))
	} else {
		x.spreads, x.dimWeights = alloc(h.KV*c), alloc(h.KV*h.Dim)
		// A workgroup takes at least a cluster a thread: an index of few
		// clusters needs few bins' sums.
		x.momentSlots = max(1, min(momentWorkgroups, ceilDiv(c, s.kernels.threads)))
		x.binSums = alloc(hq * x.momentSlots * ScoreBins)
	}
	err := b.err
	if err == nil {
		x.centroids, err = codeCentroids(b, clusters) // a quantized index's own, or copies
	}
	if err == nil && x.moments {
		err = computeSpreads(dev, h, s.seq, clusters, x.spreads, x.dimWeights)
	}
	if err == nil {
		err = dev.Run(func(c *vk.Commands) {
			for _, b := range []*vk.Buffer{x.extremes, x.fitArrived} {
				c.Fill(b.All(), 0)
			}
		})
	}
	if err != nil {
		return tacticBound{}, errors.Join(err, x.release())
	}
	return x, nil
}

// bindKernels binds the kernels k to the buffers, the layer's keys and the
// queries in query.
func (x *tacticBound) bindKernels(k *tacticKernels, layer *kvcache.Layer, query vk.Range) error {
	clusters := x.clusters
	score, err := k.score.pipe.Bind(query, x.centroids.codes.All(), x.scores.All(), clusters.Counts.All(), x.extremes.All(), x.centroids.scales.All(), x.centroids.dims.All())
	if err != nil {
		return err
	}
	// Bindings a variant does not read take the scores.
	pipe, sampled, spreads, dims, sums := *k.variant(x.moments), x.sampled, x.scores, x.scores, x.scores
	if x.moments {
		sampled, spreads, dims, sums = x.scores, x.spreads, x.dimWeights, x.binSums
	}
	selection, err := pipe.Bind(query, layer.Keys().All(), x.scores.All(), clusters.Starts.All(), clusters.Counts.All(), x.binOf.All(),
		sampled.All(), x.fixedE.All(), x.planBuf.All(), x.cut.All(), x.extremes.All(), x.fitArrived.All(), spreads.All(), dims.All(), sums.All())
	if err != nil {
		return errors.Join(err, score.Release())
	}
	old := errors.Join(releaseAll(x.binds.score), releaseAll(x.binds.selection))
	x.binds.score, x.binds.selection = score, selection
	return old
}

// Selection returns the bins and cuts the selection writes.
func (s *tacticSelector) Selection() Selection {
	return Selection{Clusters: s.clusters, Rank: s.binOf.All(), Cut: s.cut.All()}
}

// Bind binds the kernels to the queries in query.
func (s *tacticSelector) Bind(query vk.Range) error {
	return s.tacticBound.bindKernels(s.kernels, s.seq, query)
}

// Stages returns TacticStages.
func (s *tacticSelector) Stages() []string { return TacticStages }

// Release frees the buffers, bindings and the kernels it owns.
func (s *tacticSelector) Release() error {
	errs := []error{s.tacticBound.release()}
	if s.ownKernels {
		errs = append(errs, s.kernels.release())
		s.ownKernels = false
	}
	return errors.Join(errs...)
}

// windowPositions returns the exact part's token count and the two
// sampling windows' first and last positions over n clustered tokens, as
// TacticBudgetRef places them.
func windowPositions(fit TacticFit, n int) (need int, win [4]int) {
	need = fit.initialTokens(n)
	w := fit.windowWidth(n)
	for k, f := range [2]float64{fit.Window1, fit.Window2} {
		c := min(n, max(1, int(math.Round(f*float64(n)))))
		lo := min(max(1, c-w/2), max(1, n-w+1))
		win[2*k], win[2*k+1] = lo, min(n, lo+w-1)
	}
	return need, win
}

// TacticStages names the dispatches of Tactic's selection, in order:
// centroid scores; the clusters' bins, sampling, fit and cut. A step then
// attends (Step.Stages).
var TacticStages = []string{"score", "fit"}

// RecordStage appends selection stage s (0: scores, 1: order, sampling and
// fit) for the layer's current length.
func (s *tacticSelector) RecordStage(c *vk.Commands, stage int) error {
	h, x := s.d.heads, s.clusters
	n := s.seq.Len()
	end := x.First + x.Count
	fixed := x.First + n - end
	hq, cc, group := uint32(h.Query), uint32(x.C), uint32(h.Group())
	scale := h.scaleBits()
	need, win := windowPositions(s.fit, x.Count)
	if s.fit.Moments {
		need = x.Count // every bin is the exact part, summed from the clusters' estimates
	}
	k, b := s.kernels, &s.binds
	if b.selection == nil {
		return fmt.Errorf("sparse: Tactic's selection needs its queries bound")
	}
	switch stage {
	case 0:
		k.score.record(c, b.score, x.C, s.sequences, s.scoreWorkgroups)
	case 1:
		stride := s.fit.windowStride(x.Count, x.C)
		pipe := *k.variant(s.fit.Moments)
		push := []uint32{cc, group, uint32(s.seq.HeadBytes() / 16), uint32(x.Count), uint32(need), uint32(win[0]), uint32(win[1]), uint32(win[2]), uint32(win[3]),
			uint32(x.First), uint32(end), uint32(n), maxSampleWorkgroups, scale, math.Float32bits(float32(s.p)),
			uint32(stride)}
		// With the moment estimate one workgroup a head bins all of its
		// clusters and fits at once: more share the binning, which costs
		// little, but add a round trip for their sums and an arrival
		// (bench/README.md, 2026-12-06).
		wgs := 1
		if !s.fit.Moments {
			// Workgroups per head by the clusters expected to be sampled: the
			// exact part's and the windows' share of the clusters (at the mean
			// size) and the fixed tokens counted as clusters of 16.
			windows := ceilDiv(win[1]-win[0]+1+win[3]-win[2]+1, stride)
			work := ceilDiv((need+windows)*x.C, max(x.Count, 1)) + ceilDiv(fixed, 16)
			wgs = selectionWidth(work, k.sampleTeams, s.sequences, h.Query, ceilDiv(x.C, k.threads))
		}
		if s.workgroups > 0 {
			wgs = s.workgroups
			if s.fit.Moments {
				wgs = min(wgs, s.momentSlots)
			}
		}
		c.Dispatch(pipe, b.selection, push, uint32(min(maxSampleWorkgroups, max(1, wgs))), hq, 1)
	default:
		return fmt.Errorf("sparse: Tactic's selection has 2 stages, not %d", stage+1)
	}
	return nil
}

// shareStages sizes the selection's dispatches for sequences selections
// recorded together (stageSharer).
func (s *tacticSelector) shareStages(sequences int) { s.sequences = sequences }

// Scores returns the centroid scores of the last step, [Hq][C].
func (t *TacticStep) Scores() ([]float32, error) {
	s := make([]float32, t.dense.heads.Query*t.tactic.clusters.C)
	return s, t.tactic.scores.ReadFloat32(0, s)
}

// Cuts returns each query head's cut of the last step: it selected the
// clusters of bins below it.
func (t *TacticStep) Cuts() ([]int, error) { return readInts(t.tactic.cut, t.dense.heads.Query) }

// FitRows returns, for each query head, the key rows the fit of the last
// step scored: the members of the clusters its selection workgroups
// listed as sampled (the exact part and the windows) and the fixed tokens
// (the sinks and the tail), from the lists the selection wrote.
func (t *TacticStep) FitRows() ([]int, error) {
	h, x := t.dense.heads, t.tactic.clusters
	fixed := t.layer.Len() - x.Count
	rows := make([]int, h.Query)
	if t.tactic.fit.Moments {
		for hh := range rows {
			rows[hh] = fixed // the estimates read no member rows
		}
		return rows, nil
	}
	plan, err := readInts(t.tactic.planBuf, h.Query*16)
	if err != nil {
		return nil, err
	}
	counts, err := readInts(x.Counts, h.KV*x.C)
	if err != nil {
		return nil, err
	}
	fsum := make([]uint32, 4*h.Query*maxSampleWorkgroups)
	smp := make([]uint32, 2*h.Query*(x.C+maxSampleWorkgroups))
	if err := errors.Join(t.tactic.fixedE.ReadUint32(0, fsum), t.tactic.sampled.ReadUint32(0, smp)); err != nil {
		return nil, err
	}
	for hh := range rows {
		g, w := hh/h.Group(), plan[hh*16+15]
		if w < 1 || w > maxSampleWorkgroups {
			return nil, fmt.Errorf("sparse: query head %d's selection ran %d workgroups", hh, w)
		}
		rows[hh] = fixed
		per := ceilDiv(x.C, w)
		for wi := 0; wi < w; wi++ {
			listed := int(fsum[(hh*maxSampleWorkgroups+wi)*4+1])
			for i := 0; i < min(listed, per); i++ {
				c := int(smp[2*(hh*(x.C+maxSampleWorkgroups)+wi*per+i)] / ScoreBins)
				if c >= x.C {
					return nil, fmt.Errorf("sparse: query head %d sampled cluster %d of %d", hh, c, x.C)
				}
				rows[hh] += counts[g*x.C+c]
			}
		}
	}
	return rows, nil
}

// Fit returns the step's fit parameters.
func (t *TacticStep) Fit() TacticFit { return t.tactic.fit }

// Spreads returns the index's spreads and each KV head's dimension
// weights as the moment estimate reads them ([Hkv][C] and [Hkv][D];
// ClusterIndex.SetSpreadsRef), nil without TacticFit.Moments.
func (t *TacticStep) Spreads() (spreads, weights []float32, err error) {
	x, h := t.tactic.tacticBound, t.dense.heads
	if !x.moments {
		return nil, nil, nil
	}
	spreads, weights = make([]float32, h.KV*x.clusters.C), make([]float32, h.KV*h.Dim)
	return spreads, weights, errors.Join(x.spreads.ReadFloat32(0, spreads), x.dimWeights.ReadFloat32(0, weights))
}

// spreadWorkgroup is the threads of a cluster_spread workgroup for heads
// of dim dimensions: 128, or dim where larger.
func spreadWorkgroup(dim int) int { return max(128, dim) }

// computeSpreads writes the spreads of the clusters of x over layer (in
// cluster order) and each KV head's dimension weights (cluster_spread,
// ClusterIndex.SetSpreadsRef in float32).
func computeSpreads(dev *vk.Device, h Heads, layer *kvcache.Layer, x *kvcache.Clusters, spreads, weights *vk.Buffer) error {
	wg := spreadWorkgroup(h.Dim)
	if !x.Contiguous || wg%(h.Dim/8) != 0 || layer.HeadBytes()*uint64(h.KV) > uint64(dev.Info().MaxStorageBufferRange) {
		return fmt.Errorf("%w: cluster spreads of head dimension %d over %d bytes of keys (in cluster order: %v)", vk.ErrUnsupported, h.Dim, layer.HeadBytes()*uint64(h.KV), x.Contiguous)
	}
	pw := ceilDiv(x.C, wg/(h.Dim/8))
	parts, err := dev.NewBuffer(uint64(h.KV*pw*h.Dim)*4, vk.DeviceLocal)
	if err != nil {
		return err
	}
	spec := []uint32{uint32(wg), uint32(h.Dim)}
	bind := []vk.Range{layer.Keys().All(), x.Starts.All(), x.Counts.All(), spreads.All(), parts.All(), weights.All()}
	push := []uint32{uint32(x.C), uint32(layer.HeadBytes() / 16), uint32(x.First), 0, uint32(pw), uint32(x.Count)}
	err = runKernelOnce(dev, "cluster_spread", spec, bind, push, [3]uint32{uint32(pw), uint32(h.KV), 1})
	if err == nil {
		push[3] = 1
		err = runKernelOnce(dev, "cluster_spread", spec, bind, push, [3]uint32{1, uint32(h.KV), 1})
	}
	return errors.Join(err, parts.Release())
}

// BinsOf returns each query head's cluster bins of the last step, [Hq][C]:
// a head selected the clusters of bins below its cut.
func (t *TacticStep) BinsOf() ([]int, error) {
	return readInts(t.tactic.binOf, t.dense.heads.Query*t.tactic.clusters.C)
}

// readInts returns the first n uint32 of b as ints.
func readInts(b *vk.Buffer, n int) ([]int, error) {
	raw := make([]uint32, n)
	if err := b.ReadUint32(0, raw); err != nil {
		return nil, err
	}
	out := make([]int, n)
	for i, x := range raw {
		out[i] = int(x)
	}
	return out, nil
}

// membersOf returns the members of every cluster of each KV head's index,
// as TacticStep.Tokens takes them.
func membersOf(index []*kvcache.HostClusters) [][][]int32 {
	members := make([][][]int32, len(index))
	for g, x := range index {
		members[g] = x.Members
	}
	return members
}

// Tokens returns the tokens each KV head attended in the last step, in
// ascending order: the fixed tokens and the members of every cluster that
// a query head of its group selected (its bin below the head's cut), from
// the bins and cuts the GPU wrote and members, each KV head's clusters'
// members as read back ([KV][C][]).
func (t *TacticStep) Tokens(members [][][]int32) ([][]int32, error) {
	h, x := t.dense.heads, t.tactic.clusters
	if len(members) != h.KV {
		return nil, fmt.Errorf("sparse: members of %d KV heads' clusters for %d", len(members), h.KV)
	}
	bins, err := t.BinsOf()
	if err != nil {
		return nil, err
	}
	cuts, err := t.Cuts()
	if err != nil {
		return nil, err
	}
	fixed, err := TacticFixedTokens(x.First, x.First+x.Count, t.layer.Len()-1)
	if err != nil {
		return nil, err
	}
	out := make([][]int32, h.KV)
	for g := range out {
		if len(members[g]) != x.C {
			return nil, fmt.Errorf("sparse: KV head %d has %d clusters, the step %d", g, len(members[g]), x.C)
		}
		list := append([]int32(nil), fixed...)
		for c, members := range members[g] {
			for hh := g * h.Group(); hh < (g+1)*h.Group(); hh++ {
				if bins[hh*x.C+c] < cuts[hh] {
					list = append(list, members...)
					break
				}
			}
		}
		slices.Sort(list)
		out[g] = list
	}
	return out, nil
}

// TacticBinnedBudgetRef is TacticBudgetRef with the GPU's order: given the
// head's float32 centroid scores, clusters are grouped by ScoreBin (the
// members of a bin's clusters merged, ascending) and the groups ranked by
// ascending bin; the fit and budget then run over the groups. It returns
// the budget and the cut: the head selects the clusters whose bin is below.
// A window scores, of a bin beyond the exact part, the members of the
// clusters its stride takes (TacticFit.WindowStride). With
// TacticFit.Moments the bins hold their clusters' moment estimates
// (tacticBinnedMoments; the index needs its spreads).
func TacticBinnedBudgetRef(q []float64, scale float64, keys []float64, idx *ClusterIndex, scores []float32, fixed []int32, p float64, fit TacticFit) (*TacticBudget, int, error) {
	if len(scores) != idx.Clusters() {
		return nil, 0, fmt.Errorf("sparse: %d scores for %d clusters", len(scores), idx.Clusters())
	}
	m, u := ScoreBinScale(scores)
	if fit.Moments {
		return tacticBinnedMoments(q, scale, keys, idx, scores, fixed, p, fit)
	}
	// Each bin's members, and those a window scores: the members of the
	// bin's clusters whose index the windows' stride k divides.
	k := fit.windowStride(idx.Tokens(), idx.Clusters())
	byBin, scoredByBin := make([][]int32, ScoreBins), make([][]int32, ScoreBins)
	for c, s := range scores {
		b := ScoreBin(m, u, s)
		byBin[b] = append(byBin[b], idx.Members[c]...)
		if thinned(int32(c), k) {
			scoredByBin[b] = append(scoredByBin[b], idx.Members[c]...)
		}
	}
	groups := &ClusterIndex{D: idx.D}
	var bins []int
	var scoredOf [][]int32
	for b, mem := range byBin {
		if len(mem) == 0 {
			continue
		}
		slices.Sort(mem)
		slices.Sort(scoredByBin[b])
		groups.Members = append(groups.Members, mem)
		groups.Sizes = append(groups.Sizes, len(mem))
		bins = append(bins, b)
		scoredOf = append(scoredOf, scoredByBin[b])
	}
	groups.Centroids = make([]float64, len(bins)*idx.D)
	order := make([]int32, len(bins))
	for i := range order {
		order[i] = int32(i)
	}
	budget, err := tacticBudget(q, scale, keys, groups, fixed, p, fit, order, func(c int32) []int32 { return scoredOf[c] })
	if err != nil {
		return nil, 0, err
	}
	return budget, binCut(bins, budget.Selected, p), nil
}

// binCut returns the cut of a head that selects the first selected of the
// non-empty bins bins (ascending): the bin after the last one it takes,
// ScoreBins at P = 1.
func binCut(bins []int, selected int, p float64) int {
	if p == 1 {
		return ScoreBins
	}
	if selected == 0 {
		return 0
	}
	return bins[selected-1] + 1
}

// tacticBinnedMoments is TacticBinnedBudgetRef with the moment estimate
// (TacticFit.Moments): each bin's estimate is the sum of its clusters'
// MomentEstimate over the float32 scores, with the shift m the best of
// them, and the head selects the clusters of the bins before the least
// boundary j with S(j) = F + Σ_{bins < j} ≥ P·S(ScoreBins) (all at P = 1).
func tacticBinnedMoments(q []float64, scale float64, keys []float64, idx *ClusterIndex, scores []float32, fixed []int32, p float64, fit TacticFit) (*TacticBudget, int, error) {
	if err := checkBudgetInputs(q, keys, idx, fixed, p, fit); err != nil {
		return nil, 0, err
	}
	m, u := ScoreBinScale(scores)
	shift := MomentShift(q, scale, idx.DimWeights)
	var est [ScoreBins]float64
	var sizes [ScoreBins]int
	for c, s := range scores {
		b := ScoreBin(m, u, s)
		est[b] += MomentEstimate(idx.Sizes[c], float64(s), idx.Spreads[c], shift, float64(m))
		sizes[b] += idx.Sizes[c]
	}
	// The non-empty bins in order, as the groups of the budget.
	budget := &TacticBudget{}
	var bins, groupSizes []int
	for b := range sizes {
		if sizes[b] > 0 {
			budget.Order = append(budget.Order, int32(len(bins)))
			budget.Offsets = append(budget.Offsets, budget.N)
			budget.N += sizes[b]
			bins, groupSizes = append(bins, b), append(groupSizes, sizes[b])
		}
	}
	budget.Offsets = append(budget.Offsets, budget.N)
	d := len(q)
	score := func(t int32) float64 { return scale * dot(q, keys[int(t)*d:int(t+1)*d]) }
	budget.momentSums(float64(m), fixed, score, groupSizes, func(i int32) float64 { return est[bins[i]] })
	budget.cutAt(p)
	return budget, binCut(bins, budget.Selected, p), nil
}

// StepFidelity is how well a GPU step stood in for dense attention, per
// query head: Fidelity with Mass the exact softmax mass of the tokens the
// head attended (the union of its KV head), Selected its own selection (the
// fixed tokens and the clusters of bins below its cut), and RelErr the
// step's output against dense attention.
type StepFidelity []Fidelity

// Fidelity evaluates the last step (after Attend of q, whose output is out)
// in float64. keys and values hold each KV head's decoded rows of all
// stored tokens ([KV][n·D]); index holds each head's clusters as read back.
func (t *TacticStep) Fidelity(q, out []float32, keys, values [][]float64, index []*kvcache.HostClusters) (StepFidelity, error) {
	h, x := t.dense.heads, t.tactic.clusters
	n := t.layer.Len()
	scores, err := t.Scores()
	if err != nil {
		return nil, err
	}
	cuts, err := t.Cuts()
	if err != nil {
		return nil, err
	}
	lists, err := t.Tokens(membersOf(index))
	if err != nil {
		return nil, err
	}
	fixed, err := TacticFixedTokens(x.First, x.First+x.Count, n-1)
	if err != nil {
		return nil, err
	}
	d, scale := h.Dim, h.Scale()
	res := make(StepFidelity, h.Query)
	for hh := range res {
		g := hh / h.Group()
		qh := make([]float64, d)
		for i := range qh {
			qh[i] = float64(q[hh*d+i])
		}
		probs, err := SoftmaxRef(qh, keys[g], scale)
		if err != nil {
			return nil, err
		}
		f := &res[hh]
		if f.Mass, err = SubsetMass(probs, lists[g]); err != nil {
			return nil, err
		}
		hs := scores[hh*x.C : (hh+1)*x.C]
		m, u := ScoreBinScale(hs)
		f.Selected = len(fixed)
		for c, s := range hs {
			if ScoreBin(m, u, s) < cuts[hh] {
				f.Selected += len(index[g].Members[c])
			}
		}
		if f.GlobalOptimal, err = TopPCount(probs, t.tactic.p); err != nil {
			return nil, err
		}
		if f.ClusterOptimal, err = ClusterTopPCount(probs, index[g].Members, fixed, t.tactic.p); err != nil {
			return nil, err
		}
		dense, err := AttendRef(qh, keys[g], values[g], scale)
		if err != nil {
			return nil, err
		}
		got := make([]float64, d)
		for i := range got {
			got[i] = float64(out[hh*d+i])
		}
		if f.RelErr, err = RelativeError(got, dense); err != nil {
			return nil, err
		}
	}
	return res, nil
}
