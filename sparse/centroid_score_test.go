package sparse

import (
	"errors"
	"fmt"
	"math"
	"math/rand"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/vk/vktest"
)

// randomCentroids returns c rows of d values shaped like the means of
// attention keys: channels of scales spread over two orders of magnitude,
// a few outlier channels an order of magnitude larger still, with an
// offset, some rows shrunk towards zero (clusters of spread keys), one row
// all zero where c > 2 (its scale is 0) and one channel all zero where
// d > 8 (its dimension scale is 0).
func randomCentroids(rng *rand.Rand, c, d int) []float32 {
	outliers := []int{rng.Intn(d), rng.Intn(d)}
	spread := make([]float64, d)
	for i := range spread {
		spread[i] = math.Pow(10, 2*rng.Float64()-1.5)
	}
	x := make([]float32, c*d)
	for r := 0; r < c; r++ {
		shrink := 1.0
		if rng.Intn(4) == 0 {
			shrink = 0.05 + 0.2*rng.Float64()
		}
		for i := 0; i < d; i++ {
			v := spread[i] * rng.NormFloat64()
			if i == outliers[0] || i == outliers[1] {
				v = 12 + 3*rng.NormFloat64()
			}
			x[r*d+i] = float32(v * shrink)
		}
	}
	if c > 2 {
		clear(x[d : 2*d])
	}
	if d > 8 {
		zero := (outliers[0] + 1 + rng.Intn(d-1)) % d
		for r := 0; r < c; r++ {
			x[r*d+zero] = 0
		}
	}
	return x
}

// quantizeHeads quantizes the rows of d values of each of heads heads of
// x against the head's own dimension scales, as Clusters.Quantize does:
// the codes, row scales and dimension scales of every head, one after
// another.
func quantizeHeads(t testing.TB, x []float32, heads, d int) (codes []int8, r, m []float32) {
	t.Helper()
	per := len(x) / heads
	for g := 0; g < heads; g++ {
		rows := x[g*per : (g+1)*per]
		mg, err := kvcache.DimScales(rows, d)
		require.NoError(t, err)
		kg, rg, err := kvcache.QuantizeRows(rows, d, mg)
		require.NoError(t, err)
		codes, r, m = append(codes, kg...), append(r, rg...), append(m, mg...)
	}
	return codes, r, m
}

// TestQueryBytesRef checks the two bytes of fresh random queries with an
// outlier: every value within s/512 of the original (s/256 where the clamp
// binds), on the grid s/256, the largest one exact, and zeros kept.
func TestQueryBytesRef(t *testing.T) {
	rng := rand.New(rand.NewSource(rand.Int63()))
	for _, n := range []int{1, 7, 128} {
		x := make([]float64, n)
		for i := range x {
			x[i] = 0.3 * rng.NormFloat64()
		}
		x[rng.Intn(n)] = -25 * (1 + rng.Float64())
		mx := 0.0
		for _, v := range x {
			mx = math.Max(mx, math.Abs(v))
		}
		s := mx / 127
		got := QueryBytesRef(x)
		require.Len(t, got, n)
		for i, v := range got {
			require.LessOrEqual(t, math.Abs(v-x[i]), s/256*(1+1e-9), "value %d: %v for %v", i, v, x[i])
			steps := v / (s / 256)
			require.InDelta(t, math.Round(steps), steps, 1e-6, "value %d off the grid", i)
			if math.Abs(x[i]) == mx {
				require.InDelta(t, x[i], v, 1e-12*mx, "the largest value")
			}
		}
		// Most values lie within s/512: the clamp binds only within s/512
		// of a rounding midpoint of the first byte.
		within := 0
		for i, v := range got {
			if math.Abs(v-x[i]) <= s/512*(1+1e-9) {
				within++
			}
		}
		require.GreaterOrEqual(t, within, n*9/10)
	}
	require.Equal(t, []float64{0, 0}, QueryBytesRef([]float64{0, 0}))
}

// TestCentroidScoresRefOfQuantizedCentroids checks the two references
// against each other: scores over the 8-bit codes equal float64 products
// with QuantizedCentroidsRef's centroids, and those lie within half a
// step (row scale × dimension scale) of the float32 centroids.
func TestCentroidScoresRefOfQuantizedCentroids(t *testing.T) {
	rng := rand.New(rand.NewSource(rand.Int63()))
	const c, d = 37, 24
	f := randomCentroids(rng, c, d)
	x := make([]float64, len(f))
	for i, v := range f {
		x[i] = float64(v)
	}
	deq, err := QuantizedCentroidsRef(x, d)
	require.NoError(t, err)
	codes, r, m := quantizeHeads(t, f, 1, d)
	for i := range x {
		require.LessOrEqual(t, math.Abs(deq[i]-x[i]), float64(r[i/d])*float64(m[i%d])/2*(1+1e-6), "value %d", i)
	}
	q := make([]float64, d)
	for i := range q {
		q[i] = rng.NormFloat64()
	}
	sizes := make([]int, c)
	got, err := CentroidScoresRef([][]float64{q}, 0.3, codes, r, m, sizes, d, false)
	require.NoError(t, err)
	for j := 0; j < c; j++ {
		want := 0.3 * dot(q, deq[j*d:(j+1)*d])
		require.InDelta(t, want, got[0][j], 1e-12*(1+math.Abs(want)), "cluster %d", j)
	}
	_, err = CentroidScoresRef([][]float64{q}, 0.3, codes[1:], r, m, sizes, d, false)
	require.Error(t, err)
	_, err = CentroidScoresRef([][]float64{q}, 0.3, codes, r, m[1:], sizes, d, false)
	require.Error(t, err)
	_, err = QuantizedCentroidsRef([]float64{1, math.NaN()}, 2)
	require.Error(t, err)
}

