package main

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/sparse"
)

// TestParseLayouts reads every policy's syntax and the layer sets, and
// checks the policies each layer gets.
func TestParseLayouts(t *testing.T) {
	specs, err := parseLayouts(defaultLayouts, 6)
	require.NoError(t, err)
	require.Len(t, specs, 26)
	require.Equal(t, []int{2, 4}, specs[15].Delta.Refresh)
	require.Equal(t, 2, specs[15].Delta.Warmup)
	require.Equal(t, 4, specs[15].sparseLayers())
	require.True(t, specs[14].policies(nil, 4)[1].IsDense())
	require.False(t, specs[14].policies(nil, 4)[5].IsDense())
	require.Equal(t, "tactic", specs[0].Policy)
	require.Equal(t, 0.9, specs[0].P)
	require.False(t, specs[0].Curve)
	require.Equal(t, "Tactic P = 0.9", specs[0].policies(nil, 4)[0].String(), "the default fit")
	require.Equal(t, []bool{true, true, true, true, true, true}, specs[0].Layers)
	require.Equal(t, []bool{false, false, true, true, true, true}, specs[1].Layers)
	require.Equal(t, "tactic", specs[2].Policy)
	require.True(t, specs[2].Curve)
	require.Equal(t, "Tactic P = 0.9 (fitted curve)", specs[2].policies(nil, 4)[0].String())
	require.Equal(t, 0.95, specs[4].Targets.P1)
	require.Equal(t, 0.7, specs[4].Targets.P2)
	require.Equal(t, "tactic", specs[8].BudgetFrom)
	require.Equal(t, 4, specs[1].sparseLayers())

	specs, err = parseLayouts("h2o:300@0,5; quest:tactic@1-2; dense", 6)
	require.NoError(t, err)
	pols := specs[0].policies(nil, 4)
	require.Equal(t, 300, pols[0].Budget())
	require.True(t, pols[1].IsDense())
	require.Equal(t, 300, pols[5].Budget())
	pols = specs[1].policies([]int{0, 700, 5, 0, 0, 0}, 4)
	require.Equal(t, 700, pols[1].Budget())
	require.Equal(t, 16, pols[2].Budget(), "a matched budget is at least 16")
	require.True(t, pols[0].IsDense())
	require.Zero(t, specs[2].sparseLayers())

	specs, err = parseLayouts("luka:eps0.02/mean@1-4; luka:mixed/random/h2o=500; luka:tactic/top9; delta:tactic/8; luka:logsize", 6)
	require.NoError(t, err)
	require.Equal(t, sparse.RefineThreshold, specs[0].LuKA.Rule)
	require.Equal(t, 0.02, specs[0].LuKA.Epsilon)
	require.Equal(t, sparse.LuKAMean, specs[0].LuKA.Compressor)
	require.Equal(t, 4, specs[0].sparseLayers())
	pols = specs[1].policies(nil, 4)
	require.Equal(t, 500, pols[0].Budget(), "the mixed mode's H2O layers")
	require.Equal(t, 500, pols[5].Budget())
	require.Contains(t, pols[2].String(), "random")
	require.Equal(t, "all", specs[2].matchSpec())
	specs[2].Tokens = 1000
	// 1 000 tokens in segments of 16 after 128 recent: 54 summaries, a
	// cover of 54 + 136 rows; 190 + 4·16·K rows match 700 at K = 8.
	pols = specs[2].policies([]int{700 - 68, 0, 0, 0, 0, 0}, 4)
	require.Contains(t, pols[0].String(), "top-8")
	require.Contains(t, pols[1].String(), "top-1", "at least one summary refined")
	require.Equal(t, "tactic", specs[3].BudgetFrom)
	pols = specs[3].policies([]int{100, 200, 300, 400, 500, 600}, 4)
	// Tactic's mean of 350 + 68 rows a layer is 26 pages of 16.
	require.Equal(t, "DELTA Δ-layer (K 26, L 8)", pols[2].String())
	require.Equal(t, "DELTA (the pick of layer 2)", pols[3].String())
	require.True(t, pols[1].IsDense())
	require.True(t, specs[4].LuKA.LogSize)
	require.False(t, specs[0].LuKA.LogSize)
}

// TestParseLayoutsRejectsBadInput checks the errors.
func TestParseLayoutsRejectsBadInput(t *testing.T) {
	for _, bad := range []string{
		"", ";", "tactic", "tactic:nan", "tactic:1.5", "tactic:0", "tactic:0.9/", "tactic:0.9/fit", "tactic:/curve", "doublep:0.9", "doublep:0.9/x",
		"quest:0", "quest:-5", "quest:many", "h2o", "magic:1", "dense:1", "tactic:0.9@6", "tactic:0.9@3-1",
		"tactic:0.9@a", "tactic:0.9@-1", "tactic:0.9@1,9",
		"delta:8/8", "delta:8", "delta:x/2", "delta:64/8@0-5,9",
		"luka:top0", "luka:eps2", "luka:rho-1", "luka:magic", "luka:mixed/h2o=0", "luka:topx",
	} {
		_, err := parseLayouts(bad, 6)
		require.Error(t, err, bad)
	}
}
