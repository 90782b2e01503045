package sparse

import (
	"errors"

	"fmt"
	"github.com/x448/float16"
	"math"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/vk"
)

// SelectStages names the dispatches of the selections by bins of a score
// (Quest and the oracles): scores, bins and cut in one dispatch.
var SelectStages = []string{"select"}

// binScore is the score kind of shaders/select_bins.comp.
type binScore uint32

const (
	// scoreBounds is Quest's: scale · Σ_i max(q_i·lo_i, q_i·hi_i) over a
	// cluster's per-channel key bounds.
	scoreBounds binScore = 0
	// scoreMass is the log of a cluster's true mass,
	// log Σ_{t∈c} exp(scale·q·k_t).
	scoreMass binScore = 1
)

// binSelector is a selection of clusters by bins of a per-cluster score
// (shaders/select_bins.comp), one dispatch a step: every query head ranks
// the clusters of its KV head by the bin of their score (ScoreBin
// semantics, bin 0 the best) and cuts at the fewest leading bins holding
// at least k clusters (top-k) or, with the mass of the tokens outside the
// index, at least p of all the mass (top-p). It is the shared part of QuestSelector and OracleSelector.
type binSelector struct {
	dense    *Dense
	layer    *kvcache.Layer
	clusters *kvcache.Clusters
	owned    *kvcache.Clusters // released with the selector
	kind     binScore
	topP     bool
	p        float64
	k        int
	pipe     *vk.Pipeline
	bind     *vk.Binding
	// rows is the rows a workgroup scores, heads the query heads of its
	// block.
	rows, heads int
	bufs        []*vk.Buffer
	lo, hi      *vk.Buffer // fp16 [Hkv][C][D]: scoreBounds only
	row         *vk.Buffer // float32 [Hq][R]
	score       *vk.Buffer // float32 [Hq][C]
	binOf, cut  *vk.Buffer // uint32 [Hq][C] and [Hq]
	arrived     *vk.Buffer // uint32 [Hkv][blocks], 0 between steps
	extremes    *vk.Buffer // uint32 [Hq][2]: scoreBounds' extremes, 0 between steps
}

// newBinSelector builds the selection kernel over clusters of layer (in
// cluster order), with top-p target p when topP, else top-k of k clusters.
func newBinSelector(dense *Dense, layer *kvcache.Layer, clusters *kvcache.Clusters, kind binScore, topP bool, p float64, k int) (*binSelector, error) {
	h, dev := dense.heads, dense.dev
	switch {
	case h.checkIndex(layer, clusters) != nil:
		return nil, h.checkIndex(layer, clusters)
	case !clusters.Contiguous:
		return nil, fmt.Errorf("sparse: the selection reads clusters as runs of slots: put the layer in cluster order first (kvcache.Layer.Reorder)")
	case topP && !(p > 0 && p <= 1):
		return nil, fmt.Errorf("sparse: top-p target %v outside (0, 1]", p)
	case !topP && k < 0:
		return nil, fmt.Errorf("sparse: top-k of %d clusters", k)
	case h.Dim%8 != 0 || layer.HeadBytes()*uint64(h.KV) > uint64(dev.Info().MaxStorageBufferRange):
		return nil, fmt.Errorf("%w: selection over keys of dimension %d in %d bytes", vk.ErrUnsupported, h.Dim, layer.HeadBytes()*uint64(h.KV))
	}
	s := &binSelector{dense: dense, layer: layer, clusters: clusters, kind: kind, topP: topP, p: p, k: k}
	b := &builder{dev: dev, bufs: &s.bufs, cache: &dense.kernels}
	var wg uint32
	s.pipe, s.heads, wg = selectBinsKernel(b, h, kind, topP)
	s.rows = int(wg) / 8
	alloc := b.words
	hq, c := h.Query, clusters.C
	s.row, s.score = alloc(hq*s.rowStride()), alloc(hq*c)
	s.binOf, s.cut = alloc(hq*c), alloc(hq)
	s.arrived, s.extremes = alloc(h.KV*ceilDiv(h.Group(), s.heads)), alloc(2*hq)
	if kind == scoreBounds {
		s.lo, s.hi = alloc(h.KV*c*h.Dim/2), alloc(h.KV*c*h.Dim/2)
	}
	err := b.err
	if err == nil && kind == scoreBounds {
		err = s.computeBounds()
	}
	if err == nil {
		err = dev.Run(func(c *vk.Commands) {
			c.Fill(s.arrived.All(), 0)
			c.Fill(s.extremes.All(), 0)
		})
	}
	if err != nil {
		return nil, errors.Join(err, s.release())
	}
	return s, nil
}

// selectBinsKernel builds select_bins for heads h, scoring kind, top-p
// where topP (else top-k): blocks of up to 8 query heads, the workgroup as
// large as the scratch allows (workgroup × heads ≤ 4096 words), a power of
// two of at most ScoreBins threads. It returns the kernel, the heads of a
// block and the workgroup's threads.
func selectBinsKernel(b *builder, h Heads, kind binScore, topP bool) (pipe *vk.Pipeline, heads int, wg uint32) {
	heads = min(h.Group(), 8)
	wg = min(perHeadWorkgroup(b.dev.Info()), uint32(4096/heads), ScoreBins)
	for wg&(wg-1) != 0 {
		wg &= wg - 1
	}
	pipe = b.kernel("select_bins", 12, 11, wg, uint32(h.Dim), uint32(heads), ScoreBins, 10, uint32(kind), boolWord(topP))
	return pipe, heads, wg
}

