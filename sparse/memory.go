package sparse

import "github.com/vksparse/vksparse/vk"

// Bytes returns the device memory the plan holds: its queries, partials,
// counters, output, token lists and logits.
func (p *DensePlan) Bytes() uint64 {
	if p.mode == nil {
		return 0
	}
	return vk.Held(p.query, p.partO, p.partML, p.arrivals, p.out, p.taken) + p.mode.bytes()
}

// sized is a selector that reports its device memory.
type sized interface{ Bytes() uint64 }

// Bytes returns the device memory the step holds: its plan and its
// selector's buffers (with an index the selector owns), not the layer or
// an index the caller keeps.
func (s *Step) Bytes() uint64 {
	if s.plan == nil {
		return 0
	}
	n := s.plan.Bytes()
	if x, ok := s.sel.(sized); ok {
		n += x.Bytes()
	}
	return n
}

// Bytes returns the device memory of the batch's steps.
func (b *Batch) Bytes() uint64 {
	var n uint64
	for _, s := range b.steps {
		n += s.Bytes()
	}
	return n
}

// Bytes returns the device memory of the batch's steps.
func (b *TacticBatch) Bytes() uint64 { return b.batch.Bytes() }

// Bytes returns the device memory of the selector's buffers.
func (s *tacticSelector) Bytes() uint64 { return vk.Held(s.bufs...) }

// Bytes returns the device memory of the selector's buffers and owned index.
func (s *binSelector) Bytes() uint64 { return vk.Held(s.bufs...) + s.owned.Bytes() }

// Bytes returns the device memory of the selector's buffers.
func (s *DoublePSelector) Bytes() uint64 { return vk.Held(s.bufs...) }

// Bytes returns the device memory of the selector's buffers, its own
// scratch (none once it shares a workspace) and owned index.
func (s *H2OSelector) Bytes() uint64 {
	return vk.Held(s.bufs...) + vk.Held(s.ownScratch) + s.owned.Bytes()
}

// Bytes returns the device memory of the selector's buffers and owned index.
func (s *StreamingSelector) Bytes() uint64 { return vk.Held(s.rank, s.cut) + s.owned.Bytes() }

// Bytes returns the device memory of the scratch kept between clusterings.
func (km *KMeans) Bytes() uint64 { return vk.Held(km.changed, km.cursor, km.halves, km.readback) }

// Bytes returns the device memory of the pick: its index, ranks and cuts.
func (x *DeltaSelect) Bytes() uint64 { return x.index.Bytes() + vk.Held(x.rank, x.cut) }
