package main

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// TestParseLayouts reads every policy's syntax and the layer sets, and
// checks the policies each layer gets.
func TestParseLayouts(t *testing.T) {
	specs, err := parseLayouts(defaultLayouts, 6)
	require.NoError(t, err)
	require.Len(t, specs, 15)
	require.Equal(t, []int{2, 4}, specs[13].Delta.Refresh)
	require.Equal(t, 2, specs[13].Delta.Warmup)
	require.Equal(t, 4, specs[13].sparseLayers())
	require.True(t, specs[12].policies(nil)[1].IsDense())
	require.False(t, specs[12].policies(nil)[5].IsDense())
	require.Equal(t, "tactic", specs[0].Policy)
	require.Equal(t, 0.9, specs[0].P)
	require.Equal(t, []bool{true, true, true, true, true, true}, specs[0].Layers)
	require.Equal(t, []bool{false, false, true, true, true, true}, specs[1].Layers)
	require.Equal(t, 0.95, specs[2].Targets.P1)
	require.Equal(t, 0.7, specs[2].Targets.P2)
	require.Equal(t, "tactic", specs[6].BudgetFrom)
	require.Equal(t, 4, specs[1].sparseLayers())

	specs, err = parseLayouts("h2o:300@0,5; quest:tactic@1-2; dense", 6)
	require.NoError(t, err)
	pols := specs[0].policies(nil)
	require.Equal(t, 300, pols[0].Budget())
	require.True(t, pols[1].IsDense())
	require.Equal(t, 300, pols[5].Budget())
	pols = specs[1].policies([]int{0, 700, 5, 0, 0, 0})
	require.Equal(t, 700, pols[1].Budget())
	require.Equal(t, 16, pols[2].Budget(), "a matched budget is at least 16")
	require.True(t, pols[0].IsDense())
	require.Zero(t, specs[2].sparseLayers())
}

// TestParseLayoutsRejectsBadInput checks the errors.
func TestParseLayoutsRejectsBadInput(t *testing.T) {
	for _, bad := range []string{
		"", ";", "tactic", "tactic:nan", "tactic:1.5", "tactic:0", "doublep:0.9", "doublep:0.9/x",
		"quest:0", "quest:-5", "quest:many", "h2o", "magic:1", "dense:1", "tactic:0.9@6", "tactic:0.9@3-1",
		"tactic:0.9@a", "tactic:0.9@-1", "tactic:0.9@1,9",
		"delta:8/8", "delta:8", "delta:x/2", "delta:64/8@0-5,9",
	} {
		_, err := parseLayouts(bad, 6)
		require.Error(t, err, bad)
	}
}
