package decode

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/vk/vktest"
)

// layoutUnderTest gives each layer another policy: every policy but Tactic
// (TestModelTacticMatchesReference covers it), dense first.
func layoutUnderTest(recluster int) []Policy {
	opts := sparse.TacticDecoderOptions{Sinks: 4, Recluster: recluster, KMeans: sparse.KMeansOptions{Seed: 5}}
	return []Policy{
		Dense(),
		DoubleP(sparse.DefaultDoubleP(), opts),
		Quest(256).WithRecluster(recluster),
		StreamingLLM(200).WithRecluster(recluster),
		H2O(192).WithRecluster(recluster),
		TokenOracle(0.9).WithRecluster(recluster),
		ClusterOracle(0.9, opts),
	}
}

// attendAlone runs the step of slot s's layer under the layer's policy
// alone (a fresh sparse step over the same cache and index) and returns
// its output for the slot's queries qi.
func attendAlone(t *testing.T, m *Model, s, layer int, qi []float32) []float32 {
	t.Helper()
	sl := &m.slots[s].seq[layer]
	st, err := m.policy[layer].newStep(m.dense, sl.cache, sl.clusters)
	require.NoError(t, err)
	defer func() { require.NoError(t, st.Release()) }()
	out, err := st.Attend(qi)
	require.NoError(t, err)
	return out
}

// TestModelLayoutMatchesSteps builds a model whose layers each have
// another policy, prefills two slots, and checks every layer's batched
// output against each slot's step of that policy run alone over the same
// cache (whose kernels have their own reference tests), then appends past
// the recluster interval (Double-P's and the cluster oracle's index must
// grow, Quest's, StreamingLLM's and the token oracle's batch must index
// the layer again) and checks again; H2O, whose batch accumulates
// attention a fresh step has not seen, is compared on the first step only.
func TestModelLayoutMatchesSteps(t *testing.T) {
	dev := vktest.Open(t)
	const recluster = 96
	layout := layoutUnderTest(recluster)
	layers := len(layout)
	prefill := []int{1300, 900}
	f := newFixture(t, testHeads, layers, []int{1500, 1100})
	m, err := New(dev, Config{Fallback: FallbackNever, Heads: testHeads, Layers: layers, Slots: 3, Capacity: 1600, Layout: layout})
	require.NoError(t, err)
	defer func() { require.NoError(t, m.Release()) }()
	for s, n := range prefill {
		f.prefill(t, m, s, n)
	}
	require.Equal(t, []int{0, 1}, m.Active())
	per := testHeads.Query * testHeads.Dim

	check := func(round int, what string) {
		for l, pol := range layout {
			q := f.queries(m, l, round)
			out, err := m.Attend(l, q)
			require.NoError(t, err)
			for i, s := range m.Active() {
				name := fmt.Sprintf("%s, layer %d (%s), slot %d", what, l, pol, s)
				qi := q[i*per : (i+1)*per]
				if pol.IsDense() {
					requireClose(t, subsetRef(t, testHeads, f.data[s][l], qi, m.Len(s, l), nil), out[i*per:(i+1)*per], testHeads.Dim, 1e-3, name)
					continue
				}
				if pol.kind == kindH2O && round > 0 {
					continue
				}
				alone := attendAlone(t, m, s, l, qi)
				want := make([]float64, len(alone))
				for j, x := range alone {
					want[j] = float64(x)
				}
				requireClose(t, want, out[i*per:(i+1)*per], testHeads.Dim, 1e-4, name)
			}
		}
	}
	check(0, "after the prefill")
	kernels := len(m.dense.Kernels())
	require.NotZero(t, kernels, "the selection kernels are the model's")
	for l, pol := range layout {
		att, err := m.Attended(l)
		require.NoError(t, err)
		require.Len(t, att, 2)
		for i, s := range m.Active() {
			n := float64(m.Len(s, l))
			if pol.IsDense() {
				require.Equal(t, n, att[i], "layer %d: dense attends every token", l)
			} else {
				require.Less(t, att[i], n, "layer %d (%s): attends fewer than the %v stored", l, pol, n)
				require.Greater(t, att[i], float64(sparse.BaselineWindow), "layer %d (%s): attends at least its window", l, pol)
			}
		}
	}
	// Slot 2 half prefilled: neither active nor idle, and Slot says so.
	k, v := f.data[0][0].rows(0, 500)
	require.NoError(t, m.Prefill(2, 0, k, v, 500))
	st, err := m.Slot(2)
	require.NoError(t, err)
	require.Equal(t, 1, st.Prefilled)
	require.False(t, st.Active)
	require.Equal(t, 500, st.Tokens[0])
	require.Zero(t, st.Tokens[1])
	_, err = m.Slot(3)
	require.Error(t, err)
	require.NoError(t, m.Free(2))

	counts := make([]int, layers)
	builtAt := make([]int, layers)
	for l := range layout {
		if x := m.slots[0].seq[l].clusters; x != nil {
			counts[l] = x.Count
		}
		if b := m.layers[l].built; b != nil {
			builtAt[l] = b[0]
		}
	}
	f.appendAll(t, m, 0, recluster+3)
	f.appendEach(t, m, 1, 5)
	check(1, "after the appends")
	require.Equal(t, kernels, len(m.dense.Kernels()), "batches built again compile no kernel again")
	for l, pol := range layout {
		switch {
		case pol.Clustered():
			require.Greater(t, m.slots[0].seq[l].clusters.Count, counts[l], "layer %d (%s): the index grows", l, pol)
		case pol.rebuildsIndex():
			require.Greater(t, m.layers[l].built[0], builtAt[l], "layer %d (%s): the batch indexes the grown layer", l, pol)
		case pol.kind == kindH2O:
			require.Equal(t, builtAt[l], m.layers[l].built[0], "layer %d (%s): the batch keeps its state", l, pol)
		}
	}
	for l, pol := range layout {
		d, err := m.Time(l, 1, 3)
		require.NoError(t, err, "layer %d (%s)", l, pol)
		require.Len(t, d, 3)
		require.Positive(t, d[0], "layer %d (%s): timed", l, pol)
	}
}

