package sparse

import (
	"math"
	"math/rand/v2"
	"sort"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestTacticHarmonic(t *testing.T) {
	h := 0.0
	for m := 1; m <= 20000; m++ {
		h += 1 / float64(m)
		require.InDeltaf(t, h, TacticHarmonic(m), 1e-14*h, "m=%d", m)
	}
	assert.Equal(t, 0.0, TacticHarmonic(0))
	assert.Equal(t, 0.0, TacticHarmonic(-3))
}

func TestTacticCurveSum(t *testing.T) {
	r := rand.New(rand.NewPCG(21, 22))
	for trial := 0; trial < 2000; trial++ {
		a, b := r.NormFloat64()*10, r.NormFloat64()*0.1
		switch trial % 5 {
		case 0:
			b = 0
		case 1:
			a = 0
		}
		lo := r.IntN(300)
		hi := lo + r.IntN(3000) - 20
		want, scaleSum := 0.0, 0.0
		for x := max(lo, 1); x <= hi; x++ {
			want += math.Max(0, a/float64(x)+b)
			scaleSum += math.Abs(a/float64(x)) + math.Abs(b)
		}
		got := tacticCurveSum(a, b, lo, hi)
		require.InDeltaf(t, want, got, 1e-12*scaleSum+1e-300, "a=%v b=%v [%d, %d]", a, b, lo, hi)
	}
}

// syntheticIndex builds d = 1 keys whose exp scores (q = 1, scale = 1) are
// e(x) = a/x + b at list position x = 1 … n, grouped into clusters of size
// size in list order, with token ids offset by first. Cluster centroids are
// member means, so the centroid order is the list order.
func syntheticIndex(t *testing.T, n, size, first int, a, b float64) (keys []float64, idx *ClusterIndex) {
	t.Helper()
	keys = make([]float64, first+n)
	assign := make([]int32, n)
	for x := 1; x <= n; x++ {
		keys[first+x-1] = math.Log(a/float64(x) + b)
		assign[x-1] = int32((x - 1) / size)
	}
	c := (n + size - 1) / size
	cent := make([]float64, c)
	for j := 0; j < c; j++ {
		lo, hi := j*size, min(n, (j+1)*size)
		for x := lo; x < hi; x++ {
			cent[j] += keys[first+x]
		}
		cent[j] /= float64(hi - lo)
	}
	idx, err := NewClusterIndex(cent, 1, assign, int32(first))
	require.NoError(t, err)
	return keys, idx
}

// bruteBudget returns the least k with fixed + Σ_{x≤k} e_x ≥ p·(fixed + Σ e).
func bruteBudget(e []float64, fixed, p float64) int {
	total := fixed
	for _, v := range e {
		total += v
	}
	c := fixed
	for k := 0; k <= len(e); k++ {
		if k > 0 {
			c += e[k-1]
		}
		if c >= p*total {
			return k
		}
	}
	return len(e)
}

func TestTacticBudgetRecoversExactCurve(t *testing.T) {
	const n, size, sinks = 4000, 8, 2
	a, b := 50.0, 0.01
	keys, idx := syntheticIndex(t, n, size, sinks, a, b)
	keys[0], keys[1] = 3, 1 // sinks with their own scores
	fixed := []int32{0, 1}
	e := make([]float64, n)
	for x := 1; x <= n; x++ {
		e[x-1] = a/float64(x) + b
	}
	fixedSum := math.Exp(3) + math.Exp(1)
	for _, p := range []float64{0.3, 0.5, 0.7, 0.83, 0.9, 0.97} {
		bud, err := TacticBudgetRef([]float64{1}, 1, keys, idx, fixed, p, TacticCurveFit())
		require.NoError(t, err)
		scale := math.Exp(bud.Shift)
		assert.InDelta(t, a, bud.A*scale, 1e-9*a)
		assert.InDelta(t, b, bud.B*scale, 1e-9*a)
		assert.InDelta(t, fixedSum, bud.FixedSum*scale, 1e-12*fixedSum)
		want := bruteBudget(e, fixedSum, p)
		assert.Equalf(t, want, bud.Budget, "P=%v", p)
		assert.Equal(t, (bud.Budget+size-1)/size, bud.Selected)
		assert.Equal(t, min(n, bud.Selected*size), bud.SelectedTokens)
	}
}

func TestTacticBudgetWindowPlacement(t *testing.T) {
	keys, idx := syntheticIndex(t, 1000, 10, 0, 20, 0.5)
	fit := TacticFit{InitialFrac: 0.02, Window1: 0.05, Window2: 0.30, WindowFrac: 0.02}
	bud, err := TacticBudgetRef([]float64{1}, 1, keys, idx, nil, 0.5, fit)
	require.NoError(t, err)
	// ceil(0.02·1000) = 20 exact tokens: two clusters.
	assert.Equal(t, 2, bud.ExactClusters)
	assert.Equal(t, 20, bud.ExactTokens)
	// w = 20. Window 1: centre 50, nominal [40, 59], clusters of ranks 3
	// (positions 31–40) to 5 (51–60). Window 2: centre 300, [290, 309],
	// ranks 28–30.
	assert.Equal(t, [2]int{3, 6}, bud.Win1)
	assert.Equal(t, [2]int{28, 31}, bud.Win2)
	assert.Equal(t, 20+30+30, bud.SampledTokens())
	h1 := (TacticHarmonic(60) - TacticHarmonic(30)) / 30
	assert.InDelta(t, h1, bud.H1, 1e-15)
	for j := 0; j < 100; j++ {
		assert.Equal(t, int32(j), bud.Order[j])
		assert.Equal(t, 10*j, bud.Offsets[j])
	}

	// MaxWindow 5 caps w at 5. Window 1: [48, 52], ranks 4–5; window 2:
	// [298, 302], ranks 29–30.
	fit.MaxWindow = 5
	bud, err = TacticBudgetRef([]float64{1}, 1, keys, idx, nil, 0.5, fit)
	require.NoError(t, err)
	assert.Equal(t, [2]int{4, 6}, bud.Win1)
	assert.Equal(t, [2]int{29, 31}, bud.Win2)
	assert.Equal(t, 20+20+20, bud.SampledTokens())
	fit.MaxWindow = -1
	_, err = TacticBudgetRef([]float64{1}, 1, keys, idx, nil, 0.5, fit)
	require.ErrorContains(t, err, "MaxWindow")

	// Windows of 80 tokens hold 8 clusters of the mean size, enough for a
	// stride of 2 (4·2): window 1, centre 200, is [160, 239], ranks 15–23,
	// of which it scores clusters 16, 18, 20 and 22; window 2, centre 500,
	// [460, 539], ranks 45–53, scores 46 to 52. The means are over the
	// tokens scored, 1/x over all the windows' positions.
	fit = TacticFit{InitialFrac: 0.02, Window1: 0.2, Window2: 0.5, WindowFrac: 0.08, WindowStride: 2}
	bud, err = TacticBudgetRef([]float64{1}, 1, keys, idx, nil, 0.5, fit)
	require.NoError(t, err)
	assert.Equal(t, [2]int{15, 24}, bud.Win1)
	assert.Equal(t, [2]int{45, 54}, bud.Win2)
	assert.Equal(t, 40, bud.Scored1)
	assert.Equal(t, 40, bud.Scored2)
	assert.Equal(t, 20+40+40, bud.SampledTokens())
	assert.InDelta(t, (TacticHarmonic(240)-TacticHarmonic(150))/90, bud.H1, 1e-15)
	mean := func(clusters ...int) float64 {
		sum, count := 0.0, 0
		for _, c := range clusters {
			for _, tok := range idx.Members[c] {
				sum += math.Exp(keys[tok] - bud.Shift)
				count++
			}
		}
		return sum / float64(count)
	}
	assert.InDelta(t, mean(16, 18, 20, 22), bud.Mu1, 1e-12*bud.Mu1)
	assert.InDelta(t, mean(46, 48, 50, 52), bud.Mu2, 1e-12*bud.Mu2)
	assert.InDelta(t, (bud.Mu1-bud.Mu2)/(bud.H1-bud.H2), bud.A, 1e-9*math.Abs(bud.A))
	// A stride of 3 needs windows of 4·3 clusters: these score every one.
	fit.WindowStride = 3
	bud, err = TacticBudgetRef([]float64{1}, 1, keys, idx, nil, 0.5, fit)
	require.NoError(t, err)
	assert.Equal(t, 90, bud.Scored1)
	assert.Equal(t, 20+90+90, bud.SampledTokens())

	// A window that scores nothing (window 1's clusters left out): the
	// curve is flat at window 2's mean; neither: nothing beyond the exact
	// part is estimated.
	fit.WindowStride = 0
	skip := func(lo, hi int32) func(c int32) []int32 {
		return func(c int32) []int32 {
			if c >= lo && c < hi {
				return nil
			}
			return idx.Members[c]
		}
	}
	bud, err = tacticBudget([]float64{1}, 1, keys, idx, nil, 0.5, fit, nil, skip(15, 24))
	require.NoError(t, err)
	assert.Zero(t, bud.Scored1)
	assert.Equal(t, 90, bud.Scored2)
	assert.Zero(t, bud.A)
	assert.InDelta(t, mean(45, 46, 47, 48, 49, 50, 51, 52, 53), bud.B, 1e-12*bud.B)
	bud, err = tacticBudget([]float64{1}, 1, keys, idx, nil, 0.5, fit, nil, skip(15, 54))
	require.NoError(t, err)
	assert.Zero(t, bud.Scored1+bud.Scored2)
	assert.Zero(t, bud.A)
	assert.Zero(t, bud.B)
	assert.InDelta(t, bud.FixedSum+bud.ExactSum, bud.Total, 1e-12*bud.Total)
	fit.WindowStride = MaxWindowStride + 1
	_, err = TacticBudgetRef([]float64{1}, 1, keys, idx, nil, 0.5, fit)
	require.ErrorContains(t, err, "WindowStride")
}

// TestTacticSampledTokensCountsEachClusterOnce checks SampledTokens against
// a count of the marked ranks, with windows that overlap the exact part
// and each other, over clusters of uneven sizes.
func TestTacticSampledTokensCountsEachClusterOnce(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 9))
	const n, d = 3000, 4
	keys := make([]float64, n*d)
	for i := range keys {
		keys[i] = rng.NormFloat64()
	}
	assign := make([]int32, n)
	for i := range assign {
		assign[i] = int32(rng.IntN(97)) // uneven sizes, some clusters empty
	}
	cent := make([]float64, 97*d)
	for i := range cent {
		cent[i] = rng.NormFloat64()
	}
	idx, err := NewClusterIndex(cent, d, assign, 0)
	require.NoError(t, err)
	q := []float64{0.3, -1.1, 0.7, 0.2}
	for _, fit := range []TacticFit{
		TacticCurveFit(),
		{InitialFrac: 0.05, Window1: 0.03, Window2: 0.06, WindowFrac: 0.04},                  // windows inside and across the exact part
		{InitialFrac: 0.01, Window1: 0.30, Window2: 0.32, WindowFrac: 0.05},                  // windows overlapping each other
		{InitialFrac: 0.001, Window1: 0.5, Window2: 0.9, WindowFrac: 0.001},                  // narrow, apart
		{InitialFrac: 0.05, Window1: 0.13, Window2: 0.36, WindowFrac: 0.24, WindowStride: 2}, // thinned
		{InitialFrac: 0.01, Window1: 0.30, Window2: 0.32, WindowFrac: 0.25, WindowStride: 2}, // thinned, overlapping
	} {
		bud, err := TacticBudgetRef(q, 0.5, keys, idx, nil, 0.9, fit)
		require.NoError(t, err)
		marked := make([]bool, idx.Clusters())
		for j := 0; j < bud.ExactClusters; j++ {
			marked[j] = true
		}
		k := fit.windowStride(n, idx.Clusters())
		if fit.WindowFrac > 0.2 {
			require.Equal(t, 2, k, "fit %+v: windows wide enough to thin", fit)
		}
		for _, r := range [][2]int{bud.Win1, bud.Win2} {
			for j := r[0]; j < r[1]; j++ {
				marked[j] = marked[j] || int(bud.Order[j])%k == 0
			}
		}
		want := 0
		for j, m := range marked {
			if m {
				want += idx.Sizes[bud.Order[j]]
			}
		}
		assert.Equalf(t, want, bud.SampledTokens(), "fit %+v", fit)
		assert.Positivef(t, want, "fit %+v samples nothing", fit)
	}
}

