package sparse

import (
	"errors"
	"fmt"
	"sort"
	"time"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/vk"
)

// Selection is where a policy's kernels leave one step's choice for the
// shared attention kernel (Dense.PlanSelection). Over an index of clusters
// stored in cluster order (K-means clusters; pages of consecutive tokens
// and single tokens are clusters too), the query heads of KV head g attend
// every token outside the index and the members of each cluster c of g
// with Rank[h][c] < Cut[h] for some query head h of g.
type Selection struct {
	Clusters  *kvcache.Clusters
	Rank, Cut vk.Range // uint32 [Hq][C] and [Hq]
	// Approx, when set, adds one pseudo-token per cluster that a head
	// keeps but no head of its group takes.
	Approx *Approximation
	// RunClusters, when positive, is the clusters a run of the attention
	// takes (a workgroup's share), in place of the count chosen from C:
	// for a few clusters that all are taken, short runs spread them over
	// many workgroups.
	RunClusters int
	// Record, when set, receives the logits and normalisers attention
	// computes, for a policy that reads them at its next step (H2O).
	Record *AttentionRecord
}

// AttentionRecord is where attention over a selection leaves what it
// computed: Rows[h][t] = scale·q_h·k_t for every slot t that query head h
// attended (float32, RowStride floats a head; the entries of other slots
// keep their values), and Norms[h] = (M, L), the largest of those logits
// and Σ exp(logit − M) over them (float32 [Hq][2]), so that h's weight of
// slot t was exp(Rows[h][t] − M) / L.
type AttentionRecord struct {
	Rows      vk.Range
	RowStride int
	Norms     vk.Range
}

// Approximation stands clusters in for their tokens: head h of KV head g
// attends cluster c of g, kept (Rank[h][c] < Keep[h]) and taken by no head
// of g, as one token of logit Logits[h][c] and value Means[g][c].
type Approximation struct {
	Keep   vk.Range // uint32 [Hq]
	Logits vk.Range // float32 [Hq][C], in the units of scale·q·k
	Means  vk.Range // fp16 [Hkv][C][D], packed two to a word
}

// Selector is a policy's selection on the GPU, one step after another:
// kernels that read the step's queries and write a Selection.
type Selector interface {
	// Selection returns the buffers the kernels write.
	Selection() Selection
	// Bind makes the kernels read the queries from query, float32 [Hq][D].
	Bind(query vk.Range) error
	// Stages names the selection's dependent dispatches, in order.
	Stages() []string
	// RecordStage appends stage s for the layer's current length.
	RecordStage(c *vk.Commands, s int) error
	// Release frees the selector's kernels and buffers.
	Release() error
}

// Step is one sequence's decode step under a policy: the selector's
// kernels, then attention over the selection with its merge
// (Dense.PlanSelection), in one submission with no host round trip. The
// step owns its selector.
type Step struct {
	dense *Dense
	layer *kvcache.Layer
	sel   Selector
	plan  *DensePlan
	query []float32 // the last query set
	clock stopwatch
}

// NewStep prepares steps of the selector sel over layer; it releases sel
// when it fails and when the step is released.
func NewStep(dense *Dense, layer *kvcache.Layer, sel Selector) (*Step, error) {
	s := &Step{dense: dense, layer: layer, sel: sel}
	var err error
	if s.plan, err = dense.PlanSelection(layer, sel.Selection()); err == nil {
		err = sel.Bind(s.plan.query.All())
	}
	if err != nil {
		return nil, errors.Join(err, s.Release())
	}
	return s, nil
}

// Selector returns the step's selector.
func (s *Step) Selector() Selector { return s.sel }

// Stages names the step's dependent dispatches: the selector's, then
// "attend".
func (s *Step) Stages() []string {
	if s.sel == nil {
		return nil
	}
	return append(append([]string(nil), s.sel.Stages()...), "attend")
}

// SetQuery uploads the queries, [Hq][D] float32, after checking them.
func (s *Step) SetQuery(q []float32) error {
	if s.plan == nil {
		return vk.ErrReleased
	}
	if err := s.plan.SetQuery(q); err != nil {
		return err
	}
	s.query = append(s.query[:0], q...)
	return nil
}

// Record appends the step to c, a compute barrier between stages; as
// DensePlan.Record, it orders compute work only.
func (s *Step) Record(c *vk.Commands) error { return s.record(c, func(int) {}) }

// record appends the stages, calling mark(i) after stage i's dispatches.
func (s *Step) record(c *vk.Commands, mark func(stage int)) error {
	if s.plan == nil {
		return vk.ErrReleased
	}
	return recordSteps(c, []*Step{s}, mark)
}

