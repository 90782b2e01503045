package sparse

import (
	"errors"
	"fmt"
	"math"
	"math/bits"
	"time"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/vk"
)

// LuKACompressor is how LuKA folds a segment of tokens into one summary.
type LuKACompressor int

const (
	// LuKAWeighted averages the segment's keys and values with weights
	// softmax(w/τ), w each token's accumulated cover mass while it was raw.
	LuKAWeighted LuKACompressor = iota
	// LuKAMean averages them uniformly.
	LuKAMean
	// LuKARandom keeps one token of the segment, picked by a seeded hash.
	LuKARandom
)

// String names the compressor.
func (c LuKACompressor) String() string {
	switch c {
	case LuKAWeighted:
		return "weighted"
	case LuKAMean:
		return "mean"
	case LuKARandom:
		return "random"
	}
	return fmt.Sprintf("compressor %d", int(c))
}

// LuKARule is which summaries a query refines into their tokens.
type LuKARule int

const (
	// RefineTopK refines the K summaries of greatest cover mass.
	RefineTopK LuKARule = iota
	// RefineThreshold refines those of cover mass above Epsilon.
	RefineThreshold
	// RefineFraction refines the ⌈ρ·S⌉ of greatest cover mass.
	RefineFraction
)

// String names the rule.
func (r LuKARule) String() string {
	switch r {
	case RefineTopK:
		return "top-k"
	case RefineThreshold:
		return "threshold"
	case RefineFraction:
		return "fraction"
	}
	return fmt.Sprintf("rule %d", int(r))
}

// LuKA is the clustered attention of LuKA (one level of summaries): the
// older tokens of a layer are cut into segments of Segment tokens, each
// compressed into one summary key and value; a query attends the cover
// (the summaries, then the raw tokens after them) and refines some
// summaries, spreading each one's cover mass over its tokens by their
// local softmax. Zero fields take the defaults of DefaultLuKA.
type LuKA struct {
	Segment    int            // tokens a summary stands for, 1 to 64
	Recent     int            // the last tokens never compressed
	Every      int            // appended tokens between runs of the segmenter
	Compressor LuKACompressor // how a segment becomes a summary
	Tau        float64        // temperature of LuKAWeighted
	Rule       LuKARule       // which summaries a query refines
	K          int            // RefineTopK's count
	Epsilon    float64        // RefineThreshold's mass, in (0, 1]; 1 refines nothing
	Rho        float64        // RefineFraction's share, in (0, 1]
	Seed       uint32         // LuKARandom's
	// LogSize adds ln Segment to every summary's logit, so that a summary
	// weighs in the cover as its tokens would if their keys were equal
	// (the size term of Double-P's centroid scores). The paper's Eq. 1
	// weighs a summary as one token: false.
	LogSize bool
}

// DefaultLuKA is the paper's configuration: segments of 16 tokens, the
// last 128 kept raw, the segmenter every 16 tokens, attention-weighted
// summaries, and the top 3 summaries refined. τ = 0.1 is this library's
// choice (the paper leaves it open): accumulated masses are small, and
// τ = 1 makes the weighted summary nearly a mean.
func DefaultLuKA() LuKA {
	return LuKA{Segment: 16, Recent: 128, Every: 16, Compressor: LuKAWeighted, Tau: 0.1, Rule: RefineTopK, K: 3, Epsilon: 0.01, Rho: 0.1}
}

// lukaMaxSegment is the longest segment the kernels take.
const lukaMaxSegment = 64

