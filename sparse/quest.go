package sparse

import (
	"errors"
	"fmt"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/vk"
)

// QuestSelector is Quest on the GPU over a page index (kvcache.NewPages):
// when it is made, every page's per-channel key minima and maxima
// (shaders/page_bounds.comp); every step, in one dispatch
// (shaders/select_bins.comp), each page's bound scale·Σ_i max(q_i·min_i,
// q_i·max_i), pages ranked by bins of the bound (ScoreBin semantics) and
// the cut at the fewest leading bins holding at least k pages. Whole bins
// are taken, so a head takes at least k pages, more where the k-th page's
// bin holds others (BinnedTopKRef states it exactly).
type QuestSelector struct{ *binSelector }

// NewQuestStep prepares Quest steps over layer with a budget of budget
// middle tokens, in the layout of DefaultBaselineLayout at the layer's
// current length: the middle in pages of QuestPageSize (the step owns
// that index), k = ⌊budget / QuestPageSize⌋ pages, every page where the
// budget covers the middle. The sinks and every token after the middle
// (the recent window, then the tokens appended later) are attended.
func NewQuestStep(dense *Dense, layer *kvcache.Layer, budget int) (*Step, error) {
	if err := checkLayerBudget("Quest", budget, layer); err != nil {
		return nil, err
	}
	pages, err := baselinePages(dense, layer, QuestPageSize)
	if err != nil {
		return nil, err
	}
	k := budget / QuestPageSize
	if budget >= pages.Count {
		k = pages.C
	}
	sel, err := NewQuestSelector(dense, layer, pages, k)
	if err != nil {
		return nil, errors.Join(err, pages.Release())
	}
	sel.owned = pages
	return NewStep(dense, layer, sel)
}

// baselinePages returns a page index of pageSize over the middle of
// DefaultBaselineLayout at the layer's length.
// checkLayerBudget refuses a fixed budget of middle tokens outside [1, the
// layer's capacity].
func checkLayerBudget(policy string, budget int, layer *kvcache.Layer) error {
	if budget < 1 || budget > layer.Capacity() {
		return fmt.Errorf("sparse: %s budget of %d tokens outside [1, %d] (the layer's capacity)", policy, budget, layer.Capacity())
	}
	return nil
}

func baselinePages(dense *Dense, layer *kvcache.Layer, pageSize int) (*kvcache.Clusters, error) {
	lo, hi := DefaultBaselineLayout().Middle(layer.Len())
	if hi <= lo {
		return nil, fmt.Errorf("sparse: no middle tokens in %d (%d sinks, a window of %d)", layer.Len(), BaselineSinks, BaselineWindow)
	}
	return kvcache.NewPages(dense.dev, layer.KVHeads(), layer.HeadDim(), lo, hi-lo, pageSize)
}

// NewQuestSelector builds Quest's selection of k pages per query head
// over pages, an index of layer (its clusters read as pages: kvcache.
// NewPages), and computes the pages' key bounds. The caller keeps pages.
func NewQuestSelector(dense *Dense, layer *kvcache.Layer, pages *kvcache.Clusters, k int) (*QuestSelector, error) {
	b, err := newBinSelector(dense, layer, pages, scoreBounds, false, 0, k)
	if err != nil {
		return nil, err
	}
	return &QuestSelector{b}, nil
}

// Selection returns the pages' bins as ranks and the cuts.
func (s *QuestSelector) Selection() Selection { return s.selection() }

// Bind makes the kernel read the queries from query.
func (s *QuestSelector) Bind(query vk.Range) error { return s.bindQuery(query) }

// Stages returns SelectStages.
func (s *QuestSelector) Stages() []string { return SelectStages }

// RecordStage appends the selection (stage 0).
func (s *QuestSelector) RecordStage(c *vk.Commands, stage int) error { return s.recordStage(c, stage) }

// Scores returns the last step's page bounds (scaled), [Hq][C].
func (s *QuestSelector) Scores() ([]float32, error) { return s.scores() }

// Bins returns the last step's bin of every page, [Hq][C].
func (s *QuestSelector) Bins() ([]int, error) { return s.bins() }

// Cuts returns the last step's cut per query head, in bins.
func (s *QuestSelector) Cuts() ([]int, error) { return s.cuts() }

// Bounds returns the pages' key minima and maxima, [Hkv][C][D] each.
func (s *QuestSelector) Bounds() (lo, hi []float32, err error) { return s.bounds() }

// Release frees the kernel, its buffers and an index the step made.
func (s *QuestSelector) Release() error { return s.release() }
