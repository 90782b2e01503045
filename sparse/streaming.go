package sparse

import (
	"errors"
	"fmt"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/vk"
)

// StreamingSelector is StreamingLLM over a page index (kvcache.NewPages):
// no kernel at all. Its ranks are fixed, Rank[h][c] = C − 1 − c (the most
// recent page first), and its cut, the same for every head, is the fewest
// most recent pages holding at least budget tokens (all of them when the
// budget covers the index); both are written once, when it is made. Over
// single-token pages the cut is min(budget, C) and the selection is
// exactly StreamingSelectRef's; over longer pages it takes whole pages,
// so at least budget tokens. Stages returns none: the step is attention
// alone.
type StreamingSelector struct {
	clusters  *kvcache.Clusters
	owned     *kvcache.Clusters // released with the selector
	rank, cut *vk.Buffer
	pages     int // the cut
}

// NewStreamingStep prepares StreamingLLM steps over layer with a budget
// of budget middle tokens, in the layout of DefaultBaselineLayout at the
// layer's current length: the step attends the sinks, the last budget
// tokens of the middle and every token after it (the window, then the
// tokens appended later). The middle tokens it drops form one page that
// no head takes (the step owns that index), so attention reads only the
// tokens it keeps, with nothing to scan; when the budget covers the
// middle, the page is the whole middle and every head takes it.
func NewStreamingStep(dense *Dense, layer *kvcache.Layer, budget int) (*Step, error) {
	if budget < 0 {
		return nil, fmt.Errorf("sparse: StreamingLLM budget %d is negative", budget)
	}
	lo, hi := DefaultBaselineLayout().Middle(layer.Len())
	if hi <= lo {
		return nil, fmt.Errorf("sparse: no middle tokens in %d (%d sinks, a window of %d)", layer.Len(), BaselineSinks, BaselineWindow)
	}
	drop, keep := hi-lo-budget, 0
	if drop <= 0 {
		drop, keep = hi-lo, budget
	}
	pages, err := kvcache.NewPages(dense.dev, layer.KVHeads(), layer.HeadDim(), lo, drop, drop)
	if err != nil {
		return nil, err
	}
	sel, err := NewStreamingSelector(dense, pages, keep)
	if err != nil {
		return nil, errors.Join(err, pages.Release())
	}
	sel.owned = pages
	return NewStep(dense, layer, sel)
}

// NewStreamingSelector fills StreamingLLM's fixed ranks and cut over pages,
// a page index (kvcache.NewPages: every KV head paged alike). The caller
// keeps pages.
func NewStreamingSelector(dense *Dense, pages *kvcache.Clusters, budget int) (*StreamingSelector, error) {
	h, dev := dense.heads, dense.dev
	if budget < 0 {
		return nil, fmt.Errorf("sparse: StreamingLLM budget %d is negative", budget)
	}
	if pages.KVHeads != h.KV || pages.HeadDim != h.Dim {
		return nil, fmt.Errorf("sparse: an index of %d heads of %d for kernels of %d of %d", pages.KVHeads, pages.HeadDim, h.KV, h.Dim)
	}
	// Pages from the end until they hold the budget (the sizes of KV head
	// 0: every head is paged alike).
	sizes := make([]uint32, pages.C)
	if err := pages.Counts.ReadUint32(0, sizes); err != nil {
		return nil, err
	}
	cut, held := 0, 0
	for cut < pages.C && held < budget {
		held += int(sizes[pages.C-1-cut])
		cut++
	}
	s := &StreamingSelector{clusters: pages, pages: cut}
	var err error
	if s.rank, err = dev.NewBuffer(uint64(h.Query*pages.C)*4, vk.DeviceLocal); err == nil {
		s.cut, err = dev.NewBuffer(uint64(h.Query)*4, vk.DeviceLocal)
	}
	if err == nil {
		rank := make([]uint32, h.Query*pages.C)
		for i := range rank {
			rank[i] = uint32(pages.C - 1 - i%pages.C)
		}
		err = s.rank.WriteUint32(0, rank)
	}
	if err == nil {
		err = dev.Run(func(c *vk.Commands) { c.Fill(s.cut.All(), uint32(cut)) })
	}
	if err != nil {
		return nil, errors.Join(err, s.Release())
	}
	return s, nil
}

// Selection returns the fixed ranks and cuts.
func (s *StreamingSelector) Selection() Selection {
	return Selection{Clusters: s.clusters, Rank: s.rank.All(), Cut: s.cut.All()}
}

// Bind does nothing: the selection does not read the queries.
func (s *StreamingSelector) Bind(vk.Range) error { return nil }

// Stages returns none.
func (s *StreamingSelector) Stages() []string { return nil }

// RecordStage fails: there are no stages.
func (s *StreamingSelector) RecordStage(_ *vk.Commands, stage int) error {
	return fmt.Errorf("sparse: StreamingLLM has no stages (asked for %d)", stage)
}

// Pages returns the cut: the most recent pages every head takes.
func (s *StreamingSelector) Pages() int { return s.pages }

// Release frees the buffers and an index the step made.
func (s *StreamingSelector) Release() error {
	var errs []error
	for _, b := range []*vk.Buffer{s.rank, s.cut} {
		if b != nil {
			errs = append(errs, b.Release())
		}
	}
	if s.owned != nil {
		errs = append(errs, s.owned.Release())
	}
	s.rank, s.cut, s.owned = nil, nil, nil
	return errors.Join(errs...)
}
