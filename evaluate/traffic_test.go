package evaluate

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/workload"
)

// TestTacticSelectionBytesAtLlamaShape computes what a Tactic step reads at
// the llama layer's shape (32 query heads, 8 KV heads, 128 dimensions) at
// 131 072 tokens, P 0.9, K-means within spans of sparse.KMeansDefaultSpan,
// from the float64 selection of one decode query: the selection (the
// 8-bit centroids and the fit's key rows) against attention over the
// unions (their keys and values). With the default fit the 8-bit
// centroids must take the selection's share of the unions' bytes at
// least a fifth below what fp16 centroids would; with the exact part
// capped at 1 024 tokens (TacticFit.MaxInitial) the selection must read
// at most half of what attention over the unions reads. Each layer's
// clustering takes about a minute on two cores: skipped in -short mode.
func TestTacticSelectionBytesAtLlamaShape(t *testing.T) {
	if testing.Short() {
		t.Skip("clusters a 131 072-token layer twice; skipped in -short mode")
	}
	const tokens, qHeads, kvHeads, dim = 131072, 32, 8, 128
	cfg, err := workload.NamedConfig("llama", tokens, qHeads, kvHeads, dim)
	require.NoError(t, err)
	cfg.Queries, cfg.Seed = 1, 1
	tr, err := workload.Generate(cfg)
	require.NoError(t, err)
	traffic := func(fit sparse.TacticFit) StepTraffic {
		opts := DefaultTacticOptions()
		opts.P, opts.Fit = []float64{0.9}, fit
		opts.KMeansSpan = sparse.KMeansDefaultSpan
		ev, err := Tactic(tr, opts)
		require.NoError(t, err)
		r := ev.Results[0]
		s := r.Traffic
		t.Logf("%+v: selection %.2f MB (centroids %.2f, fit's rows %.2f), unions %.2f MB: %.3f; success %.1f%%, union %.2f%% of the tokens",
			fit, s.Selection()/1e6, s.Centroids/1e6, s.Sampled/1e6, s.Attended/1e6, s.SelectionShare(), 100*r.SuccessRate, 100*r.Union/r.Attended)
		// A row of codes and its scale per cluster of every KV head,
		// clusters of opts.AvgClusterSize tokens on average, and the head's
		// dimension scales.
		clusters := float64(tr.Tokens-tr.Queries()-opts.Sinks) / float64(opts.AvgClusterSize)
		assert.InEpsilon(t, kvHeads*(clusters*float64(kvcache.CodedRowBytes(dim))+4*dim), s.Centroids, 0.01, "centroid bytes")
		// Every query head's fit reads its rows; every KV head's union its
		// keys and values, fp16.
		assert.InDelta(t, qHeads*r.Sampled*2*dim, s.Sampled, 1e-6*s.Sampled, "fit's bytes")
		assert.InDelta(t, kvHeads*r.Union*2*2*dim, s.Attended, 1e-6*s.Attended, "unions' bytes")
		return s
	}

	def := traffic(sparse.TacticCurveFit())
	fp16 := (def.Centroids - kvHeads*4*dim) * float64(2*dim) / float64(kvcache.CodedRowBytes(dim))
	assert.Less(t, def.SelectionShare(), 0.8*(fp16+def.Sampled)/def.Attended, "8-bit centroids against fp16 ones")

	capped := sparse.TacticCurveFit()
	capped.MaxInitial = 1024
	s := traffic(capped)
	assert.LessOrEqual(t, s.Selection(), 0.5*s.Attended, "the selection reads at most half of what attention over the unions reads")
}