// rowStride is the rows the kernel keeps per query head: the clusters
// (scoreBounds) or the layer's slots (scoreMass).
func (s *binSelector) rowStride() int {
	if s.kind == scoreBounds {
		return s.clusters.C
	}
	return s.layer.Capacity()
}

// rowCount is the rows the kernel scores per query head: the clusters
// (scoreBounds) or the slots stored (scoreMass; the mass of the slots
// outside the index enters the top-p target).
func (s *binSelector) rowCount() int {
	if s.kind == scoreBounds {
		return s.clusters.C
	}
	return s.layer.Len()
}

// boundsWorkgroup is the threads per workgroup of page_bounds.
const boundsWorkgroup = 128

// computeBounds writes every cluster's per-channel key minima and maxima
// (page_bounds).
func (s *binSelector) computeBounds() error {
	h, dev, x := s.dense.heads, s.dense.dev, s.clusters
	return runKernelOnce(dev, "page_bounds", []uint32{boundsWorkgroup, uint32(h.Dim)},
		[]vk.Range{s.layer.Keys().All(), x.Starts.All(), x.Counts.All(), s.lo.All(), s.hi.All()},
		[]uint32{uint32(x.C), uint32(s.layer.HeadBytes() / 4), uint32(x.First)}, [3]uint32{uint32(ceilDiv(x.C*h.Dim/2, boundsWorkgroup)), uint32(h.KV), 1})
}

func (s *binSelector) selection() Selection {
	return Selection{Clusters: s.clusters, Rank: s.binOf.All(), Cut: s.cut.All()}
}

func (s *binSelector) bindQuery(query vk.Range) error {
	x := s.clusters
	lo, hi := s.row.All(), s.row.All() // unused bindings get a valid range
	if s.lo != nil {
		lo, hi = s.lo.All(), s.hi.All()
	}
	b, err := s.pipe.Bind(query, s.layer.Keys().All(), lo, hi, s.row.All(), s.score.All(), x.Starts.All(), x.Counts.All(), s.binOf.All(), s.cut.All(), s.arrived.All(), s.extremes.All())
	if err != nil {
		return err
	}
	old := releaseAll(s.bind)
	s.bind = b
	return old
}

func (s *binSelector) recordStage(c *vk.Commands, stage int) error {
	if stage != 0 || s.bind == nil {
		return fmt.Errorf("sparse: the selection has one stage (asked for %d) and needs its queries bound", stage)
	}
	h, x := s.dense.heads, s.clusters
	quant := massScale(x.C)
	push := []uint32{uint32(x.C), uint32(s.rowStride()), uint32(h.Group()), h.scaleBits(),
		math.Float32bits(float32(s.p)), uint32(s.k), math.Float32bits(float32(quant)), uint32(x.First), uint32(s.layer.HeadBytes() / 16),
		uint32(s.rowCount()), uint32(x.Count)}
	c.Dispatch(s.pipe, s.bind, push, uint32(ceilDiv(s.rowCount(), s.rows)), uint32(h.KV), uint32(ceilDiv(h.Group(), s.heads)))
	return nil
}

// scores returns the last step's score of every cluster, [Hq][C].
func (s *binSelector) scores() ([]float32, error) {
	out := make([]float32, s.dense.heads.Query*s.clusters.C)
	return out, s.score.ReadFloat32(0, out)
}

// bins returns the last step's bin of every cluster, [Hq][C].
func (s *binSelector) bins() ([]int, error) {
	return readInts(s.binOf, s.dense.heads.Query*s.clusters.C)
}

// cuts returns the last step's cut per query head, in bins.
func (s *binSelector) cuts() ([]int, error) { return readInts(s.cut, s.dense.heads.Query) }

// bounds returns the clusters' key minima and maxima, [Hkv][C][D] each
// (scoreBounds only).
func (s *binSelector) bounds() (lo, hi []float32, err error) {
	n := s.dense.heads.KV * s.clusters.C * s.dense.heads.Dim
	lh, hh := make([]uint16, n), make([]uint16, n)
	if err := errors.Join(s.lo.ReadUint16(0, lh), s.hi.ReadUint16(0, hh)); err != nil {
		return nil, nil, err
	}
	lo, hi = make([]float32, n), make([]float32, n)
	for i := range lh {
		lo[i], hi[i] = float16.Frombits(lh[i]).Float32(), float16.Frombits(hh[i]).Float32()
	}
	return lo, hi, nil
}

func (s *binSelector) release() error {
	err := errors.Join(releaseAll(s.bind), releaseAll(s.bufs...), releaseAll(s.owned))
	s.bind, s.pipe, s.bufs, s.owned = nil, nil, nil, nil
	return err
}