// Resolve fills zero fields with the defaults and reports options out of
// range.
func (o LuKA) Resolve() (LuKA, error) {
	d := DefaultLuKA()
	if o.Segment == 0 {
		o.Segment = d.Segment
	}
	if o.Every == 0 {
		o.Every = d.Every
	}
	if o.Tau == 0 {
		o.Tau = d.Tau
	}
	if o.K == 0 {
		o.K = d.K
	}
	if o.Epsilon == 0 {
		o.Epsilon = d.Epsilon
	}
	if o.Rho == 0 {
		o.Rho = d.Rho
	}
	switch {
	case o.Segment < 1 || o.Segment > lukaMaxSegment:
		return o, fmt.Errorf("sparse: LuKA segments of %d tokens outside [1, %d]", o.Segment, lukaMaxSegment)
	case o.Recent < 0:
		return o, fmt.Errorf("sparse: LuKA keeps %d recent tokens (negative)", o.Recent)
	case o.Every < 1:
		return o, fmt.Errorf("sparse: LuKA's segmenter every %d tokens", o.Every)
	case o.Compressor < LuKAWeighted || o.Compressor > LuKARandom:
		return o, fmt.Errorf("sparse: unknown LuKA %v", o.Compressor)
	case !(o.Tau > 0) || math.IsInf(o.Tau, 0):
		return o, fmt.Errorf("sparse: LuKA's temperature τ = %v is not a positive number", o.Tau)
	case o.Rule < RefineTopK || o.Rule > RefineFraction:
		return o, fmt.Errorf("sparse: unknown LuKA refinement %v", o.Rule)
	case o.K < 1:
		return o, fmt.Errorf("sparse: LuKA refines the top %d summaries", o.K)
	case !(o.Epsilon > 0 && o.Epsilon <= 1):
		return o, fmt.Errorf("sparse: LuKA's refinement threshold ε = %v outside (0, 1]", o.Epsilon)
	case !(o.Rho > 0 && o.Rho <= 1):
		return o, fmt.Errorf("sparse: LuKA's refined fraction ρ = %v outside (0, 1]", o.Rho)
	}
	return o, nil
}

// String describes the options that matter for the rule and compressor.
func (o LuKA) String() string {
	var rule string
	switch o.Rule {
	case RefineTopK:
		rule = fmt.Sprintf("top-%d", o.K)
	case RefineThreshold:
		rule = fmt.Sprintf("ε %g", o.Epsilon)
	default:
		rule = fmt.Sprintf("ρ %g", o.Rho)
	}
	c := o.Compressor.String()
	if o.Compressor == LuKAWeighted {
		c = fmt.Sprintf("weighted τ %g", o.Tau)
	}
	if o.LogSize {
		c += ", + ln P"
	}
	return fmt.Sprintf("LuKA P %d, recent %d, %s, %s", o.Segment, o.Recent, c, rule)
}

// Refines returns how many of s summaries a query refines under rules
// top-K and fraction (the greatest ones), or −1 under the threshold rule.
func (o LuKA) Refines(s int) int {
	switch o.Rule {
	case RefineTopK:
		return min(o.K, s)
	case RefineFraction:
		return min(int(math.Ceil(o.Rho*float64(s)-1e-9)), s)
	}
	return -1
}

// maxRefined is the most summaries a query refines among at most s: under
// the threshold rule ⌊1/ε⌋ (the cover's masses sum to 1), one more for
// rounding.
func (o LuKA) maxRefined(s int) int {
	if n := o.Refines(s); n >= 0 {
		return max(n, 1)
	}
	return max(min(int(1/o.Epsilon)+1, s), 1)
}

// ringSlots is the accumulated-mass ring's length per query head: a power
// of two above the longest raw tail the segmenter leaves.
func (o LuKA) ringSlots() int {
	return 1 << bits.Len(uint(o.Recent+o.Segment+o.Every))
}

// SummaryBias returns what a summary's logit gets added: ln Segment under
// LogSize, else 0.
func (o LuKA) SummaryBias() float64 {
	if o.LogSize {
		return math.Log(float64(o.Segment))
	}
	return 0
}

// Summaries returns how many summaries the segmenter keeps over n tokens:
// the whole segments before the last Recent tokens.
func (o LuKA) Summaries(n int) int { return max(n-o.Recent, 0) / o.Segment }

// Kernel shapes of LuKA's stages.
const (
	lukaScoreThreads  = 256
	lukaScoreSpan     = 512 // nodes a workgroup of luka_score takes
	lukaSelectThreads = 256
	lukaAttendThreads = 256
	lukaChunk         = 128 // nodes a chunk workgroup of luka_attend takes
)

// LuKAStages names LuKAStep's dispatches.
var LuKAStages = []string{"score", "select", "attend"}

