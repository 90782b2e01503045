package sparse

import (
	"errors"
	"fmt"
	"math"

	"github.com/x448/float16"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/vk"
)

// DoublePStages names the dispatches of Double-P's selection: logits of
// the size-weighted centroids, then both cuts (one workgroup per query
// head).
var DoublePStages = []string{"score", "cut"}

// DoublePSelector is Double-P's selection (the Double-P paper, section 4)
// on the GPU, in two dispatches (shaders/centroid_score.comp,
// doublep_cut.comp): per query head h and cluster c the pseudo-token logit
// ℓ = scale·q_h·C_c + ln s_c (C_c in 8 bits against its KV head's
// dimension scales, kvcache.Clusters.Quantize, when the selector is made
// from an index not yet quantized), clusters ranked by bins of ℓ
// (DoublePBinRanks), and two cuts in bins, keep for P1 of the
// estimated mass and exact for P2 of the kept mass (DoublePCutsRef over
// the bins, the bins' masses summed in fixed point). Attention then takes
// the clusters below the exact cut exactly (their union over the group)
// and the other kept ones as pseudo-tokens of value V̄_c, the mean value
// row computed when the selector is made (Eq. 2).
type DoublePSelector struct {
	dense    *Dense
	clusters *kvcache.Clusters
	opts     DoubleP
	score    centroidScorer
	// scoreWorkgroups, where positive, replaces scoreWorkgroups (tests use
	// it to score several groups of centroids per workgroup).
	scoreWorkgroups int
	// sequences is how many sequences' selections share the score stage's
	// dispatches (a batch's, stageSharer): they take scoreWorkgroups in all.
	sequences   int
	cut         *vk.Pipeline
	binds       struct{ score, cut *vk.Binding }
	bufs        []*vk.Buffer
	logits      *vk.Buffer     // float32 [Hq][C]
	binOf       *vk.Buffer     // uint32 [Hq][C]
	exact, keep *vk.Buffer     // uint32 [Hq]
	means       *vk.Buffer     // fp16 [Hkv][C][D], each cluster's mean value row rounded
	centroids   codedCentroids // the index's centroids in 8 bits
	extremes    *vk.Buffer     // uint32 [Hq][2], 0 between steps
}

// NewDoublePStep prepares Double-P decode steps with targets opts over
// layer, clustered as clusters says (the layer in cluster order:
// kvcache.Layer.Reorder); tokens outside the index (the sinks before it,
// the recent tail after it) are attended exactly.
func NewDoublePStep(dense *Dense, layer *kvcache.Layer, clusters *kvcache.Clusters, opts DoubleP) (*Step, error) {
	sel, err := NewDoublePSelector(dense, layer, clusters, opts)
	if err != nil {
		return nil, err
	}
	return NewStep(dense, layer, sel)
}

// NewDoublePSelector builds Double-P's selection kernel for clusters of
// layer and computes the clusters' mean value rows.
func NewDoublePSelector(dense *Dense, layer *kvcache.Layer, clusters *kvcache.Clusters, opts DoubleP) (*DoublePSelector, error) {
	h, dev := dense.heads, dense.dev
	switch {
	case opts.validate() != nil:
		return nil, opts.validate()
	case h.checkIndex(layer, clusters) != nil:
		return nil, h.checkIndex(layer, clusters)
	case !clusters.Contiguous:
		return nil, fmt.Errorf("sparse: Double-P reads clusters as runs of slots: put the layer in cluster order first (kvcache.Layer.Reorder)")
	}
	s := &DoublePSelector{dense: dense, clusters: clusters, opts: opts, sequences: 1}
	b := &builder{dev: dev, bufs: &s.bufs, cache: &dense.kernels}
	hq, c := h.Query, clusters.C
	s.logits, s.binOf, s.exact, s.keep = b.words(hq*c), b.words(hq*c), b.words(hq), b.words(hq)
	s.means = b.words(h.KV * c * h.Dim / 2)
	s.extremes = b.words(2 * hq)
	s.score = centroidScores(b, dense, true)
	s.cut = doublePCut(b)
	err := b.err
	if err == nil {
		s.centroids, err = codeCentroids(b, clusters) // a quantized index's own, or copies
	}
	if err == nil {
		err = s.computeMeans(layer)
	}
	if err == nil {
		err = dev.Run(func(c *vk.Commands) { c.Fill(s.extremes.All(), 0) })
	}
	if err != nil {
		return nil, errors.Join(err, s.Release())
	}
	return s, nil
}

// doublePCut builds doublep_cut: one workgroup per head, as many threads as
// the device allows up to the bins.
func doublePCut(b *builder) *vk.Pipeline {
	return b.kernel("doublep_cut", 5, 4, min(perHeadWorkgroup(b.dev.Info()), ScoreBins), ScoreBins, 10)
}

// meansWorkgroup is the threads per workgroup of cluster_means.
const meansWorkgroup = 128

