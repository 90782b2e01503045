package sparse

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestAttendRefMatchesDirectSoftmax(t *testing.T) {
	q := []float64{1, -2}
	keys := []float64{1, 0, 0, 1, 2, 1}
	values := []float64{1, 2, 3, 4, 5, 6}
	scale := 0.5
	s := []float64{0.5, -1, 0}
	z := math.Exp(s[0]) + math.Exp(s[1]) + math.Exp(s[2])
	want := []float64{0, 0}
	for i := range s {
		for k := range want {
			want[k] += math.Exp(s[i]) / z * values[2*i+k]
		}
	}
	got, err := AttendRef(q, keys, values, scale)
	require.NoError(t, err)
	assert.InDeltaSlice(t, want, got, 1e-15)

	// A subset equals dense attention over the sub-matrix.
	sub, err := AttendSubsetRef(q, keys, values, []int32{2, 0}, scale)
	require.NoError(t, err)
	dense, err := AttendRef(q, []float64{1, 0, 2, 1}, []float64{1, 2, 5, 6}, scale)
	require.NoError(t, err)
	assert.InDeltaSlice(t, dense, sub, 1e-15)
}

func TestAttendSubsetRefErrors(t *testing.T) {
	q := []float64{1, 0}
	keys := []float64{1, 0, 0, 1}
	for name, f := range map[string]func() error{
		"empty":     func() error { _, err := AttendSubsetRef(q, keys, keys, nil, 1); return err },
		"repeat":    func() error { _, err := AttendSubsetRef(q, keys, keys, []int32{0, 0}, 1); return err },
		"range":     func() error { _, err := AttendSubsetRef(q, keys, keys, []int32{2}, 1); return err },
		"values":    func() error { _, err := AttendSubsetRef(q, keys, keys[:2], []int32{0}, 1); return err },
		"shape":     func() error { _, err := AttendRef(q, keys[:3], keys[:3], 1); return err },
		"zero-dim":  func() error { _, err := AttendRef(nil, keys, keys, 1); return err },
		"no-values": func() error { _, err := AttendSubsetRef(q, keys, nil, []int32{0}, 1); return err },
	} {
		assert.Error(t, f(), name)
	}
}

func TestTopPCount(t *testing.T) {
	probs := []float64{0.1, 0.45, 0.15, 0.3}
	for _, c := range []struct {
		p    float64
		want int
	}{{0.2, 1}, {0.45, 1}, {0.5, 2}, {0.75, 2}, {0.8, 3}, {0.95, 4}, {1, 4}} {
		got, err := TopPCount(probs, c.p)
		require.NoError(t, err)
		assert.Equal(t, c.want, got, "P=%v", c.p)
	}
	_, err := TopPCount(probs, 0)
	assert.Error(t, err)
	_, err = TopPCount(probs, 1.5)
	assert.Error(t, err)
}

func TestClusterTopPCount(t *testing.T) {
	// Tokens 0..5; clusters {0,1} mass 0.3, {2,3,4} mass 0.35, {5} mass 0.2,
	// token 6 (0.15) is forced and in no cluster.
	probs := []float64{0.1, 0.2, 0.05, 0.05, 0.25, 0.2, 0.15}
	clusters := [][]int32{{0, 1}, {2, 3, 4}, {5}}
	for _, c := range []struct {
		p      float64
		forced []int32
		want   int
	}{
		{0.3, nil, 3},           // {2,3,4} alone: 0.35
		{0.6, nil, 5},           // + {0,1}: 0.65
		{0.7, nil, 6},           // + {5}: 0.85
		{0.1, []int32{6}, 1},    // forced token alone: 0.15
		{0.5, []int32{6}, 4},    // 0.15 + 0.35
		{0.55, []int32{6}, 6},   // + {0,1}: 0.8
		{0.95, []int32{6}, 7},   // everything: 1.0
		{0.95, []int32{4}, 6},   // token 6 unreachable: F and all clusters (1+5)
		{0.4, []int32{4}, 3},    // 0.25 + {0,1} 0.3 = 0.55: 1 + 2 tokens
		{0.3, []int32{4, 6}, 2}, // forced alone: 0.4
	} {
		got, err := ClusterTopPCount(probs, clusters, c.forced, c.p)
		require.NoError(t, err)
		assert.Equal(t, c.want, got, "P=%v forced=%v", c.p, c.forced)
	}
	_, err := ClusterTopPCount(probs, [][]int32{{0}, {0}}, nil, 0.5)
	assert.Error(t, err)
	_, err = ClusterTopPCount(probs, [][]int32{{7}}, nil, 0.5)
	assert.Error(t, err)
	_, err = ClusterTopPCount(probs, clusters, []int32{1, 1}, 0.5)
	assert.Error(t, err)
}

