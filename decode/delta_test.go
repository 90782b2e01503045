package decode

import (
	"fmt"
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/vk/vktest"
)

// TestModelDeltaMatchesReference runs DELTA over 5 layers (layer 0 dense,
// Δ-layers 1 and 3, layers 2 and 4 reusing their picks) for two slots of
// different lengths, in two steps with an append between, and checks: the
// Δ-layers attend densely; each reusing layer's pick is the float64
// reference's (DeltaTokenScoresRef, DeltaPageScoresRef, DeltaSelectRef of
// its Δ-layer's queries and keys at the same step) and its output is
// attention over the picked pages and the tokens past them.
func TestModelDeltaMatchesReference(t *testing.T) {
	dev := vktest.Open(t)
	opts := sparse.Delta{Warmup: 1, Refresh: []int{1, 3}, Pages: 6, Recent: 2, PageSize: 16}
	layout, err := DeltaLayout(5, opts)
	require.NoError(t, err)
	prefill := []int{900, 700}
	f := newFixture(t, testHeads, 5, []int{905, 705})
	m, err := New(dev, Config{Heads: testHeads, Layers: 5, Slots: 2, Capacity: 1000, Layout: layout})
	require.NoError(t, err)
	defer func() { require.NoError(t, m.Release()) }()
	for s, n := range prefill {
		f.prefill(t, m, s, n)
	}
	h := testHeads
	per, scale := h.Query*h.Dim, 1/math.Sqrt(float64(h.Dim))
	for round := 0; round < 2; round++ {
		if round == 1 {
			for s := range prefill {
				f.appendAll(t, m, s, 1)
			}
		}
		qs := make([][]float32, 5)
		for l := 0; l < 5; l++ {
			qs[l] = f.queries(m, l, round)
			out, err := m.Attend(l, qs[l])
			require.NoError(t, err, "layer %d", l)
			for i, s := range m.Active() {
				n := m.Len(s, l)
				name := fmt.Sprintf("step %d, layer %d (%s), slot %d", round, l, m.policy[l], s)
				qi := qs[l][i*per : (i+1)*per]
				if m.policy[l].kind != kindDeltaReuse {
					requireClose(t, subsetRef(t, h, f.data[s][l], qi, n, nil), out[i*per:(i+1)*per], h.Dim, 1e-3, name)
					continue
				}
				src := m.policy[l].source
				d := f.data[s][src]
				nSrc := m.Len(s, src)
				keys := make([]float64, 0, h.KV*nSrc*h.Dim)
				for g := 0; g < h.KV; g++ {
					keys = append(keys, d.keys[g*d.n*h.Dim:(g*d.n+nSrc)*h.Dim]...)
				}
				q64 := make([]float64, per)
				for j, v := range qs[src][i*per : (i+1)*per] {
					q64[j] = float64(v)
				}
				scores, err := sparse.DeltaTokenScoresRef(h, q64, keys, nSrc, scale)
				require.NoError(t, err)
				pages := m.layers[src].delta.pages[i]
				want, err := sparse.DeltaSelectRef(sparse.DeltaPageScoresRef(scores, opts.PageSize)[:pages], opts.Pages, opts.Recent)
				require.NoError(t, err)
				got, err := m.layers[src].delta.picks[i].Picked()
				require.NoError(t, err)
				require.Equal(t, want, got, "%s: the pick of layer %d", name, src)
				tokens := sparse.DeltaTokensRef(want, opts.PageSize, pages*opts.PageSize)
				for tok := pages * opts.PageSize; tok < n; tok++ {
					tokens = append(tokens, int32(tok))
				}
				lists := [][]int32{tokens, tokens}
				requireClose(t, subsetRef(t, h, f.data[s][l], qi, n, lists), out[i*per:(i+1)*per], h.Dim, 1e-3, name)
				att, err := m.Attended(l)
				require.NoError(t, err)
				require.Equal(t, float64(len(tokens)), att[i], "%s: rows attended", name)
			}
		}
	}
	d, err := m.Time(1, 1, 3)
	require.NoError(t, err)
	require.Len(t, d, 3)
	mem, err := m.Memory()
	require.NoError(t, err)
	require.Positive(t, mem.Other)
}

// TestDeltaLayoutRejectsBadOptions checks DELTA's options and a layer
// reusing no Δ-layer.
func TestDeltaLayoutRejectsBadOptions(t *testing.T) {
	_, err := DeltaLayout(6, sparse.Delta{Pages: 8, Recent: 8})
	require.Error(t, err)
	_, err = DeltaLayout(6, sparse.Delta{Refresh: []int{2, 7}})
	require.Error(t, err)
	layout, err := DeltaLayout(4, sparse.Delta{})
	require.NoError(t, err)
	require.True(t, layout[0].IsDense())
	require.Equal(t, kindDeltaRefresh, layout[2].kind)
	require.Equal(t, 2, layout[3].source)
	bad := []Policy{Dense(), layout[3], Dense(), Dense()} // layer 1 reuses layer 2's pick
	_, err = Config{Heads: testHeads, Layers: 4, Slots: 1, Capacity: 100, Layout: bad}.validate()
	require.Error(t, err)
}
