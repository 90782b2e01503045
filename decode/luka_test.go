package decode

import (
	"fmt"
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/vk/vktest"
)

// TestModelLuKAMatchesReference runs LuKA's mixed layout over 4 layers
// (H2O at both ends, LuKA's clustered attention between) for two slots of
// different lengths, over four steps with an append between each (the
// segmenter runs every third), and checks every clustered layer's output
// against LuKAAttendRef over the layer's summaries and refined summaries,
// its summaries' count, the rows it reports attended, that Memory counts
// every buffer, and that freeing a slot and prefilling it again works.
func TestModelLuKAMatchesReference(t *testing.T) {
	dev := vktest.Open(t)
	h := testHeads
	opts := sparse.LuKA{Segment: 16, Recent: 64, Every: 3, Rule: sparse.RefineTopK, K: 2}
	layout, err := LuKALayout(4, LuKAMixed, opts, H2O(128))
	require.NoError(t, err)
	require.Equal(t, kindH2O, layout[0].kind)
	require.Equal(t, kindLuKA, layout[1].kind)
	require.Equal(t, kindLuKA, layout[2].kind)
	require.Equal(t, kindH2O, layout[3].kind)
	prefill := []int{700, 500}
	f := newFixture(t, h, 4, []int{710, 710})
	before := dev.Allocated()
	m, err := New(dev, Config{Heads: h, Layers: 4, Slots: 2, Capacity: 800, Layout: layout})
	require.NoError(t, err)
	defer func() { require.NoError(t, m.Release()) }()
	for s, n := range prefill {
		f.prefill(t, m, s, n)
	}
	per, scale := h.Query*h.Dim, 1/math.Sqrt(float64(h.Dim))
	resolved, err := opts.Resolve()
	require.NoError(t, err)
	for round := 0; round < 4; round++ {
		if round > 0 {
			for s := range prefill {
				f.appendAll(t, m, s, 1)
			}
		}
		for l := 0; l < 4; l++ {
			q := f.queries(m, l, round%2)
			out, err := m.Attend(l, q)
			require.NoError(t, err, "layer %d", l)
			if m.policy[l].kind != kindLuKA {
				continue
			}
			att, err := m.Attended(l)
			require.NoError(t, err)
			for i, s := range m.Active() {
				name := fmt.Sprintf("step %d, layer %d, slot %d", round, l, s)
				st := m.slots[s].seq[l].luka
				n, sums := m.Len(s, l), st.Summaries()
				// The segmenter runs every Every appends, so the summaries may
				// lag the tokens by that many.
				require.LessOrEqual(t, sums, resolved.Summaries(n), name)
				require.GreaterOrEqual(t, sums, resolved.Summaries(n-round%resolved.Every), name)
				sk, sv, err := st.SummaryRows()
				require.NoError(t, err)
				refined, err := st.Refined()
				require.NoError(t, err)
				d := f.data[s][l]
				var want []float64
				for hh := 0; hh < h.Query; hh++ {
					g := hh / h.Group()
					q64 := make([]float64, h.Dim)
					for j := range q64 {
						q64[j] = float64(q[i*per+hh*h.Dim+j])
					}
					o, _, _, err := sparse.LuKAAttendRef(q64, d.keys[g*d.n*h.Dim:(g*d.n+n)*h.Dim], d.values[g*d.n*h.Dim:(g*d.n+n)*h.Dim],
						sparse.HalvesToFloat64(sk[g*sums*h.Dim:(g+1)*sums*h.Dim]), sparse.HalvesToFloat64(sv[g*sums*h.Dim:(g+1)*sums*h.Dim]),
						h.Dim, resolved.Segment, scale, resolved.SummaryBias(), refined[hh])
					require.NoError(t, err)
					require.Len(t, refined[hh], min(2, sums), "%s: head %d refines the top 2", name, hh)
					want = append(want, o...)
				}
				requireClose(t, want, out[i*per:(i+1)*per], h.Dim, 1e-3, name)
				require.Equal(t, float64(sums+n-sums*resolved.Segment+2*resolved.Segment*h.Group()), att[i], "%s: rows attended", name)
			}
		}
	}
	mem, err := m.Memory()
	require.NoError(t, err)
	require.Equal(t, dev.Allocated()-before, mem.Caches+mem.Other, "Memory counts every buffer, LuKA's summaries too")
	d, err := m.Time(1, 1, 3)
	require.NoError(t, err)
	require.Len(t, d, 3)

	require.NoError(t, m.Free(1))
	require.Nil(t, m.slots[1].seq[1].luka, "freeing a slot releases its summaries")
	f.prefill(t, m, 1, 300)
	_, err = m.Attend(1, f.queries(m, 1, 0))
	require.NoError(t, err)
	require.Equal(t, resolved.Summaries(300), m.slots[1].seq[1].luka.Summaries())
}

// TestLuKALayoutRejectsBadOptions checks LuKA's layouts and options.
func TestLuKALayoutRejectsBadOptions(t *testing.T) {
	_, err := LuKALayout(6, LuKAMixed, sparse.LuKA{}, Dense())
	require.ErrorContains(t, err, "H2O")
	_, err = LuKALayout(6, LuKAClusteredOnly, sparse.LuKA{Segment: 100}, Dense())
	require.Error(t, err)
	_, err = LuKALayout(0, LuKAClusteredOnly, sparse.LuKA{}, Dense())
	require.Error(t, err)
	lined, err := LuKALayout(3, LuKALinedOnly, sparse.LuKA{}, H2O(64))
	require.NoError(t, err)
	for _, p := range lined {
		require.Equal(t, kindH2O, p.kind)
	}
	mixed, err := LuKALayout(36, LuKAMixed, sparse.LuKA{}, H2O(64))
	require.NoError(t, err)
	lines := 0
	for _, p := range mixed {
		if p.kind == kindH2O {
			lines++
		}
	}
	require.Equal(t, 16, lines, "the paper's 8 first and 8 last of 36")
	_, err = Config{Heads: testHeads, Layers: 1, Slots: 1, Capacity: 100, Policy: LuKA(sparse.LuKA{Tau: -1})}.validate()
	require.Error(t, err)
}
