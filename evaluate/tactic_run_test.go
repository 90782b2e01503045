package evaluate

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/sparse"
)

// TestUnionGBps checks the attention stage's bandwidth over the unions: K
// and V rows of 2 bytes a dimension for every KV head, over the stage's time.
func TestUnionGBps(t *testing.T) {
	heads := sparse.Heads{Query: 32, KV: 8, Dim: 128}
	// 1 000 tokens a KV head: 1 000 × 8 × 128 × 2 × 2 bytes in 2 µs.
	require.InDelta(t, 2048.0, unionGBps(1000, heads, 2), 1e-9)
	require.Zero(t, unionGBps(1000, heads, 0), "no time measured")
}