func TestTacticBudgetAllExactMatchesBruteForce(t *testing.T) {
	r := rand.New(rand.NewPCG(31, 32))
	const n, d, sinks = 600, 8, 3
	keys := blobs(r, sinks+n, d, 10)
	idx, err := BuildClusterIndexRef(keys, d, sinks, n, 16, 10, 5)
	require.NoError(t, err)
	fixed := []int32{0, 1, 2}
	fit := TacticFit{InitialFrac: 1, Window1: 0.1, Window2: 0.6, WindowFrac: 0.01}
	for trial := 0; trial < 20; trial++ {
		q := randMatrix(r, 1, d)
		p := 0.05 + 0.9*r.Float64()
		bud, err := TacticBudgetRef(q, 0.7, keys, idx, fixed, p, fit)
		require.NoError(t, err)
		require.Equal(t, n, bud.ExactTokens)
		// The true exp scores in list order, with the same shift.
		var e []float64
		for _, c := range bud.Order {
			for _, tok := range idx.Members[c] {
				e = append(e, math.Exp(0.7*dot(q, keys[int(tok)*d:int(tok+1)*d])-bud.Shift))
			}
		}
		fs := 0.0
		for _, tok := range fixed {
			fs += math.Exp(0.7*dot(q, keys[int(tok)*d:int(tok+1)*d]) - bud.Shift)
		}
		require.Equal(t, bruteBudget(e, fs, p), bud.Budget)
		j := sort.SearchInts(bud.Offsets, bud.Budget)
		require.Equal(t, j, bud.Selected)
		// Order is by descending centroid score, ties by index.
		for i := 1; i < len(bud.Order); i++ {
			a, b := bud.Order[i-1], bud.Order[i]
			require.True(t, bud.Scores[a] > bud.Scores[b] || (bud.Scores[a] == bud.Scores[b] && a < b))
		}
	}
}