// TestCentroidScoreKernel runs centroid_score on fresh random 8-bit
// centroids (each KV head's own dimension scales) and queries of
// realistic scales, for odd and edge counts of
// clusters, several head shapes, both kinds of score (Tactic's, and
// Double-P's with ln s_c and −∞ for empty clusters), one and several
// groups of centroids per workgroup, subgroup shuffles and shared memory,
// float products (centroid_score) and integer dot products of the query's
// two bytes (centroid_score_dot, where the device has them); the scores,
// poisoned with NaN first, must match CentroidScoresRef (CentroidScoresDotRef)
// and the folded extremes the best and worst finite scores.
func TestCentroidScoreKernel(t *testing.T) {
	dev := vktest.Open(t)
	rng := rand.New(rand.NewSource(rand.Int63()))
	type shape struct {
		h    Heads
		c    int
		tree bool
		wgs  int // scoreWorkgroups (0: the default)
	}
	shapes := []shape{
		{Heads{Query: 8, KV: 2, Dim: 64}, 1, false, 0},
		{Heads{Query: 8, KV: 2, Dim: 64}, 2, false, 0},
		{Heads{Query: 32, KV: 8, Dim: 128}, 1023, false, 0},
		{Heads{Query: 32, KV: 8, Dim: 128}, 777, true, 3},
		{Heads{Query: 6, KV: 1, Dim: 8}, 301, false, 1},
		{Heads{Query: 12, KV: 1, Dim: 136}, 65, false, 0},
		{Heads{Query: 4, KV: 4, Dim: 256}, 129, true, 0},
		{Heads{Query: 2, KV: 2, Dim: 40}, 5000, false, 7},
	}
	for _, s := range shapes {
		for _, logSize := range []bool{false, true} {
			for _, dot := range []bool{false, true} {
				name := fmt.Sprintf("%+v C %d tree %v workgroups %d log %v dot %v", s.h, s.c, s.tree, s.wgs, logSize, dot)
				t.Run(name, func(t *testing.T) {
					if dot && !dev.Info().IntegerDot {
						t.Skipf("%s has no integer dot products (VK_KHR_shader_integer_dot_product)", dev.Info().Name)
					}
					testCentroidScore(t, dev, rng, s.h, s.c, s.tree, s.wgs, logSize, dot)
				})
			}
		}
	}
}