// LuKAStep is LuKA's clustered attention for one sequence's layer on the
// GPU: the summaries (fp16, [Hkv][Capacity/P][D] keys and values) and
// the accumulated cover masses of the raw tokens (float32 [Hq][ring]) on
// the device, and a step of three dispatches: the cover's logits and
// normaliser (luka_score), the refined summaries and the masses'
// accumulation (luka_select), and the output (luka_attend). Summary c
// stands for slots [cP, cP+P), which still hold its tokens; the raw tail
// is slots [S·P, Len). Segment runs the segmenter; a caller runs it as
// tokens are appended (decode.Model does, every Every tokens).
type LuKAStep struct {
	dense *Dense
	layer *kvcache.Layer
	opts  LuKA
	maxS  int // summaries the layer's capacity allows
	ring  int // ring slots per query head
	list  int // refined summaries listed per query head at most
	S     int // summaries made
	// nodes is the cover of the last recorded step (0 before one).
	nodes int

	bufs                     []*vk.Buffer
	sumK, sumV, acc          *vk.Buffer // the state
	query, row, part, mz     *vk.Buffer
	arrivedScore, arrivedOut *vk.Buffer // uint32 [Hkv], 0 between steps
	mask, refined, count     *vk.Buffer
	outPart, out             *vk.Buffer

	score, choose, attend, compress             *vk.Pipeline
	scoreBind, chooseBind, attendBind, compBind *vk.Binding
	held                                        uint32 // luka_select's logits in shared memory
	clock                                       stopwatch
	outTo                                       vk.Range // where the output goes (SetOutput); none when Buffer is nil
	holding                                     bool     // the step holds its layer (kvcache.Layer.Hold)
}

// NewLuKAStep prepares LuKA over layer and runs the segmenter over what
// it holds. The layer must not be reordered (slots in token order).
func NewLuKAStep(dense *Dense, layer *kvcache.Layer, opts LuKA) (*LuKAStep, error) {
	return newLuKAStep(dense, layer, opts, 0)
}