func TestTacticBudgetMonotoneInP(t *testing.T) {
	r := rand.New(rand.NewPCG(41, 42))
	const n, d = 2000, 8
	keys := blobs(r, n, d, 30)
	idx, err := BuildClusterIndexRef(keys, d, 0, n, 16, 10, 9)
	require.NoError(t, err)
	for trial := 0; trial < 10; trial++ {
		q := randMatrix(r, 1, d)
		prev := -1
		for p := 0.05; p <= 1; p += 0.05 {
			bud, err := TacticBudgetRef(q, 0.5, keys, idx, nil, math.Min(p, 1), TacticCurveFit())
			require.NoError(t, err)
			require.GreaterOrEqual(t, bud.Budget, prev)
			require.True(t, bud.Budget >= 0 && bud.Budget <= n)
			require.GreaterOrEqual(t, bud.SelectedTokens, bud.Budget)
			prev = bud.Budget
		}
	}
}

func TestTacticBudgetDegenerate(t *testing.T) {
	// One cluster of 4 tokens, no exact part: both windows are that cluster,
	// so the curve is the constant b = mean e, and S(k) = fixed + b·k.
	keys := []float64{0, math.Log(2), math.Log(4), math.Log(6), math.Log(8)}
	idx, err := NewClusterIndex([]float64{1}, 1, []int32{0, 0, 0, 0}, 1)
	require.NoError(t, err)
	fit := TacticFit{InitialFrac: 0, Window1: 0.1, Window2: 0.6, WindowFrac: 0.1}
	bud, err := TacticBudgetRef([]float64{1}, 1, keys, idx, []int32{0}, 0.5, fit)
	require.NoError(t, err)
	assert.Equal(t, 0, bud.ExactClusters)
	assert.Equal(t, 0.0, bud.Shift) // F = {0}: score 0
	assert.Equal(t, 0.0, bud.A)
	assert.InDelta(t, 5, bud.B, 1e-12)
	assert.InDelta(t, 21, bud.Total, 1e-12)
	assert.Equal(t, 2, bud.Budget) // 1 + 5k ≥ 10.5
	assert.Equal(t, 1, bud.Selected)

	// No clustered tokens at all.
	empty, err := NewClusterIndex([]float64{0}, 1, nil, 0)
	require.NoError(t, err)
	bud, err = TacticBudgetRef([]float64{1}, 1, keys, empty, []int32{0}, 0.9, fit)
	require.NoError(t, err)
	assert.Equal(t, 0, bud.Budget)
	assert.Equal(t, 0, bud.Selected)
}

