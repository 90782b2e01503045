package soak

import (
	"fmt"
	"slices"

	"github.com/vksparse/vksparse/sparse"
)

// state is the float64 model of what every slot of a decode.Model holds:
// each prefilled layer's tokens in token order, as the cache stores them
// (fp16 bit patterns) and decoded. Every soaked model receives the same
// operations, so one state describes them all.
type state struct {
	kv, dim int
	slots   [][]*layerState // [slot][layer], nil where the layer is not prefilled
}

// layerState is one slot's layer: keys and values per KV head, in token
// order, and the prefill's length (the tokens after it were appended).
type layerState struct {
	prefill int
	k, v    [][]uint16  // [KV][tokens·Dim]
	kf, vf  [][]float64 // decoded
}

func newState(slots, layers, kv, dim int) *state {
	s := &state{kv: kv, dim: dim, slots: make([][]*layerState, slots)}
	for i := range s.slots {
		s.slots[i] = make([]*layerState, layers)
	}
	return s
}

// tokens returns the tokens slot's layer holds (0: not prefilled).
func (s *state) tokens(slot, layer int) int {
	if ls := s.slots[slot][layer]; ls != nil {
		return len(ls.k[0]) / s.dim
	}
	return 0
}

// prefilled returns how many of slot's layers are prefilled.
func (s *state) prefilled(slot int) int {
	n := 0
	for _, ls := range s.slots[slot] {
		if ls != nil {
			n++
		}
	}
	return n
}

// active returns the slots whose every layer is prefilled, ascending.
func (s *state) active() []int {
	var out []int
	for i := range s.slots {
		if s.prefilled(i) == len(s.slots[i]) {
			out = append(out, i)
		}
	}
	return out
}

// slotPrefill returns the prefill length of slot's prefilled layers (0:
// none).
func (s *state) slotPrefill(slot int) int {
	for _, ls := range s.slots[slot] {
		if ls != nil {
			return ls.prefill
		}
	}
	return 0
}

// store adds tokens to slot's layer: k and v are [KV][count][Dim] fp16.
func (s *state) store(slot, layer int, k, v []uint16, count int) {
	ls := s.slots[slot][layer]
	if ls == nil {
		ls = &layerState{prefill: count, k: make([][]uint16, s.kv), v: make([][]uint16, s.kv), kf: make([][]float64, s.kv), vf: make([][]float64, s.kv)}
		s.slots[slot][layer] = ls
	}
	per := count * s.dim
	for g := 0; g < s.kv; g++ {
		kg, vg := k[g*per:(g+1)*per], v[g*per:(g+1)*per]
		ls.k[g] = append(ls.k[g], kg...)
		ls.v[g] = append(ls.v[g], vg...)
		ls.kf[g] = append(ls.kf[g], sparse.HalvesToFloat64(kg)...)
		ls.vf[g] = append(ls.vf[g], sparse.HalvesToFloat64(vg)...)
	}
}

// free empties every layer of slot.
func (s *state) free(slot int) {
	for l := range s.slots[slot] {
		s.slots[slot][l] = nil
	}
}

// checkCache compares what the device stores for a layer, read back in
// sequence order (k and v [KV][n][Dim]), with ls bit for bit.
func (ls *layerState) checkCache(k, v []uint16, kv, dim int) error {
	n := len(ls.k[0]) / dim
	if len(k) != kv*n*dim || len(v) != len(k) {
		return fmt.Errorf("the cache holds %d rows of keys and %d of values, want %d tokens × %d heads", len(k)/max(dim, 1), len(v)/max(dim, 1), n, kv)
	}
	for g := 0; g < kv; g++ {
		for t := 0; t < n; t++ {
			at := (g*n + t) * dim
			if !slices.Equal(k[at:at+dim], ls.k[g][t*dim:(t+1)*dim]) || !slices.Equal(v[at:at+dim], ls.v[g][t*dim:(t+1)*dim]) {
				return fmt.Errorf("head %d token %d: the stored keys or values differ from those given", g, t)
			}
		}
	}
	return nil
}