// newLuKAStep is NewLuKAStep with luka_select holding at most held logits
// in shared memory (0: as many as fit, up to 8 192); the others it reads
// from the row buffer.
func newLuKAStep(dense *Dense, layer *kvcache.Layer, opts LuKA, held int) (*LuKAStep, error) {
	h, dev := dense.heads, dense.dev
	opts, err := opts.Resolve()
	if err != nil {
		return nil, err
	}
	switch {
	case layer.KVHeads() != h.KV || layer.HeadDim() != h.Dim:
		return nil, fmt.Errorf("sparse: a cache of %d heads of %d for kernels of %d of %d", layer.KVHeads(), layer.HeadDim(), h.KV, h.Dim)
	case h.Group() > 8:
		return nil, fmt.Errorf("%w: LuKA with %d query heads per KV head (at most 8)", vk.ErrUnsupported, h.Group())
	case layer.Positions() != nil:
		return nil, fmt.Errorf("sparse: LuKA over a layer stored in cluster order (its segments are runs of positions)")
	case dev.Info().MaxWorkgroupInvocations < lukaAttendThreads:
		return nil, fmt.Errorf("%w: LuKA needs workgroups of %d threads", vk.ErrUnsupported, lukaAttendThreads)
	}
	if err := layer.Hold(); err != nil {
		return nil, err
	}
	s := &LuKAStep{dense: dense, layer: layer, opts: opts, holding: true}
	s.maxS = layer.Capacity() / opts.Segment
	s.ring = opts.ringSlots()
	s.list = opts.maxRefined(max(s.maxS, 1))
	hq, half := h.Query, h.Dim/2
	rows := s.maxS + s.ring
	b := &builder{dev: dev, bufs: &s.bufs, cache: &dense.kernels}
	w := b.words
	sum := max(s.maxS, 1) * h.KV * half
	s.sumK, s.sumV, s.acc = w(sum), w(sum), w(hq*s.ring)
	s.query, s.row, s.part, s.mz = w(hq*h.Dim), w(hq*rows), w(hq*ceilDiv(rows, lukaScoreSpan)*2), w(hq*2)
	s.arrivedScore, s.arrivedOut = w(h.KV), w(h.KV)
	s.mask, s.refined, s.count = w(hq*s.maskWords()), w(hq*s.list), w(hq)
	s.outPart, s.out = w(hq*s.items()*h.Dim), w(hq*h.Dim)
	shared := dev.Info().SharedMemoryBytes
	// luka_select's shared memory beside the logits: 8 histograms of 256
	// bins, their sums and a word a thread.
	s.held = uint32(min(8192, max(int(shared)-(8*256+256+32+lukaSelectThreads)*4-64, 4)/4))
	if held > 0 {
		s.held = uint32(min(int(s.held), held))
	}
	s.score = b.kernel("luka_score", 7, 9, lukaScoreThreads, uint32(h.Dim), uint32(h.Group()), lukaScoreSpan)
	s.choose = b.kernel("luka_select", 6, 11, lukaSelectThreads, s.held)
	s.attend = b.kernel("luka_attend", 12, 12, lukaAttendThreads, uint32(h.Dim), uint32(h.Group()), lukaChunk, uint32(opts.Segment))
	s.compress = b.kernel("luka_compress", 5, 7, uint32(max(half, opts.Segment)), uint32(h.Dim), uint32(h.Group()), uint32(opts.Segment))
	err = b.err
	if err == nil {
		err = dev.Run(func(c *vk.Commands) {
			for _, x := range []*vk.Buffer{s.acc, s.arrivedScore, s.arrivedOut, s.count} {
				c.Fill(x.All(), 0)
			}
		})
	}
	bind := func(p *vk.Pipeline, r ...vk.Range) *vk.Binding {
		if err != nil {
			return nil
		}
		var x *vk.Binding
		x, err = p.Bind(r...)
		return x
	}
	all := func(bs ...*vk.Buffer) []vk.Range {
		if err != nil { // some buffer may be missing; bind does nothing then
			return nil
		}
		out := make([]vk.Range, len(bs))
		for i, x := range bs {
			out[i] = x.All()
		}
		return out
	}
	keys, values := layer.Keys(), layer.Values()
	s.scoreBind = bind(s.score, all(s.query, keys, s.sumK, s.row, s.part, s.mz, s.arrivedScore)...)
	s.chooseBind = bind(s.choose, all(s.row, s.mz, s.acc, s.mask, s.refined, s.count)...)
	if err == nil {
		err = s.bindAttend()
	}
	s.compBind = bind(s.compress, all(keys, values, s.sumK, s.sumV, s.acc)...)
	if err == nil {
		_, err = s.Segment()
	}
	if err != nil {
		return nil, errors.Join(err, s.Release())
	}
	return s, nil
}

// bindAttend binds luka_attend, its output to OutputRange.
func (s *LuKAStep) bindAttend() error {
	ranges := []vk.Range{s.query.All(), s.layer.Keys().All(), s.layer.Values().All(), s.sumV.All(), s.row.All(), s.mz.All(),
		s.mask.All(), s.refined.All(), s.count.All(), s.outPart.All(), s.arrivedOut.All(), s.OutputRange()}
	b, err := s.attend.Bind(ranges...)
	if err != nil {
		return err
	}
	err = releaseAll(s.attendBind)
	s.attendBind = b
	return err
}

// OutputRange returns where the step writes its output, [Hq][D] float32:
// its own buffer or the range SetOutput gave; a zero Range once released.
func (s *LuKAStep) OutputRange() vk.Range {
	switch {
	case s.outTo.Buffer != nil:
		return s.outTo
	case s.out == nil:
		return vk.Range{}
	}
	return s.out.All()
}

// SetOutput makes the step write its output into r (at least Hq·D
// float32) instead of its own buffer; a zero Range goes back to it. On
// error it writes where it did.
func (s *LuKAStep) SetOutput(r vk.Range) error {
	h := s.dense.heads
	if want := uint64(h.Query*h.Dim) * 4; r.Buffer != nil && r.Size < want {
		return fmt.Errorf("sparse: an output range of %d bytes for %d", r.Size, want)
	}
	if s.attendBind == nil {
		return vk.ErrReleased
	}
	old := s.outTo
	s.outTo = r
	if err := s.bindAttend(); err != nil {
		s.outTo = old
		return err
	}
	return nil
}

// maskWords is the refine mask's words per query head.
func (s *LuKAStep) maskWords() int { return max(ceilDiv(s.maxS, 32), 1) }

