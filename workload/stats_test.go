package workload

import (
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/x448/float16"

	"github.com/vksparse/vksparse/trace"
)

// tinyTrace has one head of dimension 2 whose query sees logits
// log 4, log 2, log 1, log 1 (Scale 1): probabilities 1/2, 1/4, 1/8, 1/8.
func tinyTrace() *trace.Trace {
	half := func(x float64) uint16 { return float16.Fromfloat32(float32(x)).Bits() }
	return &trace.Trace{
		KVHeads: 1, QHeads: 1, HeadDim: 2, Tokens: 4,
		K:     []uint16{half(2), 0, half(1), 0, 0, 0, 0, 0},
		V:     make([]uint16, 8),
		Q:     []float32{float32(math.Log(2)), 0},
		QPos:  []int32{3},
		Scale: 1,
	}
}

func TestHeadAttentionExact(t *testing.T) {
	a, err := HeadAttention(tinyTrace(), 0, 0)
	require.NoError(t, err)
	assert.InDeltaSlice(t, []float64{math.Log(4), math.Log(2), 0, 0}, a.Logits, 1e-6)
	assert.InDeltaSlice(t, []float64{0.5, 0.25, 0.125, 0.125}, a.Probs, 1e-6)

	for p, want := range map[float64]int{0: 0, 0.3: 1, 0.5: 1, 0.6: 2, 0.75: 2, 0.8: 3, 0.99: 4, 1: 4} {
		assert.Equal(t, want, a.TokensFor(p), "P = %v", p)
	}
	assert.InDelta(t, 0.75, a.Mass(0, 2), 1e-6)
	assert.InDelta(t, 1, a.Mass(-5, 50), 1e-6)

	mean := (math.Log(4) + math.Log(2)) / 4
	var variance float64
	for _, l := range a.Logits {
		variance += (l - mean) * (l - mean) / 4
	}
	assert.InDelta(t, math.Sqrt(variance), a.LogitStd(), 1e-6)
}

func TestHeadAttentionAttendsUpToQPos(t *testing.T) {
	tr := tinyTrace()
	tr.QPos[0] = 1
	a, err := HeadAttention(tr, 0, 0)
	require.NoError(t, err)
	assert.InDeltaSlice(t, []float64{2.0 / 3, 1.0 / 3}, a.Probs, 1e-6)
}

func TestHeadAttentionRejectsBadInput(t *testing.T) {
	_, err := HeadAttention(tinyTrace(), 1, 0)
	assert.ErrorContains(t, err, "query 1")
	_, err = HeadAttention(tinyTrace(), 0, -1)
	assert.ErrorContains(t, err, "head -1")
	broken := tinyTrace()
	broken.K = broken.K[:6]
	_, err = HeadAttention(broken, 0, 0)
	assert.Error(t, err)
}
