package sparse

import (
	"fmt"
	"math"
	"math/rand"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/vk/vktest"
)

// randomLayer fills a cache with n tokens: keys ~ N(0, kScale²), values ~ N(0, 1),
// rounded to fp16; it returns the decoded values the GPU sees.
func randomLayer(t testing.TB, dev *vk.Device, rng *rand.Rand, h Heads, n, capacity int, kScale float64) (*kvcache.Layer, []float64, []float64) {
	t.Helper()
	kf := make([]float32, h.KV*n*h.Dim)
	vf := make([]float32, len(kf))
	for i := range kf {
		kf[i] = float32(rng.NormFloat64() * kScale)
		vf[i] = float32(rng.NormFloat64())
	}
	kh, err := kvcache.ToHalves(kf)
	require.NoError(t, err)
	vh, err := kvcache.ToHalves(vf)
	require.NoError(t, err)
	layer, err := kvcache.NewLayer(dev, h.KV, h.Dim, capacity)
	require.NoError(t, err)
	t.Cleanup(func() { layer.Release() })
	require.NoError(t, layer.Prefill(kh, vh, n))
	return layer, HalvesToFloat64(kh), HalvesToFloat64(vh)
}

func randomQueries(rng *rand.Rand, n int, scale float64) []float32 {
	q := make([]float32, n)
	for i := range q {
		q[i] = float32(rng.NormFloat64() * scale)
	}
	return q
}

// requireClose compares per query head: ‖got − want‖ / ‖want‖ < tol, and
// reports the first mismatching elements.
// listsRef returns AttendSubsetRef of every query head (q, [Hq][D]) over
// its KV head's list, keys and values k, v being [KV][n][D].
func listsRef(t *testing.T, h Heads, q []float32, k, v []float64, n int, lists [][]int32) []float64 {
	t.Helper()
	d := h.Dim
	var want []float64
	for hh := 0; hh < h.Query; hh++ {
		g := hh / h.Group()
		qh := make([]float64, d)
		for i := range qh {
			qh[i] = float64(q[hh*d+i])
		}
		o, err := AttendSubsetRef(qh, k[g*n*d:(g+1)*n*d], v[g*n*d:(g+1)*n*d], lists[g], 1/math.Sqrt(float64(d)))
		require.NoError(t, err)
		want = append(want, o...)
	}
	return want
}

