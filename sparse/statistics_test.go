package sparse

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/vk/vktest"
)

// TestStepKernelStatistics lists the step kernels' compiler statistics
// where the driver reports them (every kernel named once, each with some
// statistics), and ErrUnsupported elsewhere.
func TestStepKernelStatistics(t *testing.T) {
	opts := vk.OptionsFromEnv()
	opts.Statistics = true
	dev := vktest.OpenWith(t, opts)
	dense, err := NewDense(dev, Heads{Query: 8, KV: 2, Dim: 64})
	require.NoError(t, err)
	defer dense.Release()
	stats, err := StepKernelStatistics(dense)
	if !dev.Info().ExecutableStatistics {
		require.ErrorIs(t, err, vk.ErrUnsupported)
		t.Logf("%s reports no compiler statistics", dev.Info().Name)
		return
	}
	require.NoError(t, err)
	seen := map[string]bool{}
	for _, k := range stats {
		require.False(t, seen[k.Kernel], "kernel %q listed twice", k.Kernel)
		seen[k.Kernel] = true
		require.NotEmpty(t, k.Statistics, k.Kernel)
	}
	for _, name := range []string{"attend_partial (dense)", "centroid_score (Tactic)", "tactic_select (moment estimate)", "tactic_select (fitted curve)", "doublep_cut", "select_bins (Quest)"} {
		require.True(t, seen[name], "kernel %q missing from %v", name, stats)
	}
}
