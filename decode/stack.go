package decode

import (
	"fmt"
	"time"

	"github.com/vksparse/vksparse/vk"
)

// TimeStack times the attention of one decoded token across the whole
// model: a pass records every layer, 0 to Layers−1 in order, as Record
// records it (its barriers included), for the queries of
// each layer's last SetQuery, so that a DELTA layer attends the pick its
// Δ-layer made earlier in the same pass. It records warmup+reps passes
// back to back in one command buffer and one submission, each pass after
// a full barrier (ordering it after the previous pass) and
// followed by a timestamp, and returns the timed passes' GPU times,
// sorted. Every layer must have had its SetQuery since the active slots
// changed. Output holds what the last pass left, as after Record; H2O's
// state accumulates each pass.
func (m *Model) TimeStack(warmup, reps int) ([]time.Duration, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := m.live(); err != nil {
		return nil, err
	}
	if reps <= 0 || warmup < 0 {
		return nil, fmt.Errorf("decode: TimeStack of %d warm-up and %d timed passes: at least one timed pass, no negative warm-up", warmup, reps)
	}
	for l := range m.layers {
		if !m.layers[l].queried {
			return nil, fmt.Errorf("decode: TimeStack before the SetQuery of layer %d (every layer's queries are set again after the active slots change)", l)
		}
	}
	return m.dev.TimeRuns(m.cmd, warmup, reps, func(c *vk.Commands) error {
		c.Barrier()
		for l := range m.layers {
			if err := m.record(l, c); err != nil {
				return err
			}
		}
		return nil
	})
}