// recordSteps appends the steps (of selectors with as many stages) stage
// by stage: each stage's dispatches for every step, then one barrier, so
// that a batch pays each stage's fixed cost once; attention is the last
// stage. mark(i) is called after stage i's dispatches.
func recordSteps(c *vk.Commands, steps []*Step, mark func(stage int)) error {
	ns := len(steps[0].sel.Stages())
	for i := 0; i <= ns; i++ {
		for _, s := range steps {
			var err error
			if i < ns {
				err = s.sel.RecordStage(c, i)
			} else {
				err = s.plan.recordStage(c, len(steps))
			}
			if err != nil {
				return err
			}
		}
		mark(i)
		if i < ns {
			c.ComputeBarrier()
		}
	}
	return nil
}

// Attend runs a step for the query q ([Hq][D]) and returns the output.
// Its attention divides the clusters among workgroups by the rows each
// head block attended in the step before (DensePlan.Rebalance).
func (s *Step) Attend(q []float32) ([]float32, error) {
	if err := s.SetQuery(q); err != nil {
		return nil, err
	}
	if err := s.plan.Rebalance(1); err != nil {
		return nil, err
	}
	if err := s.dense.dev.Do(s.Record); err != nil {
		return nil, err
	}
	out := make([]float32, len(q))
	o := s.plan.OutputRange()
	return out, o.Buffer.ReadFloat32(o.Offset, out)
}

// Rebalance divides the next steps' attention among workgroups by the
// rows each head block attended in the last step that ran
// (DensePlan.Rebalance); Attend does it before every step.
func (s *Step) Rebalance() error {
	if s.plan == nil {
		return vk.ErrReleased
	}
	return s.plan.Rebalance(1)
}

// Output returns the step's own output buffer, float32 [Hq][D], where the
// output lands unless SetOutput sent it elsewhere (TacticStep.SetClusters
// replaces it: ask again after).
func (s *Step) Output() *vk.Buffer {
	if s.plan == nil {
		return nil
	}
	return s.plan.Output()
}

// OutputRange returns where the step writes its output: its own buffer or
// the range SetOutput gave.
func (s *Step) OutputRange() vk.Range {
	if s.plan == nil {
		return vk.Range{}
	}
	return s.plan.OutputRange()
}

// SetOutput makes the step write its output, [Hq][D] float32, into r
// (DensePlan.SetOutput).
func (s *Step) SetOutput(r vk.Range) error {
	if s.plan == nil {
		return vk.ErrReleased
	}
	return s.plan.SetOutput(r)
}

// Time records warmup+reps back-to-back steps in one submission and
// returns the timed ones' GPU times, sorted (as DensePlan.Time).
func (s *Step) Time(warmup, reps int) ([]time.Duration, error) {
	if s.plan == nil {
		return nil, vk.ErrReleased
	}
	return s.clock.time(s.dense.dev, warmup, reps, s.Record)
}

// TimeStages runs reps steps back to back in one submission, after warmup
// untimed ones, with a timestamp after every stage, and returns each
// stage's median GPU time (Stages order) and the median whole step.
func (s *Step) TimeStages(warmup, reps int) (stages []time.Duration, total time.Duration, err error) {
	if s.plan == nil {
		return nil, 0, vk.ErrReleased
	}
	return timeStages(s.dense.dev, len(s.Stages()), warmup, reps, s.record)
}

