package sparse

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// randomGroupIndex returns keys and values of n tokens (d wide) and an
// index of tokens [first, first+count) into clusters by a random
// assignment (some clusters left empty), with member-mean centroids.
func randomGroupIndex(t *testing.T, r *rand.Rand, n, d, first, count, c int) (keys, values []float64, idx *ClusterIndex) {
	t.Helper()
	keys, values = make([]float64, n*d), make([]float64, n*d)
	for i := range keys {
		keys[i], values[i] = r.NormFloat64()*2, r.NormFloat64()
	}
	assign := make([]int32, count)
	for i := range assign {
		assign[i] = int32(r.IntN(max(1, c-1))) // cluster c−1 stays empty
	}
	cent := make([]float64, c*d)
	sizes := make([]int, c)
	for i, a := range assign {
		sizes[a]++
		for j := 0; j < d; j++ {
			cent[int(a)*d+j] += keys[(first+i)*d+j]
		}
	}
	for a, s := range sizes {
		for j := 0; j < d && s > 0; j++ {
			cent[a*d+j] /= float64(s)
		}
	}
	idx, err := NewClusterIndex(cent, d, assign, int32(first))
	require.NoError(t, err)
	return keys, values, idx
}

func TestDoublePCutsRef(t *testing.T) {
	r := rand.New(rand.NewPCG(41, 42))
	for trial := 0; trial < 300; trial++ {
		c := 1 + r.IntN(60)
		logits := make([]float64, c)
		for i := range logits {
			logits[i] = r.NormFloat64() * 3
			if r.IntN(10) == 0 {
				logits[i] = math.Inf(-1)
			}
		}
		opts := DoubleP{P1: 0.3 + 0.7*r.Float64(), P2: 0.1 + 0.9*r.Float64()}
		rank := DoublePOrderRanks(logits)
		exact, keep := DoublePCutsRef(logits, rank, c, opts)
		// Brute force: masses in descending order.
		var ws []float64
		total := 0.0
		for r := 0; r < c; r++ {
			for i, x := range logits {
				if rank[i] == r {
					ws = append(ws, math.Exp(x))
					total += math.Exp(x)
				}
			}
		}
		if total == 0 {
			assert.Equal(t, 0, keep)
			continue
		}
		prefix := func(k int) float64 {
			s := 0.0
			for _, w := range ws[:k] {
				s += w
			}
			return s
		}
		require.LessOrEqual(t, keep, len(ws))
		require.GreaterOrEqual(t, prefix(keep), opts.P1*total*(1-1e-12), "trial %d", trial)
		if keep > 1 {
			require.Less(t, prefix(keep-1), opts.P1*total, "trial %d: keep %d is not the least", trial, keep)
		}
		require.LessOrEqual(t, exact, keep)
		require.GreaterOrEqual(t, prefix(exact), opts.P2*prefix(keep)*(1-1e-12), "trial %d", trial)
		if exact > 1 {
			require.Less(t, prefix(exact-1), opts.P2*prefix(keep), "trial %d: exact %d is not the least", trial, exact)
		}
	}
}

// With one token per cluster a pseudo-token is its token (centroid = key,
// mean = value, ln 1 = 0), so Double-P with P1 = 1 is dense attention
// whatever P2; with P2 = P1 = 1 every kept cluster is exact.
func TestDoublePDecodeRefSingletons(t *testing.T) {
	r := rand.New(rand.NewPCG(43, 44))
	const d, n, first = 8, 90, 4
	count := n - first - 6
	keys, values, _ := randomGroupIndex(t, r, n, d, first, count, count+1)
	assign := make([]int32, count)
	for i := range assign {
		assign[i] = int32(i)
	}
	idx, err := NewClusterIndex(keys[first*d:(first+count)*d], d, assign, first)
	require.NoError(t, err)
	fixed, err := TacticFixedTokens(first, first+count, n-1)
	require.NoError(t, err)
	qs := [][]float64{make([]float64, d), make([]float64, d), make([]float64, d)}
	for _, q := range qs {
		for j := range q {
			q[j] = r.NormFloat64()
		}
	}
	scale := 1 / math.Sqrt(d)
	for _, opts := range []DoubleP{{1, 0.05}, {1, 0.5}, {1, 1}} {
		outs, tokens, approx, err := DoublePDecodeRef(qs, keys, values, scale, idx, fixed, opts)
		require.NoError(t, err)
		for h, q := range qs {
			want, err := AttendRef(q, keys, values, scale)
			require.NoError(t, err)
			for j := range want {
				require.InDelta(t, want[j], outs[h][j], 1e-12, "P2 %v head %d dim %d", opts.P2, h, j)
			}
			if opts.P2 == 1 {
				assert.Empty(t, approx[h])
			}
		}
		if opts.P2 == 1 {
			assert.Len(t, tokens, n)
		} else {
			assert.Less(t, len(tokens), n, "P2 %v attends every token exactly", opts.P2)
		}
	}
}

// Clusters past the keep cut are dropped: with P1 < 1 the output moves
// away from dense, and the approximated clusters lie between the cuts.
func TestDoublePDecodeRefDrops(t *testing.T) {
	r := rand.New(rand.NewPCG(45, 46))
	const d, n, first = 16, 400, 4
	count := n - first - 20
	keys, values, idx := randomGroupIndex(t, r, n, d, first, count, 37)
	fixed, err := TacticFixedTokens(first, first+count, n-1)
	require.NoError(t, err)
	q := make([]float64, d)
	for j := range q {
		q[j] = r.NormFloat64() * 2
	}
	scale := 1 / math.Sqrt(d)
	opts := DoubleP{P1: 0.6, P2: 0.5}
	_, tokens, approx, err := DoublePDecodeRef([][]float64{q}, keys, values, scale, idx, fixed, opts)
	require.NoError(t, err)
	logits, err := DoublePLogitsRef(q, scale, idx)
	require.NoError(t, err)
	rank := DoublePOrderRanks(logits)
	exact, keep := DoublePCutsRef(logits, rank, idx.Clusters(), opts)
	require.Less(t, keep, idx.Clusters()-1, "P1 0.6 keeps every cluster")
	for _, c := range approx[0] {
		assert.GreaterOrEqual(t, rank[c], exact)
		assert.Less(t, rank[c], keep)
	}
	assert.Len(t, approx[0], keep-exact)
	inExact := 0
	for c := range idx.Sizes {
		if rank[c] < exact {
			inExact += idx.Sizes[c]
		}
	}
	assert.Len(t, tokens, len(fixed)+inExact)
	_, _, _, err = DoublePDecodeRef([][]float64{q}, keys, values, scale, idx, fixed, DoubleP{P1: 0, P2: 0.5})
	assert.Error(t, err)
}