// items is luka_attend's partials per query head: chunks, then refined
// summaries.
func (s *LuKAStep) items() int { return ceilDiv(s.maxS+s.ring, lukaChunk) + s.list }

// Options returns the step's resolved options.
func (s *LuKAStep) Options() LuKA { return s.opts }

// Summaries returns the summaries made so far.
func (s *LuKAStep) Summaries() int { return s.S }

// Segment compresses every whole segment before the layer's last Recent
// tokens that no summary stands for yet, and returns how many summaries
// it made. Summaries are made oldest first and never undone; a layer
// truncated below them is refused.
func (s *LuKAStep) Segment() (int, error) {
	if s.compBind == nil {
		return 0, vk.ErrReleased
	}
	n := s.layer.Len()
	if n < s.S*s.opts.Segment {
		return 0, fmt.Errorf("sparse: LuKA's %d summaries stand for %d tokens, the layer holds %d", s.S, s.S*s.opts.Segment, n)
	}
	target := min(s.opts.Summaries(n), s.maxS)
	if target <= s.S {
		return 0, nil
	}
	h := s.dense.heads
	half := h.Dim / 2
	mode := map[LuKACompressor]uint32{LuKAMean: 0, LuKAWeighted: 1, LuKARandom: 2}[s.opts.Compressor]
	push := []uint32{uint32(s.S), uint32(s.layer.HeadBytes() / 4), uint32(max(s.maxS, 1) * half), uint32(s.ring - 1),
		mode, math.Float32bits(float32(1 / s.opts.Tau)), s.opts.Seed}
	err := s.dense.dev.Do(func(c *vk.Commands) error {
		c.Dispatch(s.compress, s.compBind, push, uint32(target-s.S), uint32(h.KV), 1)
		return nil
	})
	if err != nil {
		return 0, err
	}
	made := target - s.S
	s.S = target
	return made, nil
}

// SetQuery uploads the queries, [Hq][D].
func (s *LuKAStep) SetQuery(q []float32) error {
	if s.query == nil {
		return vk.ErrReleased
	}
	if err := checkQuery(q, 1, s.dense.heads); err != nil {
		return err
	}
	return s.query.WriteFloat32(0, q)
}

// Query returns the buffer the step reads its queries from, [Hq][D]
// float32.
func (s *LuKAStep) Query() *vk.Buffer { return s.query }

// Output returns the step's own output buffer, [Hq][D] float32, where it
// writes unless SetOutput sent the output elsewhere.
func (s *LuKAStep) Output() *vk.Buffer { return s.out }

// Stages returns LuKAStages.
func (s *LuKAStep) Stages() []string { return LuKAStages }

// cover returns the step's node count and raw tail, refusing a tail the
// ring cannot hold (the segmenter is behind).
func (s *LuKAStep) cover() (nodes, tail int, err error) {
	n := s.layer.Len()
	tail = s.S * s.opts.Segment
	switch {
	case n <= tail:
		return 0, 0, fmt.Errorf("sparse: LuKA's %d summaries stand for %d tokens and the layer holds %d: nothing raw to attend", s.S, tail, n)
	case n-tail > s.ring:
		return 0, 0, fmt.Errorf("sparse: LuKA's raw tail of %d tokens exceeds %d: run Segment", n-tail, s.ring)
	}
	return s.S + n - tail, tail, nil
}

