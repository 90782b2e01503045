package lm

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// TestAttentionShifts runs the model over a short prefix and checks that
// every shift lies in [0, 1], that the shift over two positions is the
// mean of each one's, and the refusals.
func TestAttentionShifts(t *testing.T) {
	w := testWeights(t)
	text := document(t)[:300]
	shifts, err := w.AttentionShifts(text, []int{299})
	require.NoError(t, err)
	require.Len(t, shifts, w.Config.Layers-1)
	for l, s := range shifts {
		require.True(t, s >= 0 && s <= 1, "layers %d and %d: shift %v", l, l+1, s)
	}
	both, err := w.AttentionShifts(text, []int{150, 299})
	require.NoError(t, err)
	one, err := w.AttentionShifts(text, []int{150})
	require.NoError(t, err)
	for l := range shifts {
		require.InDelta(t, (shifts[l]+one[l])/2, both[l], 1e-12, "the shift is the mean over positions")
	}
	_, err = w.AttentionShifts(text, nil)
	require.Error(t, err)
	_, err = w.AttentionShifts(text, []int{300})
	require.Error(t, err)
}

// TestProposeRefresh checks the rule on shifts written out by hand.
func TestProposeRefresh(t *testing.T) {
	shifts := []float64{0.5, 0.4, 0.1, 0.3, 0.05} // into layers 1 … 5
	got, err := ProposeRefresh(shifts, 2)
	require.NoError(t, err)
	// Past the warm-up: into 3: 0.1, 4: 0.3, 5: 0.05; mean 0.15.
	require.Equal(t, []int{2, 4}, got)
	got, err = ProposeRefresh(shifts, 5)
	require.NoError(t, err)
	require.Equal(t, []int{5}, got)
	_, err = ProposeRefresh(shifts, 6)
	require.Error(t, err)
}
