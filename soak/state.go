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
// order, and n, the prefill length (the tail appended after it).
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

// segments returns the ranges of a layer of n tokens prefilled with
// prefill whose rows a clustered policy stores in some order of their own
// (sinks sinks, a tail clustered every recluster appended tokens): each
// stored row lies in its token's range.
func segments(n, prefill, sinks, recluster int) [][2]int {
	out := [][2]int{{sinks, prefill}}
	for a := prefill; a+recluster <= n; a += recluster {
		out = append(out, [2]int{a, a + recluster})
	}
	return out
}

// checkCache compares what the device stores for a layer (k, v
// [KV][n][Dim] in storage order, pos the token of each row) with ls:
// every token once per head, bit for bit, each in its own range of segs
// (or its own row outside them).
func (ls *layerState) checkCache(k, v []uint16, pos []int32, kv, dim int, segs [][2]int) error {
	n := len(ls.k[0]) / dim
	if len(k) != kv*n*dim || len(v) != len(k) || len(pos) != kv*n {
		return fmt.Errorf("the cache holds %d rows of keys, %d of values and %d positions, want %d tokens × %d heads", len(k)/max(dim, 1), len(v)/max(dim, 1), len(pos), n, kv)
	}
	seg := make([]int, n) // segment of each token; -1: its own row
	for t := range seg {
		seg[t] = -1
	}
	for i, r := range segs {
		for t := r[0]; t < r[1] && t < n; t++ {
			seg[t] = i
		}
	}
	seen := make([]bool, n)
	for g := 0; g < kv; g++ {
		clear(seen)
		for row := 0; row < n; row++ {
			p := int(pos[g*n+row])
			switch {
			case p < 0 || p >= n:
				return fmt.Errorf("head %d row %d holds token %d of %d", g, row, p, n)
			case seen[p]:
				return fmt.Errorf("head %d holds token %d twice (row %d)", g, p, row)
			case seg[p] != seg[row] || (seg[p] < 0 && p != row):
				return fmt.Errorf("head %d row %d holds token %d, outside the row's range", g, row, p)
			}
			seen[p] = true
			got := k[(g*n+row)*dim : (g*n+row+1)*dim]
			gotV := v[(g*n+row)*dim : (g*n+row+1)*dim]
			if !slices.Equal(got, ls.k[g][p*dim:(p+1)*dim]) || !slices.Equal(gotV, ls.v[g][p*dim:(p+1)*dim]) {
				return fmt.Errorf("head %d row %d (token %d): the stored keys or values differ from those given", g, row, p)
			}
		}
	}
	return nil
}