func testCentroidScore(t *testing.T, dev *vk.Device, rng *rand.Rand, h Heads, c int, tree bool, wgs int, logSize, dot bool) {
	scores := ScoresFloat
	if dot {
		scores = ScoresIntegerDot
	}
	dense, err := NewDenseWith(dev, h, DenseOptions{TreeReduce: tree, Scores: scores})
	if err != nil {
		t.Skipf("heads %+v: %v", h, err)
	}
	defer dense.Release()
	var bufs []*vk.Buffer
	defer func() { require.NoError(t, releaseAll(bufs...)) }()
	b := &builder{dev: dev, bufs: &bufs, cache: &dense.kernels}
	scorer := centroidScores(b, dense, logSize)
	d := h.Dim
	codes, r, m := quantizeHeads(t, randomCentroids(rng, h.KV*c, d), h.KV, d)
	sizes := make([]uint32, h.KV*c)
	for i := range sizes {
		sizes[i] = uint32(rng.Intn(40))
		if i%5 == 3 {
			sizes[i] = 0
		}
	}
	q := make([]float32, h.Query*d)
	for i := range q {
		q[i] = float32(1.5 * rng.NormFloat64())
	}
	codeBuf, scaleBuf, dimBuf := b.words(len(codes)/4), b.words(len(r)), b.words(len(m))
	queries, logits, counts, extremes := b.words(len(q)), b.words(h.Query*c), b.words(len(sizes)), b.words(2*h.Query)
	require.NoError(t, b.err)
	require.NoError(t, errors.Join(codeBuf.WriteUint32(0, kvcache.PackCodes(codes)), scaleBuf.WriteFloat32(0, r), dimBuf.WriteFloat32(0, m), queries.WriteFloat32(0, q), counts.WriteUint32(0, sizes)))
	nan := math.Float32bits(float32(math.NaN()))
	require.NoError(t, dev.Run(func(cmd *vk.Commands) {
		cmd.Fill(logits.All(), nan)
		cmd.Fill(extremes.All(), 0)
	}))
	bind, err := scorer.pipe.Bind(queries.All(), codeBuf.All(), logits.All(), counts.All(), extremes.All(), scaleBuf.All(), dimBuf.All())
	require.NoError(t, err)
	defer bind.Release()
	require.NoError(t, dev.Run(func(cmd *vk.Commands) { scorer.record(cmd, bind, c, 1, wgs) }))
	got := make([]float32, h.Query*c)
	require.NoError(t, logits.ReadFloat32(0, got))
	ext := make([]uint32, 2*h.Query)
	require.NoError(t, extremes.ReadUint32(0, ext))

	scale := h.Scale()
	var bad []string
	for g := 0; g < h.KV; g++ {
		qs := make([][]float64, h.Group())
		for j := range qs {
			for _, x := range q[(g*h.Group()+j)*d : (g*h.Group()+j+1)*d] {
				qs[j] = append(qs[j], float64(x))
			}
		}
		sz := make([]int, c)
		for i := range sz {
			sz[i] = int(sizes[g*c+i])
		}
		ref := CentroidScoresRef
		if dot {
			ref = CentroidScoresDotRef
		}
		want, err := ref(qs, scale, codes[g*c*d:(g+1)*c*d], r[g*c:(g+1)*c], m[g*d:(g+1)*d], sz, d, logSize)
		require.NoError(t, err)
		for j := range qs {
			hh := g*h.Group() + j
			// With bytes, the kernel's float32 division may round a few of
			// the query's values to the neighbouring byte: 4 of them, each
			// s/256 off (s the head's step) against codes of up to 127, are
			// allowed.
			flips := 0.0
			if dot {
				mx := 0.0
				for i := 0; i < d; i++ {
					mx = math.Max(mx, math.Abs(scale*qs[j][i]*float64(m[g*d+i])))
				}
				flips = 4 * mx / 127 / 256 * 127
			}
			best, worst := math.Inf(-1), math.Inf(1)
			for cl := 0; cl < c; cl++ {
				// The float32 sum's error is within a few ulps of the sum of
				// the terms' magnitudes.
				mag := 0.0
				for i := 0; i < d; i++ {
					mag += math.Abs(scale * qs[j][i] * float64(m[g*d+i]) * float64(codes[(g*c+cl)*d+i]))
				}
				mag *= float64(r[g*c+cl])
				w, x := want[j][cl], float64(got[hh*c+cl])
				ok := w == x || math.Abs(w-x) <= 1e-5*mag+1e-6*math.Abs(w)+flips*float64(r[g*c+cl])
				if !ok && len(bad) < 8 {
					bad = append(bad, fmt.Sprintf("head %d cluster %d: got %v, want %v", hh, cl, x, w))
				}
				if !math.IsInf(x, 0) && !math.IsNaN(x) {
					best, worst = math.Max(best, x), math.Min(worst, x)
				}
			}
			if !math.IsInf(best, -1) {
				require.Equal(t, best, float64(unkeyScore(ext[2*hh])), "head %d: best score", hh)
				require.Equal(t, worst, float64(unkeyScore(^ext[2*hh+1])), "head %d: worst score", hh)
			}
		}
	}
	require.Empty(t, bad, "first mismatches")
}

// scoreTolerance returns how far a step's centroid score of query qh
// (scale folded in by the kernel) against a float64 centroid c of KV head
// centroids (rows of len(qh)) may lie from s = scale·qh·c: float32
// rounding, and with integer dot products (dot) the query's two bytes,
// each value within s/256 of its own (s the head's step, QueryBytesRef),
// against codes c_i/m_i (m_i the head's dimension scale, here the largest
// |c_i| of the head's rows, within a rounding of the one that coded them),
// taken twice for those roundings.
func scoreTolerance(qh []float64, scale float64, centroids []float64, dot bool) func(c []float64, s float64) float64 {
	d := len(qh)
	m := make([]float64, d)
	mx := 0.0
	if dot {
		for j := 0; j < len(centroids); j++ {
			m[j%d] = math.Max(m[j%d], math.Abs(centroids[j]))
		}
		for i, x := range qh {
			mx = math.Max(mx, math.Abs(scale*x*m[i]))
		}
	}
	return func(c []float64, s float64) float64 {
		tol := 1e-4 * (1 + math.Abs(s))
		if !dot {
			return tol
		}
		codes := 0.0
		for i := range qh {
			if m[i] > 0 {
				codes += math.Abs(c[i]) / m[i]
			}
		}
		return tol + 2*mx/127/256*codes
	}
}

// unkeyScore inverts centroid_score's order-preserving key.
func unkeyScore(k uint32) float32 {
	if k&0x80000000 != 0 {
		return math.Float32frombits(k & 0x7fffffff)
	}
	return math.Float32frombits(^k)
}
