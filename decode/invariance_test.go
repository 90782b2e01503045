package decode

import (
	"fmt"
	"math"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/vk/vktest"
)

// placed is a model whose slots hold given sequences of a fixture:
// seqs[slot] is the fixture's sequence in that slot, -1 for none.
type placed struct {
	m    *Model
	f    *fixture
	seqs []int
}

func (p *placed) data(slot, layer int) *layerData { return p.f.data[p.seqs[slot]][layer] }

func (p *placed) prefill(t *testing.T, n []int) {
	for s, seq := range p.seqs {
		if seq < 0 {
			continue
		}
		for l := 0; l < p.m.cfg.Layers; l++ {
			k, v := p.data(s, l).rows(0, n[seq])
			require.NoError(t, p.m.Prefill(s, l, k, v, n[seq]))
		}
	}
}

func (p *placed) appendAll(t *testing.T) {
	for s, seq := range p.seqs {
		if seq < 0 {
			continue
		}
		var k, v []uint16
		for l := 0; l < p.m.cfg.Layers; l++ {
			n := p.m.Len(s, l)
			kt, vt := p.data(s, l).rows(n, n+1)
			k, v = append(k, kt...), append(v, vt...)
		}
		require.NoError(t, p.m.AppendAll(s, k, v))
	}
}

// attend attends every layer with query i of each active slot's sequence
// and returns each sequence's outputs, [seq][layer][Hq·D] as float32 bits.
func (p *placed) attend(t *testing.T, i int) map[int][][]uint32 {
	h := p.m.cfg.Heads
	per := h.Query * h.Dim
	outs := map[int][][]uint32{}
	for l := 0; l < p.m.cfg.Layers; l++ {
		var q []float32
		for _, s := range p.m.Active() {
			q = append(q, p.data(s, l).tr.Query(i)...)
		}
		out, err := p.m.Attend(l, q)
		require.NoError(t, err)
		for j, s := range p.m.Active() {
			bits := make([]uint32, per)
			for e := range bits {
				bits[e] = math.Float32bits(out[j*per+e])
			}
			outs[p.seqs[s]] = append(outs[p.seqs[s]], bits)
		}
	}
	return outs
}

// placedRuns returns three models of cfg (released when the test ends)
// prefilled with the fixture's sequences 0, 1, 2 of the invariance tests'
// lengths: sequence 2 alone in slot 0, then the batch of three twice.
func placedRuns(t *testing.T, dev *vk.Device, f *fixture, cfg Config) []*placed {
	t.Helper()
	n := []int{faultSecond, faultFirst + 3, faultFirst}
	var runs []*placed
	for _, seqs := range [][]int{{2, -1, -1}, {0, 1, 2}, {0, 1, 2}} {
		m, err := New(dev, cfg)
		require.NoError(t, err)
		t.Cleanup(func() { require.NoError(t, m.Release()) })
		r := &placed{m: m, f: f, seqs: seqs}
		r.prefill(t, n)
		runs = append(runs, r)
	}
	return runs
}

// TestBatchInvariance runs, for every policy decode offers, one sequence
// alone in slot 0 of a model, and the same sequence in slot 2 of another
// model beside two sequences of other lengths (slots 0 and 1), through a
// prefill and appends that cross a reclustering boundary, attending every
// layer after each; and the batch of three again in a third model. The
// sequence's outputs must be bit-identical alone and in the batch, and the
// two batched runs bit-identical to each other (run to run).
func TestBatchInvariance(t *testing.T) {
	dev := vktest.Open(t)
	for _, p := range faultPolicies(t) {
		t.Run(p.name, func(t *testing.T) {
			layers := len(p.layout)
			f := newFixture(t, faultHeads, layers, []int{faultCapacity, faultCapacity, faultCapacity})
			runs := placedRuns(t, dev, f, Config{Fallback: FallbackNever, Heads: faultHeads, Layers: layers, Slots: 3, Capacity: faultCapacity, Layout: p.layout})
			for step := range faultRecluster + 2 { // crosses a reclustering boundary
				if step > 0 {
					for _, r := range runs {
						r.appendAll(t)
					}
				}
				var outs []map[int][][]uint32
				for _, r := range runs {
					outs = append(outs, r.attend(t, step%2))
				}
				for l := 0; l < layers; l++ {
					what := fmt.Sprintf("step %d layer %d (%s)", step, l, p.layout[l])
					require.True(t, slices.Equal(outs[0][2][l], outs[1][2][l]), "%s: sequence 2 alone in slot 0 and batched in slot 2 differ", what)
					for seq := range 3 {
						require.True(t, slices.Equal(outs[1][seq][l], outs[2][seq][l]), "%s: sequence %d differs between two runs of the same batch", what, seq)
					}
				}
			}
		})
	}
}