// RecordStage appends stage i of LuKAStages.
func (s *LuKAStep) RecordStage(c *vk.Commands, stage int) error {
	if s.scoreBind == nil {
		return vk.ErrReleased
	}
	nodes, tail, err := s.cover()
	if err != nil {
		return err
	}
	h := s.dense.heads
	scale := h.scaleBits()
	rows := s.maxS + s.ring
	half := h.Dim / 2
	switch stage {
	case 0:
		push := []uint32{uint32(s.S), uint32(nodes), uint32(tail), scale, uint32(s.layer.HeadBytes() / 16),
			uint32(max(s.maxS, 1) * half / 4), uint32(rows), uint32(ceilDiv(rows, lukaScoreSpan)), math.Float32bits(float32(s.opts.SummaryBias()))}
		c.Dispatch(s.score, s.scoreBind, push, uint32(ceilDiv(nodes, lukaScoreSpan)), uint32(h.KV), 1)
	case 1:
		rule, k := uint32(0), s.opts.Refines(s.S)
		logEps := float32(0)
		if k < 0 {
			rule, k, logEps = 1, 0, float32(math.Log(s.opts.Epsilon))
		}
		push := []uint32{uint32(s.S), uint32(nodes), uint32(tail), uint32(rows), rule, uint32(k), math.Float32bits(logEps),
			uint32(s.ring - 1), 1, uint32(s.maskWords()), uint32(s.list)}
		c.Dispatch(s.choose, s.chooseBind, push, uint32(h.Query), 1, 1)
	case 2:
		chunks := ceilDiv(nodes, lukaChunk)
		push := []uint32{uint32(s.S), uint32(nodes), uint32(tail), scale, uint32(s.layer.HeadBytes() / 16), uint32(s.layer.HeadBytes() / 4),
			uint32(max(s.maxS, 1) * half), uint32(rows), uint32(s.maskWords()), uint32(s.list), uint32(chunks), uint32(s.items())}
		c.Dispatch(s.attend, s.attendBind, push, uint32(chunks+h.Group()*s.list), uint32(h.KV), 1)
	default:
		return fmt.Errorf("sparse: LuKA has %d stages (asked for %d)", len(LuKAStages), stage)
	}
	s.nodes = nodes
	return nil
}

// Record appends the whole step, its stages ordered by compute barriers.
func (s *LuKAStep) Record(c *vk.Commands) error {
	for i := range LuKAStages {
		if i > 0 {
			c.ComputeBarrier()
		}
		if err := s.RecordStage(c, i); err != nil {
			return err
		}
	}
	return nil
}

// Time runs warmup+reps steps back to back in one submission, a
// timestamp around each, and returns the timed runs' GPU times, sorted.
func (s *LuKAStep) Time(warmup, reps int) ([]time.Duration, error) {
	if s.scoreBind == nil {
		return nil, vk.ErrReleased
	}
	return s.clock.time(s.dense.dev, warmup, reps, s.Record)
}

// TimeStages runs reps steps after warmup untimed ones with a timestamp
// after every stage, and returns each stage's median GPU time (LuKAStages
// order) and the median whole step.
func (s *LuKAStep) TimeStages(warmup, reps int) ([]time.Duration, time.Duration, error) {
	if s.scoreBind == nil {
		return nil, 0, vk.ErrReleased
	}
	return timeStages(s.dense.dev, len(LuKAStages), warmup, reps, func(c *vk.Commands, mark func(int)) error {
		for i := range LuKAStages {
			if i > 0 {
				c.ComputeBarrier()
			}
			if err := s.RecordStage(c, i); err != nil {
				return err
			}
			mark(i)
		}
		return nil
	})
}

// Attend runs one step for the queries q ([Hq][D]) and returns the output,
// [Hq][D].
func (s *LuKAStep) Attend(q []float32) ([]float32, error) {
	if err := s.SetQuery(q); err != nil {
		return nil, err
	}
	if err := s.dense.dev.Do(s.Record); err != nil {
		return nil, err
	}
	h := s.dense.heads
	out := make([]float32, h.Query*h.Dim)
	o := s.OutputRange()
	return out, o.Buffer.ReadFloat32(o.Offset, out)
}

// Logits returns the last step's cover logits, [Hq][nodes] (summaries,
// then the raw tail), and each head's normaliser log Z.
func (s *LuKAStep) Logits() ([]float32, []float64, error) {
	if s.nodes == 0 {
		return nil, nil, fmt.Errorf("sparse: LuKA has run no step")
	}
	h := s.dense.heads
	rows := s.maxS + s.ring
	out := make([]float32, h.Query*s.nodes)
	for hh := 0; hh < h.Query; hh++ {
		if err := s.row.ReadFloat32(uint64(hh*rows)*4, out[hh*s.nodes:(hh+1)*s.nodes]); err != nil {
			return nil, nil, err
		}
	}
	mz := make([]float32, 2*h.Query)
	if err := s.mz.ReadFloat32(0, mz); err != nil {
		return nil, nil, err
	}
	logZ := make([]float64, h.Query)
	for hh := range logZ {
		logZ[hh] = float64(mz[2*hh]) + math.Log(float64(mz[2*hh+1]))
	}
	return out, logZ, nil
}

