package sparse

import (
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/trace"
	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/vk/vktest"
)

// TestDoublePStepMatchesReference runs Double-P steps on a generated layer
// and checks each stage against float64: the clusters' mean values
// (ClusterValueMeansRef), every pseudo-token logit (with the centroids in
// 8 bits, as the selection reads them), each cluster's bin
// (DoublePBinRanks of the GPU's logits), both cuts (DoublePCutsRef over
// those bins, up to the rounding of the fixed-point masses at the
// boundary); P1 = P2 = 1 attends every token; and the output
// (DoublePGroupRef over those bins and cuts).
func TestDoublePStepMatchesReference(t *testing.T) {
	testDoublePStep(t, 4000, 0, []DoubleP{DefaultDoubleP(), {P1: 0.8, P2: 0.3}, {P1: 1, P2: 1}, {P1: 0.99, P2: 0.05}}, DenseOptions{})
}

// TestDoublePStepIntegerScores runs the step with its centroids scored by
// integer dot products of the queries' bytes, whatever the device's
// default, where the device has them.
func TestDoublePStepIntegerScores(t *testing.T) {
	testDoublePStep(t, 4000, 0, []DoubleP{DefaultDoubleP(), {P1: 0.8, P2: 0.3}}, DenseOptions{Scores: ScoresIntegerDot})
}

// TestDoublePStepManyClusters runs the step over more clusters than the
// selection's threads (several per thread) and more than one run of
// clusters per attention workgroup.
func TestDoublePStepManyClusters(t *testing.T) {
	testDoublePStep(t, 9001, 4, []DoubleP{DefaultDoubleP()}, DenseOptions{})
}