// TestLayoutRejectsBadPolicies checks that a layout of the wrong length
// and policies with bad options are refused before anything is made.
func TestLayoutRejectsBadPolicies(t *testing.T) {
	cfg := Config{Heads: testHeads, Layers: 2, Slots: 1, Capacity: 100}
	bad := map[string][]Policy{
		"short layout":       {Dense()},
		"Quest budget 0":     {Dense(), Quest(0)},
		"H2O past capacity":  {Dense(), H2O(1 << 30)},
		"H2O budget -1":      {H2O(-1), Dense()},
		"StreamingLLM 0":     {StreamingLLM(0), Dense()},
		"Double-P P1 0":      {DoubleP(sparse.DoubleP{P1: 0, P2: 0.7}, sparse.TacticDecoderOptions{}), Dense()},
		"Double-P P2 NaN":    {DoubleP(sparse.DoubleP{P1: 0.9, P2: nan()}, sparse.TacticDecoderOptions{}), Dense()},
		"token oracle P 1.5": {Dense(), TokenOracle(1.5)},
		"sinks past capacity": {Dense(), ClusterOracle(0.9,
			sparse.TacticDecoderOptions{Sinks: 100})},
		"unknown kind": {Dense(), {kind: 99}},
	}
	for name, layout := range bad {
		cfg.Layout = layout
		_, err := cfg.validate()
		require.Error(t, err, name)
	}
	cfg.Layout = []Policy{Dense(), Quest(64)}
	_, err := cfg.validate()
	require.NoError(t, err)
}

func nan() float64 { var zero float64; return zero / zero }