// timeStages runs record warmup+reps times in one submission, a timestamp
// after each of its ns stages (record calls mark after each), and returns
// the median of each stage and of the whole.
func timeStages(dev *vk.Device, ns, warmup, reps int, record func(c *vk.Commands, mark func(int)) error) (stages []time.Duration, total time.Duration, err error) {
	if reps <= 0 || warmup < 0 {
		return nil, 0, fmt.Errorf("sparse: timing needs at least one timed run")
	}
	stamps, err := dev.NewTimestamps(1 + ns*(warmup+reps))
	if err != nil {
		return nil, 0, err
	}
	defer stamps.Release()
	err = dev.Do(func(c *vk.Commands) error {
		c.Reset(stamps)
		c.Timestamp(stamps, 0)
		for r := 0; r < warmup+reps; r++ {
			c.ComputeBarrier()
			if err := record(c, func(i int) { c.Timestamp(stamps, 1+r*ns+i) }); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return nil, 0, err
	}
	d, err := stamps.Durations(1 + ns*(warmup+reps))
	if err != nil {
		return nil, 0, err
	}
	per := make([][]time.Duration, ns)
	var totals []time.Duration
	for r := warmup; r < warmup+reps; r++ {
		var sum time.Duration
		for i := 0; i < ns; i++ {
			x := d[1+r*ns+i]
			per[i] = append(per[i], x)
			sum += x
		}
		totals = append(totals, sum)
	}
	median := func(x []time.Duration) time.Duration {
		sort.Slice(x, func(i, j int) bool { return x[i] < x[j] })
		return x[len(x)/2]
	}
	for i := range per {
		stages = append(stages, median(per[i]))
	}
	return stages, median(totals), nil
}

// Release frees the step, its plan and its selector (not the layer, the
// index or the dense kernels).
func (s *Step) Release() error {
	if s.plan == nil && s.sel == nil {
		return vk.ErrReleased
	}
	s.clock.release()
	var errs []error
	if s.plan != nil {
		errs = append(errs, s.plan.Release())
	}
	if s.sel != nil {
		errs = append(errs, s.sel.Release())
	}
	s.plan, s.sel = nil, nil
	return errors.Join(errs...)
}

// scoreWorkgroup is the most threads of a centroid_score workgroup
// (bench/README.md, "The selection's and the scores' shapes").
const scoreWorkgroup = 256

// scoreWorkgroups is about how many workgroups a scoring dispatch takes,
// a batch's sequences together: each takes as many groups of centroids as
// that needs, so that a workgroup's fixed cost (its queries, its barriers,
// its atomic extremes) is paid once for several groups.
const scoreWorkgroups = 512

// scoreLanes is the threads that share a centroid row in centroid_score
// where the row allows: at 128 dimensions, each then loads 2 parts of 8
// codes a row and holds 64 query words (4 heads). At batch 8 and 131 072
// tokens 8 lanes scored in 42 µs, 16 in 50 and 32 in 95 (NVIDIA H200,
// bench/README.md, 2026-11-28 (evening, late)).
const scoreLanes = 8

// scoreRowsPerLane is the rows of a group each lane of centroid_score
// takes (the kernel's U): their loads in flight at once, beside the next
// group's.
const scoreRowsPerLane = 2

// scoreDotRowsPerLane is scoreRowsPerLane for centroid_score_dot, whose
// queries in bytes leave registers for more rows in flight: on an H200 at
// 131 072 tokens a batch of 8 took 29.0 µs with 4 rows a lane against 34.0
// with 2, batch 1 8.8 against 8.5, and at 32 768 tokens 11.9 against 11.2
// and 5.5 against 5.6 (BenchmarkCentroidScores, bench/README.md).
const scoreDotRowsPerLane = 4

// scoreQueryWords is the most query words a lane of centroid_score holds
// in registers: its parts of the block's queries.
const scoreQueryWords = 64

// scoreWorkgroupWithSizes is the most threads of a centroid_score
// workgroup that adds ln s_c (Double-P), whose sizes in flight hold more
// registers: on an H200 at 8 lanes its scores took 26.1 µs at batch 8 and
// 32 768 tokens and 50.3 at 131 072 in workgroups of 128 threads (128
// registers, four workgroups an SM), against 27.9 and 63.3 with 256, and
// 32.5 and 55.1 at 16 lanes (74 registers).
const scoreWorkgroupWithSizes = 128

// centroidScorer is centroid_score built for a Dense's heads, with the
// shape of its dispatches.
type centroidScorer struct {
	pipe *vk.Pipeline
	// rows is the centroids of a group (the kernel's ROWS), heads the query
	// heads of a block, kv the KV heads and group the query heads of a KV
	// head; scale is the attention scale's float32 bits.
	rows, heads, kv, group int
	scale                  uint32
}

// scoresByDot reports whether centroid scores of heads of dim dimensions
// take integer dot products (centroid_score_dot) by default: where the
// device accelerates those of four signed bytes and the head's sums fit
// 32 bits (D ≤ 512): on an H200 the scores of a batch of 8 at 131 072
// tokens took 30.2 µs instead of 42.0 (bench/README.md, 2026-11-29
// (evening)).
func scoresByDot(info vk.Info, dim int) bool {
	return info.IntegerDotFast && dim <= maxDotDim
}

// maxDotDim is the most dimensions whose integer sums in
// centroid_score_dot fit 32 bits: 257 · 127 · 127 · D < 2^31.
const maxDotDim = 512

// centroidScores builds centroid_score for dense's heads (with ln s_c
// added where logSize), with integer dot products where dense's options
// choose them (DenseOptions.Scores; by default scoresByDot): blocks of
// 1, 2, 4 or 8 query heads (the group's, rounded up to a power of two), a
// row's lanes scoreLanes where the row has that many parts of 8 codes (fewer for fewer, never fewer than the
// block's heads, more while a lane's parts of the queries exceed
// scoreQueryWords), summed by shuffles where they work, workgroups of
// scoreWorkgroup threads or fewer (scoreWorkgroupWithSizes with ln s_c;
// workgroup × heads × rows a lane ≤ 4096 words, a power of two).
func centroidScores(b *builder, dense *Dense, logSize bool) centroidScorer {
	h, info, dot := dense.heads, dense.dev.Info(), dense.dotScores
	heads := 1
	for heads < min(h.Group(), 8) {
		heads *= 2
	}
	parts := h.Dim / 8 // 8 codes a part
	lanes := 1
	for lanes*2 <= min(parts, scoreLanes) {
		lanes *= 2
	}
	lanes = max(lanes, heads)
	for ceilDiv(parts, lanes)*heads*8 > scoreQueryWords && lanes < 32 {
		lanes *= 2
	}
	rows := scoreRowsPerLane
	if dot {
		rows = scoreDotRowsPerLane
	}
	wg := min(scoreWorkgroup, perHeadWorkgroup(info), uint32(4096/(heads*rows)))
	if logSize {
		wg = min(wg, scoreWorkgroupWithSizes)
	}
	for wg&(wg-1) != 0 {
		wg &= wg - 1
	}
	wg = max(wg, uint32(lanes))
	shuffle := !dense.tree && info.SubgroupShuffle && info.SubgroupSize%uint32(lanes) == 0
	name := "centroid_score"
	if dot {
		name = "centroid_score_dot"
	}
	pipe := b.kernel(name, 7, 4, wg, uint32(h.Dim), uint32(heads), boolWord(logSize), boolWord(shuffle), uint32(lanes), uint32(rows))
	return centroidScorer{pipe: pipe, rows: int(wg) / lanes * rows, heads: heads, kv: h.KV, group: h.Group(), scale: h.scaleBits()}
}

// record appends the dispatch scoring c centroids per KV head with the
// buffers of bind, when sequences such dispatches share a stage: each
// workgroup takes ⌈groups / workgroups⌉ groups of centroids, counting every
// sequence's groups (workgroups ≤ 0: scoreWorkgroups).
func (s centroidScorer) record(cmd *vk.Commands, bind *vk.Binding, c, sequences, workgroups int) {
	if workgroups <= 0 {
		workgroups = scoreWorkgroups
	}
	groups := ceilDiv(c, s.rows)
	blocks := ceilDiv(s.group, s.heads)
	iters := min(groups, ceilDiv(groups*s.kv*blocks*max(1, sequences), workgroups))
	cmd.Dispatch(s.pipe, bind, []uint32{uint32(c), uint32(s.group), s.scale, uint32(iters)}, uint32(ceilDiv(groups, iters)), uint32(s.kv), uint32(blocks))
}

// codedCentroids are an index's centroids as centroid_score reads them:
// 8-bit codes, each row's scale and each head's dimension scales
// (kvcache.Clusters.Codes, Scales and DimScales).
type codedCentroids struct{ codes, scales, dims *vk.Buffer }

// codeCentroids returns the centroids of x in 8 bits: a quantized index's
// own, else copies allocated with b and written through the host
// (kvcache.Clusters.ReadCodes), once per index.
func codeCentroids(b *builder, x *kvcache.Clusters) (codedCentroids, error) {
	if x.Codes != nil {
		return codedCentroids{x.Codes, x.Scales, x.DimScales}, nil
	}
	codes, scales, dims, err := x.ReadCodes()
	if err != nil {
		return codedCentroids{}, fmt.Errorf("sparse: %w", err)
	}
	c := codedCentroids{b.words(len(codes)), b.words(len(scales)), b.words(len(dims))}
	if b.err != nil {
		return codedCentroids{}, b.err
	}
	return c, errors.Join(c.codes.WriteUint32(0, codes), c.scales.WriteFloat32(0, scales), c.dims.WriteFloat32(0, dims))
}

// Attended returns the rows the last step that ran attended for a KV head,
// mean over KV heads: the members of the clusters its query heads took
// (their union), the pseudo-tokens, and every token outside the index, at
// the layer's current length (ask before appending).
func (s *Step) Attended() (float64, error) {
	if s.plan == nil {
		return 0, vk.ErrReleased
	}
	taken, err := s.plan.Taken()
	if err != nil {
		return 0, err
	}
	sum := 0.0
	for _, t := range taken {
		sum += float64(t)
	}
	x := s.plan.index()
	return sum/float64(len(taken)) + float64(s.layer.Len()-x.Count), nil
}
