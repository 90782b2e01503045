package sparse

import (
	"math"
	"math/bits"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// randomProbs returns n probabilities with a spread of magnitudes.
func randomProbs(r *rand.Rand, n int) []float64 {
	p := make([]float64, n)
	z := 0.0
	for i := range p {
		p[i] = math.Exp(3 * r.NormFloat64())
		z += p[i]
	}
	for i := range p {
		p[i] /= z
	}
	return p
}

// randomForced returns a random subset of [0, n), in random order.
func randomForced(r *rand.Rand, n int) []int32 {
	var f []int32
	for _, t := range r.Perm(n) {
		if r.IntN(4) == 0 {
			f = append(f, int32(t))
		}
	}
	return f
}

func massOf(probs []float64, set []int32) float64 {
	s := 0.0
	for _, t := range set {
		s += probs[t]
	}
	return s
}

// TestTokenOracleIsFewestTokens checks the token oracle against brute force
// on fresh small inputs: over every subset containing the forced tokens, the
// fewest tokens whose mass reaches p·Σ probs is the oracle's size, and the
// oracle's own mass reaches it. With nothing forced its size is TopPCount.
func TestTokenOracleIsFewestTokens(t *testing.T) {
	r := baselineRand(t)
	const slack = 1e-12 // brute force sums in another order
	for trial := 0; trial < 300; trial++ {
		n := 1 + r.IntN(13)
		probs := randomProbs(r, n)
		if trial%7 == 0 && n > 2 {
			probs[1] = probs[0] // a tie
		}
		forced := randomForced(r, n)
		p := []float64{1, 0.5, 0.9, 0.05 + 0.95*r.Float64()}[trial%4]
		got, err := TokenOracleRef(probs, forced, p)
		require.NoError(t, err)
		total := 0.0
		for i := range probs {
			total += probs[i]
		}
		require.GreaterOrEqual(t, massOf(probs, got), p*total-slack)
		inF := uint(0)
		for _, f := range forced {
			inF |= 1 << f
		}
		sel := uint(0)
		for i, x := range got {
			sel |= 1 << x
			if i > 0 {
				require.Less(t, got[i-1], x)
			}
		}
		require.Equal(t, inF, sel&inF, "forced tokens kept")
		// Over every subset holding the forced tokens: the fewest tokens
		// reaching the target with a margin (the oracle needs no more) and
		// without it (the oracle needs no fewer). The margin covers the
		// different summation order.
		strict, loose := n, n
		for s := uint(0); s < 1<<n; s++ {
			if s&inF != inF {
				continue
			}
			m := 0.0
			for i := 0; i < n; i++ {
				if s&(1<<i) != 0 {
					m += probs[i]
				}
			}
			if m >= p*total+slack {
				strict = min(strict, bits.OnesCount(s))
			}
			if m >= p*total-slack {
				loose = min(loose, bits.OnesCount(s))
			}
		}
		require.LessOrEqualf(t, len(got), strict, "n=%d p=%v forced %v", n, p, forced)
		require.GreaterOrEqualf(t, len(got), loose, "n=%d p=%v forced %v", n, p, forced)
		if len(forced) == 0 {
			c, err := TopPCount(probs, p)
			require.NoError(t, err)
			if p < 1 {
				require.Equal(t, c, len(got))
			}
		}
	}
}

// TestTokenOracleExactBoundary uses probabilities that are exact in binary,
// so that brute force and the oracle agree exactly.
func TestTokenOracleExactBoundary(t *testing.T) {
	probs := []float64{0.125, 0.25, 0.0625, 0.5, 0.0625}
	for _, c := range []struct {
		p      float64
		forced []int32
		want   []int32
	}{
		{0.5, nil, []int32{3}},
		{0.75, nil, []int32{1, 3}},
		{0.8, nil, []int32{0, 1, 3}},
		{0.875, nil, []int32{0, 1, 3}},
		{0.9, nil, []int32{0, 1, 2, 3}}, // ties: token 2 before 4
		{1, nil, []int32{0, 1, 2, 3, 4}},
		{0.5, []int32{4, 2}, []int32{2, 3, 4}},
		{0.1, []int32{4, 2}, []int32{2, 4}},
		{0.2, []int32{0}, []int32{0, 3}},
	} {
		got, err := TokenOracleRef(probs, c.forced, c.p)
		require.NoError(t, err)
		assert.Equal(t, c.want, got, "p=%v forced %v", c.p, c.forced)
	}
}

// TestClusterOracleIsFewestClusters checks the cluster oracle on fresh small
// inputs: its size is ClusterTopPCount, it is the forced set plus whole
// clusters, its mass reaches the target, and brute force over cluster
// subsets needs no fewer clusters.
func TestClusterOracleIsFewestClusters(t *testing.T) {
	r := baselineRand(t)
	const slack = 1e-12
	for trial := 0; trial < 200; trial++ {
		n := 1 + r.IntN(40)
		probs := randomProbs(r, n)
		forced := randomForced(r, n)
		// Partition some of the tokens into up to 9 clusters (empty ones
		// included); the rest are in no cluster.
		c := 1 + r.IntN(9)
		assign := make([]int32, 0, n)
		for i := 0; i < n; i++ {
			assign = append(assign, int32(r.IntN(c+1))) // c: no cluster
		}
		idx := &ClusterIndex{D: 1, Centroids: make([]float64, c), Sizes: make([]int, c), Members: make([][]int32, c)}
		for i, a := range assign {
			if int(a) < c {
				idx.Members[a] = append(idx.Members[a], int32(i))
				idx.Sizes[a]++
			}
		}
		p := []float64{1, 0.5, 0.9, 0.05 + 0.95*r.Float64()}[trial%4]
		got, err := ClusterOracleRef(probs, idx, forced, p)
		require.NoError(t, err)
		want, err := ClusterTopPCount(probs, idx.Members, forced, p)
		require.NoError(t, err)
		require.Equal(t, want, len(got))
		in := map[int32]bool{}
		for _, x := range got {
			in[x] = true
		}
		for _, f := range forced {
			require.True(t, in[f])
		}
		inF := map[int32]bool{}
		for _, f := range forced {
			inF[f] = true
		}
		var mass []float64
		for ci, mem := range idx.Members {
			k, nonF, m := 0, 0, 0.0
			for _, x := range mem {
				if !inF[x] {
					nonF++
					m += probs[x]
					if in[x] {
						k++
					}
				}
			}
			require.Truef(t, k == 0 || k == nonF, "cluster %d partly taken", ci)
			mass = append(mass, m)
		}
		for i := 0; i < n; i++ {
			if int(assign[i]) == c && !inF[int32(i)] {
				require.False(t, in[int32(i)], "unclustered token %d taken", i)
			}
		}
		total := 0.0
		for _, x := range probs {
			total += x
		}
		base := massOf(probs, forced)
		all := base
		for _, m := range mass {
			all += m
		}
		if all >= p*total-slack {
			require.GreaterOrEqual(t, massOf(probs, got), p*total-slack)
		}
		best := c
		for s := 0; s < 1<<c; s++ {
			m := base
			for ci := 0; ci < c; ci++ {
				if s&(1<<ci) != 0 {
					m += mass[ci]
				}
			}
			if m >= p*total+slack {
				best = min(best, bits.OnesCount(uint(s)))
			}
		}
		// The clusters that add tokens to F: no more than the fewest that
		// reach the target with a margin.
		adding := 0
		for _, mem := range idx.Members {
			for _, x := range mem {
				if !inF[x] && in[x] {
					adding++
					break
				}
			}
		}
		require.LessOrEqual(t, adding, best)
	}
}

func TestOracleDecodeRefs(t *testing.T) {
	r := baselineRand(t)
	const d, sinks, end = 11, 4, 301
	pos := end + 5 + r.IntN(60)
	keys := blobs(r, pos+1, d, 12)
	values := randMatrix(r, pos+1, d)
	idx, err := BuildClusterIndexRef(keys, d, sinks, end-sinks, 16, 10, 7)
	require.NoError(t, err)
	fixed, err := TacticFixedTokens(sinks, end, pos)
	require.NoError(t, err)
	qs := [][]float64{randMatrix(r, 1, d), randMatrix(r, 1, d), randMatrix(r, 1, d)}
	for _, p := range []float64{0.3, 0.9, 1} {
		for name, run := range map[string]func() ([][]float64, []int32, [][]int32, error){
			"token": func() ([][]float64, []int32, [][]int32, error) {
				return TokenOracleDecodeRef(qs, keys, values, 0.3, fixed, p)
			},
			"cluster": func() ([][]float64, []int32, [][]int32, error) {
				return ClusterOracleDecodeRef(qs, keys, values, 0.3, idx, fixed, p)
			},
		} {
			outs, tokens, own, err := run()
			require.NoError(t, err)
			for j, q := range qs {
				probs, err := SoftmaxRef(q, keys, 0.3)
				require.NoError(t, err)
				var want []int32
				if name == "token" {
					want, err = TokenOracleRef(probs, fixed, p)
				} else {
					want, err = ClusterOracleRef(probs, idx, fixed, p)
				}
				require.NoError(t, err)
				require.Equal(t, want, own[j], name)
				f, err := FidelityRef(q, keys, values, 0.3, tokens, idx.Members, fixed, p)
				require.NoError(t, err)
				require.True(t, f.Success(p), "%s p=%v: union mass %v", name, p, f.Mass)
				o, err := AttendSubsetRef(q, keys, values, tokens, 0.3)
				require.NoError(t, err)
				require.Equal(t, o, outs[j])
			}
			require.Equal(t, UnionTokens(own...), tokens)
		}
	}
	probs := []float64{0.5, 0.5}
	bad := &ClusterIndex{D: 1, Centroids: []float64{0}, Sizes: []int{2}, Members: [][]int32{{0, 0}}}
	for name, f := range map[string]func() error{
		"p0":         func() error { _, err := TokenOracleRef(probs, nil, 0); return err },
		"pNaN":       func() error { _, err := ClusterOracleRef(probs, idx, nil, math.NaN()); return err },
		"repeat":     func() error { _, err := TokenOracleRef(probs, []int32{1, 1}, 0.5); return err },
		"range":      func() error { _, err := TokenOracleRef(probs, []int32{2}, 0.5); return err },
		"nilIndex":   func() error { _, err := ClusterOracleRef(probs, nil, nil, 0.5); return err },
		"badIndex":   func() error { _, err := ClusterOracleRef(probs, bad, nil, 0.5); return err },
		"indexRange": func() error { _, err := ClusterOracleRef(probs, idx, nil, 0.5); return err },
		"heads":      func() error { _, _, _, err := TokenOracleDecodeRef(nil, keys, values, 1, fixed, 0.5); return err },
		"values": func() error {
			_, _, _, err := ClusterOracleDecodeRef(qs, keys, values[:d], 1, idx, fixed, 0.5)
			return err
		},
		"fixedRange": func() error {
			_, _, _, err := TokenOracleDecodeRef(qs, keys[:d*10], values[:d*10], 1, fixed, 0.5)
			return err
		},
		"clusterSize": func() error {
			_, _, _, err := ClusterOracleDecodeRef(qs, keys[:d*10], values[:d*10], 1, idx, nil, 0.5)
			return err
		},
	} {
		assert.Error(t, f(), name)
	}
}