func TestTacticPOneSelectsAllAndMatchesDense(t *testing.T) {
	r := rand.New(rand.NewPCG(51, 52))
	const d, sinks, end, pos = 16, 4, 1500, 1530
	keys := blobs(r, pos+1, d, 20)
	values := randMatrix(r, pos+1, d)
	idx, err := BuildClusterIndexRef(keys, d, sinks, end-sinks, 16, 10, 3)
	require.NoError(t, err)
	fixed, err := TacticFixedTokens(sinks, end, pos)
	require.NoError(t, err)
	qs := [][]float64{randMatrix(r, 1, d), randMatrix(r, 1, d), randMatrix(r, 1, d)}
	outs, tokens, budgets, err := TacticDecodeRef(qs, keys, values, 0.25, idx, fixed, 1, TacticCurveFit())
	require.NoError(t, err)
	require.Len(t, tokens, pos+1)
	for i, tok := range tokens {
		require.Equal(t, int32(i), tok)
	}
	for h, q := range qs {
		require.Equal(t, end-sinks, budgets[h].Budget)
		dense, err := AttendRef(q, keys, values, 0.25)
		require.NoError(t, err)
		assert.InDeltaSlice(t, dense, outs[h], 1e-12)
	}
}

func TestTacticSelectUnion(t *testing.T) {
	idx, err := NewClusterIndex([]float64{0, 0, 0}, 1, []int32{2, 0, 1, 0, 2, 1}, 2)
	require.NoError(t, err)
	// Members: 0 → {3, 5}, 1 → {4, 7}, 2 → {2, 6}.
	b1 := &TacticBudget{Order: []int32{2, 0, 1}, Selected: 1}
	b2 := &TacticBudget{Order: []int32{0, 2, 1}, Selected: 2}
	assert.Equal(t, []int32{0, 1, 2, 3, 5, 6, 8}, TacticSelectRef(idx, []int32{8, 0, 1}, b1, b2))
	assert.Equal(t, []int32{2, 6}, TacticSelectRef(idx, nil, b1))

	f, err := TacticFixedTokens(2, 5, 7)
	require.NoError(t, err)
	assert.Equal(t, []int32{0, 1, 5, 6, 7}, f)
	f, err = TacticFixedTokens(0, 8, 7)
	require.NoError(t, err)
	assert.Empty(t, f)
	_, err = TacticFixedTokens(3, 2, 7)
	assert.Error(t, err)
	_, err = TacticFixedTokens(0, 9, 7)
	assert.Error(t, err)
}