// Refined returns each query head's refined summaries of the last step,
// ascending, and checks that the list agrees with the mask.
func (s *LuKAStep) Refined() ([][]int, error) {
	h := s.dense.heads
	counts, err := readInts(s.count, h.Query)
	if err != nil {
		return nil, err
	}
	lists, err := readInts(s.refined, h.Query*s.list)
	if err != nil {
		return nil, err
	}
	words := make([]uint32, h.Query*s.maskWords())
	if err := s.mask.ReadUint32(0, words); err != nil {
		return nil, err
	}
	out := make([][]int, h.Query)
	for hh := range out {
		out[hh] = append([]int{}, lists[hh*s.list:hh*s.list+counts[hh]]...)
		var fromMask []int
		for j := 0; j < s.S; j++ {
			if words[hh*s.maskWords()+j/32]>>(j%32)&1 != 0 {
				fromMask = append(fromMask, j)
			}
		}
		if len(fromMask) != len(out[hh]) {
			return nil, fmt.Errorf("sparse: LuKA head %d lists %d refined summaries, its mask %d", hh, len(out[hh]), len(fromMask))
		}
		for i := range fromMask {
			if fromMask[i] != out[hh][i] {
				return nil, fmt.Errorf("sparse: LuKA head %d lists summary %d where its mask has %d", hh, out[hh][i], fromMask[i])
			}
		}
	}
	return out, nil
}

// Accumulated returns the raw tokens' accumulated cover masses, [Hq][ring]
// by slot mod ring, and the ring's length.
func (s *LuKAStep) Accumulated() ([]float32, int, error) {
	out := make([]float32, s.dense.heads.Query*s.ring)
	return out, s.ring, s.acc.ReadFloat32(0, out)
}

// SummaryRows returns the summaries' keys and values as fp16 bits,
// [Hkv][S][D] each.
func (s *LuKAStep) SummaryRows() (k, v []uint16, err error) {
	h := s.dense.heads
	k, v = make([]uint16, h.KV*s.S*h.Dim), make([]uint16, h.KV*s.S*h.Dim)
	per := uint64(max(s.maxS, 1) * h.Dim * 2)
	for g := 0; g < h.KV; g++ {
		w := s.S * h.Dim
		if err := errors.Join(s.sumK.ReadUint16(uint64(g)*per, k[g*w:(g+1)*w]), s.sumV.ReadUint16(uint64(g)*per, v[g*w:(g+1)*w])); err != nil {
			return nil, nil, err
		}
	}
	return k, v, nil
}

// Attended returns the rows the last step read per KV head, mean over
// KV heads: the cover's nodes and the refined summaries' tokens (each
// query head's own).
func (s *LuKAStep) Attended() (float64, error) {
	if s.nodes == 0 {
		return 0, fmt.Errorf("sparse: LuKA has run no step")
	}
	counts, err := readInts(s.count, s.dense.heads.Query)
	if err != nil {
		return 0, err
	}
	refined := 0
	for _, c := range counts {
		refined += c
	}
	return float64(s.nodes) + float64(refined*s.opts.Segment)/float64(s.dense.heads.KV), nil
}

// Bytes returns the device memory the step holds.
func (s *LuKAStep) Bytes() uint64 { return vk.Held(s.bufs...) }

// Release frees the step's buffers (its kernels belong to the Dense).
func (s *LuKAStep) Release() error {
	if s.bufs == nil && s.scoreBind == nil {
		return vk.ErrReleased
	}
	s.clock.release()
	if s.holding {
		s.layer.Drop()
		s.holding = false
	}
	err := errors.Join(releaseAll(s.scoreBind, s.chooseBind, s.attendBind, s.compBind), releaseAll(s.bufs...))
	s.scoreBind, s.chooseBind, s.attendBind, s.compBind, s.bufs = nil, nil, nil, nil, nil
	s.sumK, s.sumV, s.acc, s.query, s.row, s.part, s.mz, s.out = nil, nil, nil, nil, nil, nil, nil, nil
	return err
}