func requireClose(t *testing.T, want []float64, got []float32, dim int, tol float64, what string) {
	t.Helper()
	if err := CompareHeads(want, got, dim, tol); err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

func TestDenseMatchesReference(t *testing.T) {
	dev := vktest.Open(t)
	rng := rand.New(rand.NewSource(rand.Int63()))
	cases := []struct {
		heads Heads
		n     int
		qStd  float64 // query scale: large values give logits far beyond exp's float32 range
		chunk int
		more  []DenseOptions // variants beside the common ones
	}{
		{Heads{4, 4, 64}, 1, 1, 0, nil},
		{Heads{8, 2, 64}, 1000, 1, 0, nil},
		{Heads{8, 1, 128}, 777, 3, 64, nil},
		{Heads{16, 2, 128}, 4099, 1, 0, []DenseOptions{{Group: 8}}},
		{Heads{4, 1, 128}, 3001, 40, 0, nil}, // logits in the hundreds
		{Heads{3, 3, 72}, 513, 1, 100, nil},
		{Heads{2, 1, 256}, 300, 1, 0, nil},
		{Heads{12, 1, 8}, 257, 2, 0, nil},
		{Heads{32, 2, 16}, 90, 1, 0, []DenseOptions{{Group: 8}}}, // 16 query heads per KV head: four blocks of 4, or two of 8
		{Heads{8, 2, 64}, 5000, 2, 2000, nil},                    // chunks of several tiles
		{Heads{4, 1, 128}, 3001, 40, 3001, nil},                  // one chunk of many tiles, huge logits
		// Head blocks of 8 × 34 vec4 of output: the merge takes them in
		// two passes of 256 threads, or five of 64, the last ones partial.
		{Heads{8, 1, 136}, 1500, 1, 64, []DenseOptions{{Group: 8}, {Group: 8, Workgroup: 64}}},
		// Workgroups of 2 or 1 of a group's 4 query heads.
		{Heads{8, 2, 64}, 1500, 1, 0, []DenseOptions{{Group: 2}, {Group: 1, Tile: 256}}},
	}
	for _, c := range cases {
		// Both variants: one thread per row with tree reductions, and rows
		// shared by threads that sum with subgroup operations (where the
		// device has them).
		variants := append([]DenseOptions{{}, {ThreadsPerRow: 1, TreeReduce: true}, {Tile: 64}, {ThreadsPerRow: 1, RowsPerThread: 3, Tile: 100}}, c.more...)
		info := dev.Info()
		if tpr := threadsPerRow(info, c.heads.Dim); tpr > 1 || info.SubgroupArithmetic {
			variants = append(variants, DenseOptions{ThreadsPerRow: tpr})
		}
		if (c.heads.Dim/8)%4 == 0 && info.SubgroupShuffle && info.SubgroupSize%4 == 0 {
			variants = append(variants, DenseOptions{ThreadsPerRow: 4}, DenseOptions{ThreadsPerRow: 4, RowsPerThread: 2})
		}
		for _, opts := range variants {
			t.Run(fmt.Sprintf("Hq%d_Hkv%d_D%d_N%d_%+v", c.heads.Query, c.heads.KV, c.heads.Dim, c.n, opts), func(t *testing.T) {
				dense, err := NewDenseWith(dev, c.heads, opts)
				require.NoError(t, err)
				defer dense.Release()
				dense.ChunkTokens = c.chunk
				layer, k, v := randomLayer(t, dev, rng, c.heads, c.n, c.n+rng.Intn(50), 1)
				plan, err := dense.Plan([]*kvcache.Layer{layer})
				require.NoError(t, err)
				defer plan.Release()
				q := randomQueries(rng, c.heads.Query*c.heads.Dim, c.qStd)
				require.NoError(t, dev.Run(func(cmd *vk.Commands) { cmd.Fill(plan.Output().All(), math.Float32bits(float32(math.NaN()))) }))
				got, err := plan.Attend(q)
				require.NoError(t, err)
				requireDense(t, c.heads, q, k, v, c.n, got, "dense")
			})
		}
	}
}

func TestDenseBatchOfDifferentLengths(t *testing.T) {
	dev := vktest.Open(t)
	rng := rand.New(rand.NewSource(rand.Int63()))
	h := Heads{8, 2, 64}
	dense, err := NewDense(dev, h)
	require.NoError(t, err)
	defer dense.Release()
	lengths := []int{1, 2000, 333, 64}
	var layers []*kvcache.Layer
	var ks, vs [][]float64
	for _, n := range lengths {
		l, k, v := randomLayer(t, dev, rng, h, n, 2048, 1)
		layers, ks, vs = append(layers, l), append(ks, k), append(vs, v)
	}
	plan, err := dense.Plan(layers)
	require.NoError(t, err)
	defer plan.Release()
	q := randomQueries(rng, len(lengths)*h.Query*h.Dim, 1.5)
	got, err := plan.Attend(q)
	require.NoError(t, err)
	per := h.Query * h.Dim
	for b, n := range lengths {
		requireDense(t, h, q[b*per:(b+1)*per], ks[b], vs[b], n, got[b*per:(b+1)*per], fmt.Sprintf("sequence %d", b))
	}
}

// TestDenseLongSequence covers N ≥ 131072 on one KV head.
func TestDenseLongSequence(t *testing.T) {
	if testing.Short() {
		t.Skip("long sequence skipped in -short mode")
	}
	dev := vktest.Open(t)
	rng := rand.New(rand.NewSource(rand.Int63()))
	h := Heads{4, 1, 64}
	const n = 131072 + 17
	dense, err := NewDense(dev, h)
	require.NoError(t, err)
	defer dense.Release()
	layer, k, v := randomLayer(t, dev, rng, h, n, n, 1)
	plan, err := dense.Plan([]*kvcache.Layer{layer})
	require.NoError(t, err)
	defer plan.Release()
	q := randomQueries(rng, h.Query*h.Dim, 2)
	got, err := plan.Attend(q)
	require.NoError(t, err)
	requireDense(t, h, q, k, v, n, got, "long")
}

// requireDense checks got against DenseRef of q over the first n tokens of
// keys and values (relative error below 1e-3 per head).
func requireDense(t *testing.T, h Heads, q []float32, keys, values []float64, n int, got []float32, what string) {
	t.Helper()
	want, err := DenseRef(h, q, keys, values, n, 1/math.Sqrt(float64(h.Dim)))
	require.NoError(t, err)
	requireClose(t, want, got, h.Dim, 1e-3, what)
}

func TestDenseRejectsBadInput(t *testing.T) {
	dev := vktest.Open(t)
	_, err := NewDense(dev, Heads{8, 3, 64})
	require.ErrorContains(t, err, "multiple")
	_, err = NewDense(dev, Heads{8, 2, 60})
	require.ErrorContains(t, err, "dimension")
	_, err = NewDense(dev, Heads{8, 2, 264})
	require.ErrorContains(t, err, "dimension")
	for _, g := range []int{3, 8, -1} {
		_, err = NewDenseWith(dev, Heads{8, 2, 64}, DenseOptions{Group: g})
		require.ErrorIs(t, err, vk.ErrUnsupported, "%d query heads per workgroup of groups of 4", g)
	}
	_, err = NewDenseWith(dev, Heads{8, 2, 64}, DenseOptions{Scores: ScoresIntegerDot + 1})
	require.ErrorContains(t, err, "ScoreKernel")
	for _, s := range []ScoreKernel{ScoresAuto, ScoresFloat, ScoresIntegerDot} {
		d, err := NewDenseWith(dev, Heads{8, 2, 64}, DenseOptions{Scores: s})
		if s == ScoresIntegerDot && !dev.Info().IntegerDot {
			require.ErrorIs(t, err, vk.ErrUnsupported, "integer dot products on a device without them")
			continue
		}
		require.NoError(t, err)
		want := map[ScoreKernel]bool{ScoresAuto: dev.Info().IntegerDotFast, ScoresFloat: false, ScoresIntegerDot: true}[s]
		require.Equal(t, want, d.dotScores, "scores %d", s)
		require.NoError(t, d.Release())
	}

	h := Heads{4, 2, 64}
	dense, err := NewDense(dev, h)
	require.NoError(t, err)
	defer dense.Release()
	_, err = dense.Plan(nil)
	require.Error(t, err)
	other, err := kvcache.NewLayer(dev, 1, 64, 16)
	require.NoError(t, err)
	defer other.Release()
	_, err = dense.Plan([]*kvcache.Layer{other})
	require.ErrorContains(t, err, "KV heads")

	empty, err := kvcache.NewLayer(dev, 2, 64, 16)
	require.NoError(t, err)
	defer empty.Release()
	plan, err := dense.Plan([]*kvcache.Layer{empty})
	require.NoError(t, err)
	defer plan.Release()
	q := make([]float32, h.Query*h.Dim)
	for i := range q {
		q[i] = 0.5
	}
	_, err = plan.Attend(q)
	require.ErrorContains(t, err, "empty", "N = 0 must be refused")
	_, err = plan.Attend(q[:10])
	require.ErrorContains(t, err, "query has")
	q[7] = float32(math.NaN())
	_, err = plan.Attend(q)
	require.ErrorContains(t, err, "NaN")
	q[7] = float32(math.Inf(1))
	_, err = plan.Attend(q)
	require.ErrorContains(t, err, "Inf")
}

// requireRepeats runs plan on each query of qs ([batch][Hq][D]) twice
// over: back to back in one submission (the commands upload each query,
// poison the output before each run and copy it out after) and in a
// submission each (Attend), and checks every output against want(q) and
// that the arrival counters are back at 0 after both. A counter left
// standing would keep the merge from running, or run it early, in a later
// run.
func requireRepeats(t *testing.T, dev *vk.Device, plan *DensePlan, qs [][]float32, want func(q []float32) []float64) {
	t.Helper()
	dim := plan.d.heads.Dim
	nan := math.Float32bits(float32(math.NaN()))
	requireArrivalsZero := func(when string) {
		t.Helper()
		counts := make([]uint32, plan.arrivals.Size()/4)
		require.NoError(t, plan.arrivals.ReadUint32(0, counts))
		require.Equal(t, make([]uint32, len(counts)), counts, "arrival counters %s", when)
	}

	size := plan.Output().Size()
	results, err := dev.NewBuffer(size*uint64(len(qs)), vk.DeviceLocal)
	require.NoError(t, err)
	defer results.Release()
	var recordErr error
	require.NoError(t, dev.Run(func(c *vk.Commands) {
		for i, q := range qs {
			words := make([]uint32, len(q))
			for j, x := range q {
				words[j] = math.Float32bits(x)
			}
			c.Barrier() // the previous run's copy and kernels are done
			c.Update(plan.query.All(), words)
			c.Fill(plan.Output().All(), nan)
			c.Barrier()
			if err := plan.Record(c); err != nil && recordErr == nil {
				recordErr = err
			}
			c.Barrier()
			c.Copy(plan.Output().All(), results.Slice(uint64(i)*size, size))
		}
	}))
	require.NoError(t, recordErr)
	for i, q := range qs {
		got := make([]float32, size/4)
		require.NoError(t, results.ReadFloat32(uint64(i)*size, got))
		requireClose(t, want(q), got, dim, 1e-3, fmt.Sprintf("run %d of one submission", i))
	}
	requireArrivalsZero("after one submission of several runs")

	for i, q := range qs {
		require.NoError(t, dev.Run(func(c *vk.Commands) { c.Fill(plan.Output().All(), nan) }))
		got, err := plan.Attend(q)
		require.NoError(t, err)
		requireClose(t, want(q), got, dim, 1e-3, fmt.Sprintf("submission %d", i))
		requireArrivalsZero(fmt.Sprintf("after submission %d", i))
	}
}

// TestDensePlanRepeats runs a batch plan, a token-list plan and a cluster
// plan several times with different queries, in one submission and in
// several (requireRepeats), so that the arrival counters must be back at 0
// after every run.
func TestDensePlanRepeats(t *testing.T) {
	dev := vktest.Open(t)
	rng := rand.New(rand.NewSource(rand.Int63()))
	queries := func(n int) [][]float32 {
		var qs [][]float32
		for i := 0; i < 3; i++ {
			qs = append(qs, randomQueries(rng, n, 1.5))
		}
		return qs
	}

	t.Run("batch", func(t *testing.T) {
		// Four head blocks of 4 query heads per KV head; chunks of 64
		// tokens, so that the longest sequence takes 33 of them.
		h := Heads{32, 2, 16}
		dense, err := NewDense(dev, h)
		require.NoError(t, err)
		defer dense.Release()
		dense.ChunkTokens = 64
		lengths := []int{1, 700, 2100}
		var layers []*kvcache.Layer
		var ks, vs [][]float64
		for _, n := range lengths {
			l, k, v := randomLayer(t, dev, rng, h, n, 2200, 1)
			layers, ks, vs = append(layers, l), append(ks, k), append(vs, v)
		}
		plan, err := dense.Plan(layers)
		require.NoError(t, err)
		defer plan.Release()
		per := h.Query * h.Dim
		requireRepeats(t, dev, plan, queries(len(lengths)*per), func(q []float32) []float64 {
			var want []float64
			for b, n := range lengths {
				w, err := DenseRef(h, q[b*per:(b+1)*per], ks[b], vs[b], n, 1/math.Sqrt(float64(h.Dim)))
				require.NoError(t, err)
				want = append(want, w...)
			}
			return want
		})
	})

	t.Run("token lists", func(t *testing.T) {
		// KV head 1's short list leaves most of its chunks past its end:
		// they exit without arriving.
		h := Heads{8, 2, 64}
		const n = 3000
		dense, err := NewDense(dev, h)
		require.NoError(t, err)
		defer dense.Release()
		dense.gatherMin = 64
		layer, k, v := randomLayer(t, dev, rng, h, n, n, 1)
		plan, err := dense.PlanGather(layer, n)
		require.NoError(t, err)
		defer plan.Release()
		lists := make([][]int32, h.KV)
		for g, size := range []int{2999, 40} {
			for _, tok := range rng.Perm(n)[:size] {
				lists[g] = append(lists[g], int32(tok))
			}
		}
		require.NoError(t, plan.SetTokens(lists))
		requireRepeats(t, dev, plan, queries(h.Query*h.Dim), func(q []float32) []float64 { return listsRef(t, h, q, k, v, n, lists) })
	})

	t.Run("clusters", func(t *testing.T) {
		c := clusterCase{heads: Heads{16, 4, 64}, n: 2500, capacity: 2600, first: 4, tail: 100, clusters: 200, opts: DenseOptions{ClusterChunk: 16}, none: []int{2}}
		plan, k, v, lists := clusterPlan(t, dev, rng, c)
		requireRepeats(t, dev, plan, queries(c.heads.Query*c.heads.Dim), func(q []float32) []float64 { return listsRef(t, c.heads, q, k, v, c.n, lists) })
	})
}

// TestDefaultGroup checks the head blocks chosen for GQA groups: the
// largest divisor up to 4, else up to 8.
func TestDefaultGroup(t *testing.T) {
	for n, want := range map[int]int{1: 1, 2: 2, 3: 3, 4: 4, 5: 5, 6: 3, 7: 7, 8: 4, 9: 3, 11: 1, 12: 4, 14: 2, 16: 4} {
		require.Equal(t, want, defaultGroup(n), "groups of %d", n)
	}
}

// TestDenseLogSumExpMatchesReference runs plans over sequences of odd and
// edge lengths (one token, one past a chunk, thousands), one cache
// repeated in the batch, with 512, 3 and 16 chunks at most (PlanChunks), and checks each sequence's and head's LogSumExp
// against LogSumExpRef; the partials are poisoned before the run so that
// an unwritten chunk fails.
func TestDenseLogSumExpMatchesReference(t *testing.T) {
	dev := vktest.Open(t)
	h := Heads{Query: 8, KV: 2, Dim: 64}
	d, err := NewDense(dev, h)
	require.NoError(t, err)
	defer d.Release()
	rng := rand.New(rand.NewSource(21))
	for li, lengths := range [][]int{{1}, {513, 7, 2047}, {300, 300, 300}} {
		var seqs []*kvcache.Layer
		var keys [][]float64
		for i, n := range lengths {
			if i > 0 && n == lengths[0] {
				seqs, keys = append(seqs, seqs[0]), append(keys, keys[0]) // the same cache again
				continue
			}
			layer, k, _ := randomLayer(t, dev, rng, h, n, n+5, 1.5)
			seqs, keys = append(seqs, layer), append(keys, k)
		}
		plan, err := d.PlanChunks(seqs, []int{512, 3, 16}[li])
		require.NoError(t, err)
		q := randomQueries(rng, len(seqs)*h.Query*h.Dim, 1)
		require.NoError(t, plan.SetQuery(q))
		nan := math.Float32bits(float32(math.NaN()))
		require.NoError(t, dev.Run(func(c *vk.Commands) {
			c.Fill(plan.parts[0], nan)
			c.Fill(plan.parts[1], nan)
		}))
		require.NoError(t, plan.run())
		lse, err := plan.LogSumExp()
		require.NoError(t, err)
		require.Len(t, lse, len(seqs)*h.Query)
		bad := 0
		for b, n := range lengths {
			for hh := 0; hh < h.Query; hh++ {
				g := hh / h.Group()
				qh := make([]float64, h.Dim)
				for i := range qh {
					qh[i] = float64(q[(b*h.Query+hh)*h.Dim+i])
				}
				want, err := LogSumExpRef(qh, keys[b][g*n*h.Dim:(g+1)*n*h.Dim], 1/math.Sqrt(float64(h.Dim)))
				require.NoError(t, err)
				got := float64(lse[b*h.Query+hh])
				if !(math.Abs(got-want) <= 1e-4*math.Max(1, math.Abs(want))) {
					if bad < 5 {
						t.Errorf("lengths %v, sequence %d, head %d: LogSumExp %v, reference %v", lengths, b, hh, got, want)
					}
					bad++
				}
			}
		}
		require.Zero(t, bad, "mismatches")
		require.NoError(t, plan.Release())
	}
}