func TestTacticBudgetErrors(t *testing.T) {
	keys, idx := syntheticIndex(t, 100, 4, 1, 10, 1)
	q := []float64{1}
	fit := TacticCurveFit()
	for name, f := range map[string]func() error{
		"p0":      func() error { _, err := TacticBudgetRef(q, 1, keys, idx, nil, 0, fit); return err },
		"p>1":     func() error { _, err := TacticBudgetRef(q, 1, keys, idx, nil, 1.1, fit); return err },
		"pNaN":    func() error { _, err := TacticBudgetRef(q, 1, keys, idx, nil, math.NaN(), fit); return err },
		"dim":     func() error { _, err := TacticBudgetRef([]float64{1, 2}, 1, keys, idx, nil, 0.5, fit); return err },
		"overlap": func() error { _, err := TacticBudgetRef(q, 1, keys, idx, []int32{5}, 0.5, fit); return err },
		"range":   func() error { _, err := TacticBudgetRef(q, 1, keys[:50], idx, nil, 0.5, fit); return err },
		"repeat":  func() error { _, err := TacticBudgetRef(q, 1, keys, idx, []int32{0, 0}, 0.5, fit); return err },
		"fit": func() error {
			_, err := TacticBudgetRef(q, 1, keys, idx, nil, 0.5, TacticFit{InitialFrac: -1})
			return err
		},
		"nil":   func() error { _, err := TacticBudgetRef(q, 1, keys, nil, nil, 0.5, fit); return err },
		"heads": func() error { _, _, _, err := TacticDecodeRef(nil, keys, keys, 1, idx, nil, 0.5, fit); return err },
	} {
		assert.Error(t, f(), name)
	}
}