// computeMeans writes every cluster's mean value row (cluster_means).
func (s *DoublePSelector) computeMeans(layer *kvcache.Layer) error {
	h, dev, x := s.dense.heads, s.dense.dev, s.clusters
	if meansWorkgroup%(h.Dim/8) != 0 || layer.HeadBytes()*uint64(h.KV) > uint64(dev.Info().MaxStorageBufferRange) {
		return fmt.Errorf("%w: cluster means of head dimension %d over %d bytes of values", vk.ErrUnsupported, h.Dim, layer.HeadBytes()*uint64(h.KV))
	}
	rows := meansWorkgroup / (h.Dim / 8)
	return runKernelOnce(dev, "cluster_means", []uint32{meansWorkgroup, uint32(h.Dim)},
		[]vk.Range{layer.Values().All(), x.Starts.All(), x.Counts.All(), s.means.All()},
		[]uint32{uint32(x.C), uint32(layer.HeadBytes() / 16), uint32(x.First)}, [3]uint32{uint32(ceilDiv(x.C, rows)), uint32(h.KV), 1})
}

// Selection returns the ranks (bins), the exact cut and the pseudo-tokens
// of the kept clusters.
func (s *DoublePSelector) Selection() Selection {
	return Selection{Clusters: s.clusters, Rank: s.binOf.All(), Cut: s.exact.All(),
		Approx: &Approximation{Keep: s.keep.All(), Logits: s.logits.All(), Means: s.means.All()}}
}

// Bind makes the kernels read the queries from query.
func (s *DoublePSelector) Bind(query vk.Range) error {
	x := s.clusters
	score, err := s.score.pipe.Bind(query, s.centroids.codes.All(), s.logits.All(), x.Counts.All(), s.extremes.All(), s.centroids.scales.All(), s.centroids.dims.All())
	if err != nil {
		return err
	}
	cut, err := s.cut.Bind(s.logits.All(), s.binOf.All(), s.exact.All(), s.keep.All(), s.extremes.All())
	if err != nil {
		return errors.Join(err, score.Release())
	}
	old := releaseAll(s.binds.score, s.binds.cut)
	s.binds.score, s.binds.cut = score, cut
	return old
}

// Stages returns DoublePStages.
func (s *DoublePSelector) Stages() []string { return DoublePStages }

// RecordStage appends stage 0 (scores) or 1 (cuts).
func (s *DoublePSelector) RecordStage(c *vk.Commands, stage int) error {
	if s.binds.score == nil {
		return fmt.Errorf("sparse: Double-P needs its queries bound")
	}
	h, x := s.dense.heads, s.clusters
	switch stage {
	case 0:
		s.score.record(c, s.binds.score, x.C, s.sequences, s.scoreWorkgroups)
	case 1:
		quant := massScale(x.C)
		c.Dispatch(s.cut, s.binds.cut, []uint32{uint32(x.C), math.Float32bits(float32(s.opts.P1)), math.Float32bits(float32(s.opts.P2)), math.Float32bits(float32(quant))},
			uint32(h.Query), 1, 1)
	default:
		return fmt.Errorf("sparse: Double-P has 2 stages, not %d", stage+1)
	}
	return nil
}

// shareStages sizes the score stage's dispatches for sequences
// selections recorded together (stageSharer).
func (s *DoublePSelector) shareStages(sequences int) { s.sequences = sequences }

// Logits returns the last step's pseudo-token logits, [Hq][C].
func (s *DoublePSelector) Logits() ([]float32, error) {
	out := make([]float32, s.dense.heads.Query*s.clusters.C)
	return out, s.logits.ReadFloat32(0, out)
}

// Bins returns the last step's rank (bin) of every cluster, [Hq][C].
func (s *DoublePSelector) Bins() ([]int, error) {
	return readInts(s.binOf, s.dense.heads.Query*s.clusters.C)
}

// Cuts returns the last step's exact and keep cuts per query head.
func (s *DoublePSelector) Cuts() (exact, keep []int, err error) {
	if exact, err = readInts(s.exact, s.dense.heads.Query); err != nil {
		return nil, nil, err
	}
	keep, err = readInts(s.keep, s.dense.heads.Query)
	return exact, keep, err
}

// Means returns the clusters' mean value rows as stored (rounded to
// fp16), [Hkv][C][D].
func (s *DoublePSelector) Means() ([]float32, error) {
	h := s.dense.heads
	halves := make([]uint16, h.KV*s.clusters.C*h.Dim)
	if err := s.means.ReadUint16(0, halves); err != nil {
		return nil, err
	}
	out := make([]float32, len(halves))
	for i, x := range halves {
		out[i] = float16.Frombits(x).Float32()
	}
	return out, nil
}

// Release frees the kernels, their bindings and the buffers.
func (s *DoublePSelector) Release() error {
	err := errors.Join(releaseAll(s.binds.score, s.binds.cut), releaseAll(s.bufs...))
	s.binds.score, s.binds.cut, s.score, s.cut, s.bufs = nil, nil, centroidScorer{}, nil, nil
	return err
}
