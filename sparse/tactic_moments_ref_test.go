package sparse

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestSetSpreadsRef checks the spreads on keys whose deviations are known:
// cluster 0 holds ±(1, 2) about (5, 5), cluster 1 ±(3, 0) about (−1, 0),
// cluster 2 is empty.
func TestSetSpreadsRef(t *testing.T) {
	keys := []float64{
		6, 7, 4, 3, // cluster 0: (5,5) ± (1,2)
		2, 0, -4, 0, // cluster 1: (−1,0) ± (3,0)
	}
	idx := &ClusterIndex{D: 2, Centroids: make([]float64, 6), Sizes: []int{2, 2, 0}, Members: [][]int32{{0, 1}, {2, 3}, {}}}
	require.NoError(t, idx.SetSpreadsRef(keys))
	// σ²_0 = (1+4)/2, σ²_1 = 9/2; v = ((1+1+9+9)/4, (4+4)/4) = (5, 2), v̄ = 3.5.
	require.InDeltaSlice(t, []float64{2.5, 4.5, 0}, idx.Spreads, 1e-12)
	require.InDeltaSlice(t, []float64{5 / 3.5, 2 / 3.5}, idx.DimWeights, 1e-12)

	same := &ClusterIndex{D: 2, Centroids: make([]float64, 2), Sizes: []int{2}, Members: [][]int32{{0, 1}}}
	require.NoError(t, same.SetSpreadsRef([]float64{1, 1, 1, 1}))
	require.Equal(t, []float64{0}, same.Spreads)
	require.Equal(t, []float64{1, 1}, same.DimWeights, "no spread: every dimension weighs 1")

	require.Error(t, idx.SetSpreadsRef(keys[:3]), "not whole rows")
	require.Error(t, idx.SetSpreadsRef(keys[:2]), "a member outside the keys")
}

// TestTacticMomentsBudget checks the moment estimate against its formula
// computed here: the cut is the fewest clusters in score order whose
// estimates with F reach P of the whole, no key row but the fixed tokens'
// is read, and an index without spreads is refused.
func TestTacticMomentsBudget(t *testing.T) {
	r := rand.New(rand.NewPCG(41, 42))
	const n, d, sinks = 900, 16, 4
	keys := blobs(r, sinks+n, d, 10)
	idx, err := BuildClusterIndexRef(keys, d, sinks, n, 16, 10, 5)
	require.NoError(t, err)
	fixed := []int32{0, 1, 2, 3}
	fit := DefaultTacticFit()
	require.True(t, fit.Moments, "the default fit is the moment estimate")
	_, err = TacticBudgetRef(randMatrix(r, 1, d), 0.3, keys, idx, fixed, 0.9, fit)
	require.Error(t, err, "no spreads yet")
	require.NoError(t, idx.SetSpreadsRef(keys))
	for trial := 0; trial < 40; trial++ {
		q := randMatrix(r, 1, d)
		for i := range q {
			q[i] *= 1 + 3*r.Float64()
		}
		scale, p := 0.25, 0.05+0.9*r.Float64()
		bud, err := TacticBudgetRef(q, scale, keys, idx, fixed, p, fit)
		require.NoError(t, err)
		require.Zero(t, bud.SampledTokens())
		shift := 0.0
		for i := range q {
			shift += scale * scale * q[i] * q[i] * idx.DimWeights[i]
		}
		m := math.Inf(-1)
		for c := range idx.Sizes {
			m = math.Max(m, scale*dot(q, idx.Centroids[c*d:(c+1)*d]))
		}
		f := 0.0
		for _, tok := range fixed {
			f += math.Exp(scale*dot(q, keys[int(tok)*d:int(tok+1)*d]) - m)
		}
		est := func(c int32) float64 {
			s := scale*dot(q, idx.Centroids[int(c)*d:int(c+1)*d]) + 0.5*idx.Spreads[c]*shift - m
			return float64(idx.Sizes[c]) * math.Exp(math.Min(s, MomentExpCap))
		}
		total := f
		for c := range idx.Sizes {
			total += est(int32(c))
		}
		run, want := f, 0
		for want < len(bud.Order) && run < p*total*(1-1e-12) {
			run += est(bud.Order[want])
			want++
		}
		for want > 0 && idx.Sizes[bud.Order[want-1]] == 0 {
			want-- // an empty cluster adds nothing: the cut stops before it
		}
		require.InDelta(t, total, bud.Total, 1e-9*total)
		require.Equalf(t, want, bud.Selected, "trial %d, P %.3f", trial, p)
		require.Equal(t, bud.Offsets[bud.Selected], bud.SelectedTokens)
	}
}
