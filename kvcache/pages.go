package kvcache

import (
	"errors"
	"fmt"

	"github.com/vksparse/vksparse/vk"
)

// NewPages returns a positional index of the tokens [first, first+count)
// of every KV head: pages of pageSize consecutive tokens (the last one
// shorter when pageSize does not divide count) as clusters, in positional
// order. Page c holds the tokens first + pageSize·c … , so Starts[c] =
// pageSize·c and Counts[c] its size; Members and Assign are nil (the
// identity and r / pageSize, which Read returns). Positional order already is
// cluster order, so the index is Contiguous over a layer that was never
// reordered (do not Reorder a layer by it: that would be the identity).
// pageSize 1 makes every token its own cluster.
//
// Centroids and Norms are nil: a page index carries no key summaries (for
// pages of one token they would copy the keys twice over); the policies
// that need them (Quest's per-channel bounds) compute their own from the
// layer. The buffers are filled from the host once.
func NewPages(dev *vk.Device, kvHeads, headDim, first, count, pageSize int) (*Clusters, error) {
	if pageSize <= 0 || count <= 0 || first < 0 || kvHeads <= 0 || headDim <= 0 {
		return nil, fmt.Errorf("kvcache: pages of %d over tokens [%d, %d+%d) of %d heads of %d", pageSize, first, first, count, kvHeads, headDim)
	}
	c := (count + pageSize - 1) / pageSize
	x, err := newClusters(dev, kvHeads, headDim, c, first, count, false, false)
	if err != nil {
		return nil, err
	}
	x.Contiguous, x.PageSize = true, pageSize
	counts, starts := make([]uint32, kvHeads*c), make([]uint32, kvHeads*c)
	for g := 0; g < kvHeads; g++ {
		for j := 0; j < c; j++ {
			starts[g*c+j] = uint32(j * pageSize)
			counts[g*c+j] = uint32(min(pageSize, count-j*pageSize))
		}
	}
	err = errors.Join(
		x.Counts.WriteUint32(0, counts),
		x.Starts.WriteUint32(0, starts))
	if err != nil {
		return nil, errors.Join(fmt.Errorf("kvcache: page index: %w", err), x.Release())
	}
	return x, nil
}
