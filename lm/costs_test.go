package lm

import (
	"math"
	"math/rand"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestCompareLogitsByHand checks the costs on two positions whose
// distributions are written out by hand.
func TestCompareLogitsByHand(t *testing.T) {
	ln := func(x float64) float32 { return float32(math.Log(x)) }
	// Position 0: dense (0.5, 0.25, 0.25), policy (0.25, 0.5, 0.25).
	// Position 1: dense (0.7, 0.2, 0.1), policy the same.
	dense := []float32{ln(0.5), ln(0.25), ln(0.25), ln(0.7), ln(0.2), ln(0.1)}
	policy := []float32{ln(0.25), ln(0.5), ln(0.25), ln(0.7), ln(0.2), ln(0.1)}
	c, err := CompareLogits(dense, policy, 3, []int{1, -1})
	require.NoError(t, err)
	kl0 := 0.5*math.Log(2) + 0.25*math.Log(0.5)
	require.InDelta(t, kl0/2, c.KLMean, 1e-6)
	require.InDelta(t, kl0, c.KLP99, 1e-6)
	require.InDelta(t, 0.5, c.Top1, 1e-12)
	require.InDelta(t, (0.75+1)/2, c.Acceptance, 1e-6)
	require.InDelta(t, 1, c.BitsPerByte, 1e-6) // −log2 0.5, position 1 skipped
	require.InDelta(t, 2, c.DenseBitsPerByte, 1e-6)
}

// TestCompareLogitsIdentical checks that a policy equal to dense costs
// nothing, on random logits of realistic scale.
func TestCompareLogitsIdentical(t *testing.T) {
	rng := rand.New(rand.NewSource(1))
	const n, vocab = 37, 256
	logits := make([]float32, n*vocab)
	next := make([]int, n)
	for i := range logits {
		logits[i] = float32(rng.NormFloat64() * 4)
	}
	for i := range next {
		next[i] = rng.Intn(vocab)
	}
	c, err := CompareLogits(logits, logits, vocab, next)
	require.NoError(t, err)
	require.InDelta(t, 0, c.KLMean, 1e-12)
	require.Equal(t, 1.0, c.Top1)
	require.InDelta(t, 1, c.Acceptance, 1e-9)
	require.Equal(t, c.DenseBitsPerByte, c.BitsPerByte)
	require.Greater(t, c.BitsPerByte, 0.0)
}

// TestCompareLogitsRejectsBadInput checks shapes, NaN and bytes outside
// the vocabulary.
func TestCompareLogitsRejectsBadInput(t *testing.T) {
	good := []float32{1, 2, 3, 4}
	_, err := CompareLogits(good, good[:3], 2, []int{0, 1})
	require.Error(t, err)
	_, err = CompareLogits(good, good, 2, []int{0})
	require.Error(t, err)
	_, err = CompareLogits(good, good, 0, nil)
	require.Error(t, err)
	_, err = CompareLogits(nil, nil, 2, nil)
	require.Error(t, err)
	_, err = CompareLogits(good, []float32{1, float32(math.NaN()), 3, 4}, 2, []int{0, 1})
	require.Error(t, err)
	_, err = CompareLogits(good, good, 2, []int{0, 2})
	require.Error(t, err)
}
