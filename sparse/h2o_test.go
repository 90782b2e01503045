package sparse

import (
	"fmt"
	"math"
	"sort"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/vk/vktest"
)

// TestH2OStepMatchesReference runs consecutive H2O steps on the GPU over a
// generated layer, a different query each step, at a few budgets (with a
// dense prompt-phase Observe first or not, and again between steps) and
// selection shapes, and
// checks after every step,
// the scratch buffers and the output poisoned (NaN) before it:
//   - every head's accumulated attention against float64, accumulated over
//     the tokens the GPU's earlier steps attended (and the observation);
//   - each head's selection, exactly, against H2O.Select from the GPU's
//     float32 state (the float64 reference's rule: recent part, heavy part
//     by accumulated attention, ties to the lower id);
//   - the output against SelectionGroupRef over the GPU's selection.
//
// It runs the float64 reference H2O beside it on its own float64 state and
// logs how many tokens their unions differ by. In the shared cases the step
// keeps its partials and scratch in a workspace region that another H2O
// step (of another budget) shares and runs in before each of its steps.
func TestH2OStepMatchesReference(t *testing.T) {
	dev := vktest.Open(t)
	h := Heads{Query: 8, KV: 2, Dim: 64}
	const n, queries = 700, 6
	tr := generated(t, h, n, queries)
	layer, err := kvcache.NewLayer(dev, h.KV, h.Dim, n)
	require.NoError(t, err)
	defer layer.Release()
	require.NoError(t, layer.Prefill(tr.K, tr.V, n))
	dense, err := NewDense(dev, h)
	require.NoError(t, err)
	defer dense.Release()
	keys, values := HalvesToFloat64(tr.K), HalvesToFloat64(tr.V)
	kv := func(g int) ([]float64, []float64) {
		w := n * h.Dim
		return keys[g*w : (g+1)*w], values[g*w : (g+1)*w]
	}
	scale := 1 / math.Sqrt(float64(h.Dim))
	layout := DefaultBaselineLayout()
	lo, hi := layout.Middle(n)
	fixed := layout.Fixed(n)
	m := hi - lo

	// The default selection gathers the first radix level's bin in shared
	// memory within one workgroup a head here; small workgroups with room
	// for 8 candidates take the passes over all of them, several
	// workgroups a head and several bins a thread.
	small := h2oSelectShape{threads: 64, list: 8}
	for _, c := range []struct {
		budget, steps int
		observe       bool
		shape         h2oSelectShape
		shared        bool
		observeAfter  int // the step before which Observe runs again; 0 for none
	}{{120, 5, false, h2oSelectShape{}, false, 2}, {121, 4, true, h2oSelectShape{}, false, 0}, {1, 2, false, h2oSelectShape{}, false, 0}, {m, 2, true, h2oSelectShape{}, false, 1},
		{121, 3, true, small, false, 0}, {120, 4, false, small, false, 0}, {121, 4, true, h2oSelectShape{}, true, 3}} {
		what := fmt.Sprintf("budget %d observe %v shape %+v shared %v observe after %d", c.budget, c.observe, c.shape, c.shared, c.observeAfter)
		step, err := newH2OStep(dense, layer, c.budget, c.shape)
		require.NoError(t, err)
		sel := step.Selector().(*H2OSelector)
		var rival *Step
		ws := NewWorkspace(dev)
		if c.shared {
			rival, err = newH2OStep(dense, layer, 60, small)
			require.NoError(t, err)
			for _, st := range []*Step{rival, step} {
				require.NoError(t, st.plan.Share(ws, 0))
				require.NoError(t, ws.shareScratch(st.Selector().(*H2OSelector), 0))
			}
			require.Nil(t, sel.ownScratch, "the scratch moved into the workspace")
		}
		require.Equal(t, m, sel.Tokens().C)
		index := hostIndex(t, sel.Tokens())
		acc64 := make([][]float64, h.Query)
		for hh := range acc64 {
			acc64[hh] = make([]float64, m)
		}
		exact := make([]*H2O, h.KV)
		for g := range exact {
			exact[g], err = NewH2O(h.Group(), layout)
			require.NoError(t, err)
		}
		checkAcc := func(at string) []float32 {
			got, err := sel.Accumulated()
			require.NoError(t, err)
			for hh := range acc64 {
				for i, want := range acc64[hh] {
					x := float64(got[hh*m+i])
					require.InDelta(t, want, x, 1e-5*(1+want), "%s %s: head %d token %d accumulated", what, at, hh, lo+i)
				}
			}
			return got
		}
		observe := func(q []float32, at string) {
			require.NoError(t, sel.Observe(q))
			for g := range exact {
				ks, _ := kv(g)
				qs := h.GroupQueries(q, g)
				require.NoError(t, exact[g].Observe(qs, ks, scale))
				for j, qh := range qs {
					p, err := SoftmaxRef(qh, ks, scale)
					require.NoError(t, err)
					for i := range acc64[g*h.Group()+j] {
						acc64[g*h.Group()+j][i] += p[lo+i]
					}
				}
			}
			checkAcc(at)
		}
		if c.observe {
			observe(tr.Query(queries-1), "after Observe")
		}
		for s := 0; s < c.steps; s++ {
			if s > 0 && s == c.observeAfter {
				// A prompt phase between steps: the last step's recorded
				// attention must be accumulated as well as the prompt's.
				observe(tr.Query(queries-2), fmt.Sprintf("after Observe at step %d", s))
			}
			at := fmt.Sprintf("step %d", s)
			q := tr.Query(s)
			if rival != nil {
				_, err := rival.Attend(tr.Query(queries - 1 - s))
				require.NoError(t, err)
			}
			nan := math.Float32bits(float32(math.NaN()))
			l := sel.layout()
			require.NoError(t, dev.Run(func(cmd *vk.Commands) {
				// The prompt phase's partials; the counters stay 0.
				cmd.Fill(vk.Range{Buffer: sel.scratch.Buffer, Offset: sel.scratch.Offset + l.part, Size: l.arrivedScore - l.part}, nan)
				cmd.Fill(step.Output().All(), nan)
			}))
			got, err := step.Attend(q)
			require.NoError(t, err)
			acc := checkAcc(at)
			ranks, err := sel.Ranks()
			require.NoError(t, err)
			cuts, err := sel.Cuts()
			require.NoError(t, err)
			var want []float64
			for g := 0; g < h.KV; g++ {
				ks, vs := kv(g)
				qs := h.GroupQueries(q, g)
				state, err := NewH2O(h.Group(), layout)
				require.NoError(t, err)
				var rs [][]int
				var cs []int
				for j := range qs {
					hh := g*h.Group() + j
					state.acc[j] = make([]float64, n)
					for i := 0; i < m; i++ {
						state.acc[j][lo+i] = float64(acc[hh*m+i])
					}
					ref, err := state.Select(j, n, c.budget)
					require.NoError(t, err)
					own := append([]int32(nil), fixed...)
					for i := 0; i < m; i++ {
						if ranks[hh*m+i] < cuts[hh] {
							own = append(own, int32(lo+i))
						}
					}
					sort.Slice(own, func(a, b int) bool { return own[a] < own[b] })
					require.Equal(t, ref, own, "%s %s: head %d selection", what, at, hh)
					rs, cs = append(rs, ranks[hh*m:(hh+1)*m]), append(cs, cuts[hh])
				}
				outs, tokens, err := SelectionGroupRef(qs, ks, vs, scale, index[g], fixed, rs, cs)
				require.NoError(t, err)
				for _, o := range outs {
					want = append(want, o...)
				}
				_, ref, _, err := exact[g].Step(qs, ks, vs, scale, c.budget)
				require.NoError(t, err)
				t.Logf("%s %s KV head %d: %d tokens attended, the float64 reference's union differs by %d", what, at, g, len(tokens), symmetricDifference(tokens, ref))
				// This step's weights, which the next step adds.
				for j, qh := range qs {
					ls := make([]float64, len(tokens))
					top := math.Inf(-1)
					for i, tok := range tokens {
						ls[i] = scale * dot(qh, ks[int(tok)*h.Dim:int(tok+1)*h.Dim])
						top = max(top, ls[i])
					}
					z := 0.0
					for i := range ls {
						ls[i] = math.Exp(ls[i] - top)
						z += ls[i]
					}
					for i, tok := range tokens {
						if int(tok) >= lo && int(tok) < hi {
							acc64[g*h.Group()+j][int(tok)-lo] += ls[i] / z
						}
					}
				}
			}
			requireClose(t, want, got, h.Dim, 1e-3, what+" "+at)
		}
		require.NoError(t, step.Release())
		if rival != nil {
			require.NoError(t, rival.Release())
		}
		require.NoError(t, ws.Release(), "every step left the workspace")
	}
}

// symmetricDifference returns how many tokens lie in one of the ascending
// lists a and b only.
func symmetricDifference(a, b []int32) int {
	in := map[int32]int{}
	for _, x := range a {
		in[x]++
	}
	for _, x := range b {
		in[x]--
	}
	d := 0
	for _, v := range in {
		if v != 0 {
			d++
		}
	}
	return d
}