func testDoublePStep(t *testing.T, n, avgCluster int, targets []DoubleP, dopts DenseOptions) {
	dev := vktest.Open(t)
	if dopts.Scores == ScoresIntegerDot && !dev.Info().IntegerDot {
		t.Skipf("%s has no integer dot products (VK_KHR_shader_integer_dot_product)", dev.Info().Name)
	}
	const tail, sinks = 64, 4
	h := Heads{Query: 8, KV: 2, Dim: 64}
	tr := generated(t, h, n, 2)
	layer, clusters := orderedLayer(t, dev, h, tr, sinks, n-tail-sinks, KMeansOptions{Seed: 11, AvgClusterSize: avgCluster})
	dense, err := NewDenseWith(dev, h, dopts)
	require.NoError(t, err)
	defer dense.Release()
	index := hostIndex(t, clusters)
	quantizeIndex(t, index) // the selection scores with 8-bit centroids
	fixed, err := TacticFixedTokens(sinks, n-tail, n-1)
	require.NoError(t, err)
	k, v := HalvesToFloat64(tr.K), HalvesToFloat64(tr.V)
	d, scale := h.Dim, 1/math.Sqrt(float64(h.Dim))
	q := tr.Query(tr.Queries() - 1)

	for i, opts := range targets {
		step, err := NewDoublePStep(dense, layer, clusters, opts)
		require.NoError(t, err)
		sel := step.Selector().(*DoublePSelector)
		// Every other target scores several groups of centroids per
		// workgroup, in 3 workgroups in all.
		if i%2 == 1 {
			sel.scoreWorkgroups = 3
		}
		// Every buffer of the selection is poisoned.
		nan := math.Float32bits(float32(math.NaN()))
		require.NoError(t, dev.Run(func(c *vk.Commands) {
			for _, b := range []*vk.Buffer{sel.logits, sel.binOf, sel.exact, sel.keep} {
				c.Fill(b.All(), nan)
			}
		}))
		out, err := step.Attend(q)
		require.NoError(t, err)
		logits32, err := sel.Logits()
		require.NoError(t, err)
		bins, err := sel.Bins()
		require.NoError(t, err)
		exact, keep, err := sel.Cuts()
		require.NoError(t, err)
		means, err := sel.Means()
		require.NoError(t, err)
		require.NoError(t, step.Release())
		t.Logf("P1 %v P2 %v: exact cuts %v, keep cuts %v (bins)", opts.P1, opts.P2, exact, keep)

		for g := 0; g < h.KV; g++ {
			keys, values := k[g*n*d:(g+1)*n*d], v[g*n*d:(g+1)*n*d]
			// The GPU stores the means rounded to fp16: so does the reference.
			meansRef := HalvesToFloat64(mustHalves(t, ClusterValueMeansRef(values, d, index[g])))
			requireNear(t, meansRef, means[g*clusters.C*d:(g+1)*clusters.C*d], 1e-3, fmt.Sprintf("mean values of KV head %d", g))
			var qs, logits [][]float64
			var ranks [][]int
			var ex, kp []int
			for hh := g * h.Group(); hh < (g+1)*h.Group(); hh++ {
				qh := make([]float64, d)
				for i := range qh {
					qh[i] = float64(q[hh*d+i])
				}
				ref, err := DoublePLogitsRef(qh, scale, index[g])
				require.NoError(t, err)
				row := logits32[hh*clusters.C : (hh+1)*clusters.C]
				tolerance := scoreTolerance(qh, scale, index[g].Centroids, dense.dotScores)
				mine := make([]float64, len(row))
				for c, x := range row {
					mine[c] = float64(x)
					if math.IsInf(ref[c], -1) {
						require.True(t, math.IsInf(mine[c], -1), "head %d: empty cluster %d has logit %v", hh, c, x)
						continue
					}
					cent, s := index[g].Centroids[c*d:(c+1)*d], 0.0
					for i, x := range qh {
						s += scale * x * cent[i]
					}
					tol := tolerance(cent, s)
					require.InDelta(t, ref[c], mine[c], tol+1e-4*math.Abs(ref[c]), "head %d: logit of cluster %d", hh, c)
				}
				rank := DoublePBinRanks(row)
				require.Equal(t, rank, bins[hh*clusters.C:(hh+1)*clusters.C], "head %d: bins", hh)
				requireDoublePCuts(t, mine, rank, opts, exact[hh], keep[hh], fmt.Sprintf("P1 %v P2 %v head %d", opts.P1, opts.P2, hh))
				qs, logits, ranks = append(qs, qh), append(logits, mine), append(ranks, rank)
				ex, kp = append(ex, exact[hh]), append(kp, keep[hh])
			}
			outs, tokens, approx, err := DoublePGroupRef(qs, keys, values, scale, index[g], fixed, meansRef, logits, ranks, ex, kp)
			require.NoError(t, err)
			var want []float64
			for _, o := range outs {
				want = append(want, o...)
			}
			heads := out[g*h.Group()*d : (g+1)*h.Group()*d]
			require.NoError(t, CompareHeads(want, heads, d, 1e-3), "P1 %v P2 %v, KV head %d: output", opts.P1, opts.P2, g)
			pseudo := 0
			for _, a := range approx {
				pseudo += len(a)
			}
			t.Logf("KV head %d: %d of %d tokens exact, %d pseudo-tokens over %d heads", g, len(tokens), n, pseudo, len(qs))
			if opts.P1 == 1 && opts.P2 == 1 {
				require.Len(t, tokens, n, "P1 = P2 = 1 attends every token")
			}
		}
	}
	_, err = NewDoublePStep(dense, layer, clusters, DoubleP{P1: 0.9, P2: math.NaN()})
	require.Error(t, err, "P2 NaN")

	step, err := NewDoublePStep(dense, layer, clusters, DefaultDoubleP())
	require.NoError(t, err)
	defer step.Release()
	require.NoError(t, step.SetQuery(q))
	stages, total, err := step.TimeStages(1, 3)
	require.NoError(t, err)
	require.Len(t, stages, len(step.Stages()))
	for i, s := range stages {
		require.Greater(t, s, time.Duration(0), "stage %s", step.Stages()[i])
	}
	require.Greater(t, total, time.Duration(0))
}

// requireDoublePCuts checks the GPU's cuts against DoublePCutsRef over
// the same bins: equal, or, where the fixed-point masses round the other
// way, a cut whose defining sums lie within 1e-4 of their target.
func requireDoublePCuts(t *testing.T, logits []float64, rank []int, opts DoubleP, exact, keep int, what string) {
	t.Helper()
	wantExact, wantKeep := DoublePCutsRef(logits, rank, ScoreBins, opts)
	if exact == wantExact && keep == wantKeep {
		return
	}
	best := math.Inf(-1)
	for _, x := range logits {
		best = max(best, x)
	}
	below := func(cut int) float64 {
		s := 0.0
		for c, x := range logits {
			if rank[c] < cut {
				s += math.Exp(x - best)
			}
		}
		return s
	}
	near := func(a, b float64) bool { return math.Abs(a-b) <= 1e-4*b }
	total := below(ScoreBins)
	okKeep := keep == wantKeep || near(below(min(keep, wantKeep)), opts.P1*total)
	kept := below(keep)
	wantE, _ := DoublePCutsRef(logits, rank, keep, DoubleP{P1: 1, P2: opts.P2})
	okExact := exact == wantE || near(below(min(exact, wantE)), opts.P2*kept)
	require.True(t, okKeep && okExact, "%s: GPU cuts exact %d keep %d, float64 %d and %d", what, exact, keep, wantExact, wantKeep)
}