func TestSubsetMassAndRelativeError(t *testing.T) {
	m, err := SubsetMass([]float64{0.5, 0.25, 0.25}, []int32{2, 0})
	require.NoError(t, err)
	assert.Equal(t, 0.75, m)
	_, err = SubsetMass([]float64{0.5}, []int32{1})
	assert.Error(t, err)

	e, err := RelativeError([]float64{3, 4}, []float64{0, 8})
	require.NoError(t, err)
	assert.InDelta(t, 5.0/8, e, 1e-15)
	e, err = RelativeError([]float64{0}, []float64{0})
	require.NoError(t, err)
	assert.Equal(t, 0.0, e)
	e, err = RelativeError([]float64{1}, []float64{0})
	require.NoError(t, err)
	assert.True(t, math.IsInf(e, 1))
	_, err = RelativeError([]float64{1}, []float64{1, 2})
	assert.Error(t, err)
}

// TestSubsetAttentionErrorBound checks ‖o − ô‖ ≤ 2(1 − p(I))·max_i ‖v_i‖ for
// attention ô restricted to I, on random data and random subsets.
func TestSubsetAttentionErrorBound(t *testing.T) {
	r := rand.New(rand.NewPCG(11, 12))
	for trial := 0; trial < 300; trial++ {
		n, d := 1+r.IntN(200), 1+r.IntN(16)
		q := randMatrix(r, 1, d)
		sharp := 0.2 + 3*r.Float64()
		keys := randMatrix(r, n, d)
		values := randMatrix(r, n, d)
		var tokens []int32
		keep := r.Float64()
		for i := 0; i < n; i++ {
			if r.Float64() < keep {
				tokens = append(tokens, int32(i))
			}
		}
		if len(tokens) == 0 {
			tokens = []int32{int32(r.IntN(n))}
		}
		dense, err := AttendRef(q, keys, values, sharp)
		require.NoError(t, err)
		sub, err := AttendSubsetRef(q, keys, values, tokens, sharp)
		require.NoError(t, err)
		probs, err := SoftmaxRef(q, keys, sharp)
		require.NoError(t, err)
		mass, err := SubsetMass(probs, tokens)
		require.NoError(t, err)
		vmax := 0.0
		for i := 0; i < n; i++ {
			vmax = math.Max(vmax, math.Sqrt(dot(values[i*d:(i+1)*d], values[i*d:(i+1)*d])))
		}
		diff := 0.0
		for k := range dense {
			diff += (dense[k] - sub[k]) * (dense[k] - sub[k])
		}
		require.LessOrEqualf(t, math.Sqrt(diff), 2*(1-mass)*vmax+1e-12, "trial %d: n=%d |I|=%d p(I)=%v", trial, n, len(tokens), mass)
	}
}

func TestFidelityRef(t *testing.T) {
	// Two tokens with scores ln 3 and 0: probabilities 3/4 and 1/4.
	q := []float64{1}
	keys := []float64{math.Log(3), 0}
	values := []float64{1, 5}
	f, err := FidelityRef(q, keys, values, 1, []int32{0}, [][]int32{{0}, {1}}, nil, 0.7)
	require.NoError(t, err)
	assert.InDelta(t, 0.75, f.Mass, 1e-15)
	assert.True(t, f.Success(0.7))
	assert.False(t, f.Success(0.8))
	assert.Equal(t, 1, f.Selected)
	assert.Equal(t, 1, f.GlobalOptimal)
	assert.Equal(t, 1, f.ClusterOptimal)
	// o = 0.75·1 + 0.25·5 = 2, ô = 1.
	assert.InDelta(t, 1, f.Err, 1e-15)
	assert.InDelta(t, 0.5, f.RelErr, 1e-15)

	f, err = FidelityRef(q, keys, values, 1, []int32{0, 1}, [][]int32{{0, 1}}, nil, 0.9)
	require.NoError(t, err)
	assert.InDelta(t, 1, f.Mass, 1e-15)
	assert.Equal(t, 2, f.GlobalOptimal)
	assert.Equal(t, 2, f.ClusterOptimal)
	assert.InDelta(t, 0, f.RelErr, 1e-15)
}