// TestSelectionWidth checks the selection's workgroups per head: about two
// sampled clusters a team, at least half a wave where every team has a
// cluster, at most one wave (selectWave) in all when a batch's sequences
// share the dispatch, never none.
func TestSelectionWidth(t *testing.T) {
	const teams = 16 // teams of 32 threads in workgroups of 512
	for _, c := range []struct{ sampled, sequences, heads, rounds, want int }{
		{228, 1, 32, 1, 8},  // 131 072 tokens: 8 (one wave of 256)
		{105, 1, 32, 1, 4},  // 32 768 tokens: the clusters decide
		{57, 1, 32, 1, 4},   // windows of every 4th cluster: half a wave
		{40, 1, 32, 1, 3},   // fewer clusters than half a wave's teams
		{180, 1, 32, 1, 6},  // 131 072 tokens, every 4th cluster
		{180, 1, 32, 16, 8}, // and a workgroup's 16 rounds of listing: 2
		{100, 1, 32, 16, 8}, // the exact part at 1 %: 2 rounds, not 4
		{57, 1, 32, 4, 4},   // 32 768 tokens: 2 rounds with half a wave
		{460, 1, 32, 1, 8},  // 262 144 tokens: one wave, not 15
		{460, 1, 32, 32, 8}, // however many rounds
		{228, 2, 32, 1, 4},  // a batch of 2
		{228, 4, 32, 1, 2},  // of 4
		{228, 8, 32, 1, 1},  // of 8: one a head
		{228, 8, 32, 16, 1}, // whatever its rounds
		{228, 16, 32, 1, 1}, // of 16: still one a head
		{105, 4, 32, 1, 2},  // 32 768 tokens, a batch of 4
		{0, 1, 8, 1, 1},     // nothing to sample
		{0, 1, 8, 6, 3},     // nothing to sample, but 6 rounds to list
		{40, 5, 8, 1, 3},    // the batch test's shape: half a wave
	} {
		got := selectionWidth(c.sampled, teams, c.sequences, c.heads, c.rounds)
		require.Equal(t, c.want, got, "%d clusters, %d sequences of %d heads, %d rounds", c.sampled, c.sequences, c.heads, c.rounds)
		require.True(t, got == 1 || got*c.sequences*c.heads <= selectWave, "%d workgroups a head beyond a wave", got)
	}
}