// requireNear fails at the first few elements of got farther than tol
// (relative to the largest |want|) from want.
func requireNear(t *testing.T, want []float64, got []float32, tol float64, what string) {
	t.Helper()
	require.Len(t, got, len(want), what)
	top := 0.0
	for _, x := range want {
		top = max(top, math.Abs(x))
	}
	bad := 0
	for i, x := range want {
		if diff := math.Abs(float64(got[i]) - x); !(diff <= tol*top) {
			if bad < 5 {
				t.Errorf("%s: element %d GPU %g, float64 %g", what, i, got[i], x)
			}
			bad++
		}
	}
	require.Zero(t, bad, "%s: %d elements differ", what, bad)
}

// orderedLayer returns a cache of the trace's tokens in cluster order
// and its index of tokens [first, first+count), both released when the
// test ends.
func orderedLayer(t *testing.T, dev *vk.Device, h Heads, tr *trace.Trace, first, count int, opts KMeansOptions) (*kvcache.Layer, *kvcache.Clusters) {
	t.Helper()
	layer, err := kvcache.NewLayer(dev, h.KV, h.Dim, tr.Tokens)
	require.NoError(t, err)
	t.Cleanup(func() { layer.Release() })
	require.NoError(t, layer.Prefill(tr.K, tr.V, tr.Tokens))
	km, err := NewKMeans(dev, h.KV, h.Dim)
	require.NoError(t, err)
	defer km.Release()
	clusters, err := km.Cluster(layer, first, count, opts)
	require.NoError(t, err)
	t.Cleanup(func() { clusters.Release() })
	require.NoError(t, layer.Reorder(clusters))
	return layer, clusters
}

// hostIndex reads every KV head's index of clusters back as ClusterIndex.
func hostIndex(t *testing.T, clusters *kvcache.Clusters) []*ClusterIndex {
	t.Helper()
	index := make([]*ClusterIndex, clusters.KVHeads)
	for g := range index {
		hc, err := clusters.Read(g)
		require.NoError(t, err)
		cent := make([]float64, len(hc.Centroids))
		for i, x := range hc.Centroids {
			cent[i] = float64(x)
		}
		index[g] = &ClusterIndex{D: clusters.HeadDim, Centroids: cent, Members: hc.Members}
		for _, mem := range hc.Members {
			index[g].Sizes = append(index[g].Sizes, len(mem))
		}
	}
	return index
}

// quantizeIndex stores the centroids of every index in 8 bits, as the
// selection kernels read them (QuantizedCentroidsRef).
func quantizeIndex(t *testing.T, index []*ClusterIndex) {
	t.Helper()
	for _, x := range index {
		var err error
		x.Centroids, err = QuantizedCentroidsRef(x.Centroids, x.D)
		require.NoError(t, err)
	}
}

// mustHalves rounds x to fp16 bit patterns (through float32, to nearest
// even).
func mustHalves(t *testing.T, x []float64) []uint16 {
	t.Helper()
	f := make([]float32, len(x))
	for i, v := range x {
		f[i] = float32(v)
	}
	h, err := kvcache.ToHalves(f)
	require.NoError(t, err)
	return h
}

// TestDoublePBatchSharesScoreStage checks that a batch sizes its Double-P
// selections' score dispatches for all its sequences (stageSharer), and
// that a step outside a batch sizes them for itself.
func TestDoublePBatchSharesScoreStage(t *testing.T) {
	dev := vktest.Open(t)
	h := Heads{Query: 8, KV: 2, Dim: 64}
	const n = 700
	dense, err := NewDense(dev, h)
	require.NoError(t, err)
	defer dense.Release()
	var steps []*Step
	for range 3 {
		tr := generated(t, h, n, 1)
		layer, clusters := orderedLayer(t, dev, h, tr, 4, n-68, KMeansOptions{Seed: 11})
		step, err := NewDoublePStep(dense, layer, clusters, DefaultDoubleP())
		require.NoError(t, err)
		require.Equal(t, 1, step.Selector().(*DoublePSelector).sequences, "a step on its own")
		steps = append(steps, step)
	}
	b, err := NewBatch(dense, steps)
	require.NoError(t, err)
	defer b.Release()
	for i, s := range steps {
		require.Equal(t, len(steps), s.Selector().(*DoublePSelector).sequences, "step %d of the batch", i)
	}
}
