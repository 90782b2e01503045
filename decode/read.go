package decode

import (
	"fmt"
)

// ReadSequence reads back the tokens stored in slot's layer in sequence
// order: keys and values as fp16 bit patterns, [KVHeads][Len][Dim], the
// n-th row of a head being the sequence's n-th token whatever order the
// cache keeps them in (clustered policies store them in cluster order).
func (m *Model) ReadSequence(slot, layer int) (k, v []uint16, err error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := m.live(); err != nil {
		return nil, nil, err
	}
	if err := m.checkSlot(slot); err != nil {
		return nil, nil, err
	}
	if err := m.checkLayer(layer); err != nil {
		return nil, nil, err
	}
	cache := m.slots[slot].seq[layer].cache
	stored, values, err := cache.Read()
	if err != nil {
		return nil, nil, fmt.Errorf("decode: slot %d layer %d: %w", slot, layer, err)
	}
	pos, err := cache.ReadPositions()
	if err != nil {
		return nil, nil, fmt.Errorf("decode: slot %d layer %d: %w", slot, layer, err)
	}
	h, n := m.cfg.Heads, cache.Len()
	k, v = make([]uint16, len(stored)), make([]uint16, len(values))
	seen := make([]bool, n)
	for g := 0; g < h.KV; g++ {
		clear(seen)
		for r := 0; r < n; r++ {
			p := int(pos[g*n+r])
			if p < 0 || p >= n || seen[p] {
				return nil, nil, fmt.Errorf("decode: slot %d layer %d head %d: stored row %d holds position %d, not a permutation of [0, %d)", slot, layer, g, r, p, n)
			}
			seen[p] = true
			src, dst := (g*n+r)*h.Dim, (g*n+p)*h.Dim
			copy(k[dst:dst+h.Dim], stored[src:src+h.Dim])
			copy(v[dst:dst+h.Dim], values[src:src+h.Dim])
		}
	}
	return k, v, nil
}
