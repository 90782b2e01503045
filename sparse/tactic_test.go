package sparse

import (
	"fmt"
	"math"
	"math/rand"
	"sort"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/trace"
	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/vk/vktest"
	"github.com/vksparse/vksparse/workload"
)

// generated returns a fresh generated layer of n tokens for heads h with
// the given decode queries, one head kind throughout.
func generated(t *testing.T, h Heads, n, queries int) *trace.Trace {
	t.Helper()
	cfg := workload.DefaultConfig(n)
	cfg.KVHeads, cfg.QHeads, cfg.HeadDim, cfg.Queries, cfg.Seed, cfg.Kinds = h.KV, h.Query, h.Dim, queries, rand.Int63(), nil
	tr, err := workload.Generate(cfg)
	require.NoError(t, err)
	return tr
}

// TestTacticStepMatchesReference runs whole GPU decode steps on a
// generated layer and checks each stage: centroid scores against float64
// products with the GPU's centroids in 8 bits, each head's cut against
// TacticBinnedBudgetRef on those scores and the token lists against the
// union of the selected clusters with sinks and tail. The output is the
// conformance suite's to check.
func TestTacticStepMatchesReference(t *testing.T) { testTacticStep(t, 4000, 0, true, false) }

// TestTacticStepManyClusters runs the step over more clusters than a
// selection workgroup has threads, and (on 256-thread workgroups) more than
// its threads load at once (2 048), so that it bins them in several rounds;
// with one workgroup a head its share spans several segments, each listed
// and then sampled.
func TestTacticStepManyClusters(t *testing.T) { testTacticStep(t, 9000, 4, false, true) }

// TestTacticStepLargeClusters runs the step over clusters of 32 tokens on
// average (the size of Tactic's methodology section), which halve the
// centroids a step scores.
func TestTacticStepLargeClusters(t *testing.T) { testTacticStep(t, 5000, 32, false, false) }

// testTacticStep checks Tactic steps over n generated tokens, clustered
// with avgCluster tokens per cluster (0: the default), against the float64
// references: every run of the device's kernel variants with all, else
// three; with many, the clusters must outnumber a selection workgroup's
// threads.
func testTacticStep(t *testing.T, n, avgCluster int, all, many bool) {
	dev := vktest.Open(t)
	const tail, sinks = 150, 4
	h := Heads{Query: 8, KV: 2, Dim: 64}
	tr := generated(t, h, n, 2)
	layer, clusters := orderedLayer(t, dev, h, tr, sinks, n-tail-sinks, KMeansOptions{Seed: 7, AvgClusterSize: avgCluster})
	if many {
		require.Greater(t, clusters.C, int(perHeadWorkgroup(dev.Info())), "clusters for several per thread")
		require.Greater(t, clusters.C, selectSegment*min(int(perHeadWorkgroup(dev.Info())), selectWorkgroup), "clusters for several segments of one workgroup's share")
	}
	dense, err := NewDense(dev, h)
	require.NoError(t, err)
	defer dense.Release()
	index := hostIndex(t, clusters)
	quantizeIndex(t, index) // the step scores with 8-bit centroids
	fixed, err := TacticFixedTokens(sinks, n-tail, n-1)
	require.NoError(t, err)
	k := HalvesToFloat64(tr.K)
	d, scale := h.Dim, 1/math.Sqrt(float64(h.Dim))
	q := tr.Query(tr.Queries() - 1)

	// One thread per K row in the sampling pass (no shuffles) as well as
	// the rows shared by threads that the device allows.
	single, err := NewDenseWith(dev, h, DenseOptions{ThreadsPerRow: 1})
	require.NoError(t, err)
	defer single.Release()
	// Shared-memory trees instead of subgroup arithmetic in one run.
	tree, err := NewDenseWith(dev, h, DenseOptions{TreeReduce: true})
	require.NoError(t, err)
	defer tree.Release()
	// Centroids scored by integer dot products (where the device has
	// them) in two runs, whatever the device's default.
	var bytes *Dense
	if dev.Info().IntegerDot {
		bytes, err = NewDenseWith(dev, h, DenseOptions{Scores: ScoresIntegerDot})
		require.NoError(t, err)
		defer bytes.Release()
	} else {
		t.Logf("%s has no integer dot products: no runs with centroid_score_dot", dev.Info().Name)
	}
	// Windows capped below 2 % of the tokens in one run.
	capped := TacticCurveFit()
	capped.MaxWindow = 16
	type run struct {
		dense *Dense
		p     float64
		fit   TacticFit
		// workgroups, where positive, is the selection's workgroups per
		// head (several lists to gather, a last one to arrive);
		// scoreWorkgroups, the scores' workgroups in all (several groups of
		// centroids each, the last one's groups fewer).
		workgroups, scoreWorkgroups int
	}
	// Windows of a quarter of the tokens each with one workgroup a head:
	// its share is every cluster, listed and sampled in several rounds.
	wide := TacticCurveFit()
	wide.WindowFrac, wide.MaxWindow = 0.25, 0
	// Windows of every 3rd cluster (wide ones: many clusters each).
	thin := wide
	thin.WindowStride = 3
	// The moment estimate (the default fit): no cluster sampled.
	moments := DefaultTacticFit()
	runs := []run{{dense, 0.9, TacticCurveFit(), 0, 0}, {tree, 0.8, TacticCurveFit(), 3, 3}, {dense, 0.9, wide, 1, 1}, {dense, 0.8, thin, 2, 0},
		{dense, 0.9, moments, 0, 0}, {tree, 0.7, moments, 0, 0}}
	if bytes != nil {
		runs = append(runs, run{bytes, 0.9, moments, 0, 0}, run{bytes, 0.8, TacticCurveFit(), 0, 3})
	}
	if many {
		// Windows of a quarter of the tokens, every cluster scored, with 4
		// workgroups a head: each lists more clusters than the last
		// workgroup gives a list threads at once.
		full := wide
		full.WindowStride = 1
		runs = append(runs, run{dense, 0.9, full, 4, 0})
		// The moment estimate with one workgroup a head: its share is every
		// cluster, more than its threads load at once where they are 256;
		// and with two, whose last adds both workgroups' sums by bin.
		runs = append(runs, run{dense, 0.9, moments, 1, 0}, run{dense, 0.9, moments, 2, 0})
	}
	if all {
		runs = append(runs, run{dense, 0.5, TacticCurveFit(), 0, 0}, run{dense, 1, TacticCurveFit(), 0, 0}, run{single, 0.9, TacticCurveFit(), 0, 0},
			run{dense, 0.7, capped, 0, 5}, run{dense, 0.9, TacticCurveFit(), 5, 0}, run{tree, 0.9, thin, 0, 0})
	}
	for _, r := range runs {
		p := r.p
		if r.fit == thin {
			require.Equal(t, thin.WindowStride, thin.windowStride(clusters.Count, clusters.C), "windows wide enough to thin")
		}
		step, err := NewTacticStep(r.dense, layer, clusters, p, r.fit)
		require.NoError(t, err)
		step.tactic.workgroups, step.tactic.scoreWorkgroups = r.workgroups, r.scoreWorkgroups
		nan := math.Float32bits(float32(math.NaN()))
		require.NoError(t, dev.Run(func(c *vk.Commands) {
			if step.tactic.sampled != nil {
				c.Fill(step.tactic.sampled.All(), nan)
			}
			c.Fill(step.tactic.fixedE.All(), nan)
			c.Fill(step.tactic.planBuf.All(), nan)
			c.Fill(step.tactic.cut.All(), nan)
			c.Fill(step.tactic.scores.All(), nan)
			c.Fill(step.tactic.binOf.All(), nan)
			if step.tactic.binSums != nil {
				c.Fill(step.tactic.binSums.All(), nan)
			}
		}))
		_, err = step.Attend(q)
		require.NoError(t, err)
		if r.fit.Moments {
			requireSpreads(t, step, k, index, n)
		}
		requireSampled(t, step, q, k, index, fixed, n)
		if r.fit.Moments {
			// One workgroup a head unless a run asks for more.
			want := uint32(1)
			if r.workgroups > 0 {
				want = uint32(min(r.workgroups, step.tactic.momentSlots))
			}
			plan := make([]uint32, 16)
			require.NoError(t, step.tactic.planBuf.ReadUint32(0, plan))
			require.Equal(t, want, plan[15], "the moment estimate's workgroups a head")
		}
		scores, err := step.Scores()
		require.NoError(t, err)
		cuts, err := step.Cuts()
		require.NoError(t, err)
		members := make([][][]int32, h.KV)
		for g := range members {
			members[g] = index[g].Members
		}
		lists, err := step.Tokens(members)
		require.NoError(t, err)
		plan := make([]uint32, h.Query*16)
		require.NoError(t, step.tactic.planBuf.ReadUint32(0, plan))
		fitRows, err := step.FitRows()
		require.NoError(t, err)
		require.NoError(t, step.Release())
		t.Logf("P %v, %d threads per row: cuts %v, union sizes %d and %d of %d", p, r.dense.tpr, cuts, len(lists[0]), len(lists[1]), n)

		for g := 0; g < h.KV; g++ {
			keys := k[g*n*d : (g+1)*n*d]
			set := map[int32]bool{}
			for _, tok := range fixed {
				set[tok] = true
			}
			for hh := g * h.Group(); hh < (g+1)*h.Group(); hh++ {
				qh := make([]float64, d)
				for i := range qh {
					qh[i] = float64(q[hh*d+i])
				}
				hs := scores[hh*clusters.C : (hh+1)*clusters.C]
				tolerance := scoreTolerance(qh, scale, index[g].Centroids, r.dense.dotScores)
				for c, w := range hs {
					s := 0.0
					for i := 0; i < d; i++ {
						s += qh[i] * index[g].Centroids[c*d+i]
					}
					require.InDelta(t, scale*s, float64(w), tolerance(index[g].Centroids[c*d:(c+1)*d], scale*s), "P %v: score of head %d, cluster %d", p, hh, c)
				}
				budget, cut, err := TacticBinnedBudgetRef(qh, scale, keys, index[g], hs, fixed, p, r.fit)
				require.NoError(t, err)
				requireCut(t, budget, hs, cut, cuts[hh], p, fmt.Sprintf("P %v: cut of head %d", p, hh))
				require.Equal(t, len(fixed)+budget.SampledTokens(), fitRows[hh], "P %v: key rows the fit of head %d scored", p, hh)
				// The fit's estimated total S(n), which every listed sum enters,
				// in the units of the GPU's shift (its best centroid score).
				total := float64(math.Float32frombits(plan[hh*16+14]))
				want := budget.Total * math.Exp(budget.Shift-float64(math.Float32frombits(plan[hh*16])))
				require.InDelta(t, want, total, 1e-3*want, "P %v: estimated total of head %d", p, hh)
				m, u := ScoreBinScale(hs)
				for c, x := range hs {
					if ScoreBin(m, u, x) < cuts[hh] {
						for _, tok := range index[g].Members[c] {
							set[tok] = true
						}
					}
				}
			}
			var expect []int32
			for tok := range set {
				expect = append(expect, tok)
			}
			sort.Slice(expect, func(i, j int) bool { return expect[i] < expect[j] })
			have := append([]int32(nil), lists[g]...)
			sort.Slice(have, func(i, j int) bool { return have[i] < have[j] })
			require.Equal(t, expect, have, "P %v: token list of KV head %d", p, g)
			if p == 1 {
				require.Len(t, have, n, "P = 1 attends every token")
			}
		}
	}
	if !all {
		return
	}
	_, err = NewTacticStep(dense, layer, clusters, 0, TacticCurveFit())
	require.Error(t, err, "P = 0")

	step, err := NewTacticStep(dense, layer, clusters, 0.9, TacticCurveFit())
	require.NoError(t, err)
	defer step.Release()
	require.NoError(t, step.SetQuery(q))
	stages, total, err := step.TimeStages(1, 3)
	require.NoError(t, err)
	require.Equal(t, append(TacticStages, "attend"), step.Stages())
	require.Len(t, stages, len(step.Stages()))
	for i, s := range stages {
		require.Greater(t, s, time.Duration(0), "stage %s", step.Stages()[i])
	}
	require.Greater(t, total, time.Duration(0))
	t.Logf("stages %v, step %v", stages, total)
}

// gpuChecker returns a check of a GPU value against its float64 reference
// (relative 1e-4, NaN failing) that reports the first five mismatches, and
// the count of mismatches.
func gpuChecker(t *testing.T) (check func(what string, want float64, got float32), bad *int) {
	bad = new(int)
	return func(what string, want float64, got float32) {
		if math.Abs(want-float64(got)) > 1e-4*(math.Abs(want)+1e-6) || math.IsNaN(float64(got)) {
			if *bad < 5 {
				t.Errorf("%s: GPU %g, float64 %g", what, got, want)
			}
			*bad++
		}
	}, bad
}

// requireSpreads checks the spreads and dimension weights the step's
// moment estimate reads against ClusterIndex.SetSpreadsRef over the
// float64 keys ([KV][n·D]), then gives index the GPU's values, which the
// references of the step's lists and cuts take.
func requireSpreads(t *testing.T, step *TacticStep, keys []float64, index []*ClusterIndex, n int) {
	t.Helper()
	h, x, b := step.dense.heads, step.tactic.clusters, &step.tactic.tacticBound
	// Written again over poison: an element the kernel leaves is NaN.
	nan := math.Float32bits(float32(math.NaN()))
	require.NoError(t, step.dense.dev.Run(func(c *vk.Commands) {
		c.Fill(b.spreads.All(), nan)
		c.Fill(b.dimWeights.All(), nan)
	}))
	require.NoError(t, computeSpreads(step.dense.dev, h, step.layer, x, b.spreads, b.dimWeights))
	spreads, weights, err := step.Spreads()
	require.NoError(t, err)
	check, bad := gpuChecker(t)
	for g, idx := range index {
		ref := &ClusterIndex{D: idx.D, Centroids: idx.Centroids, Sizes: idx.Sizes, Members: idx.Members}
		require.NoError(t, ref.SetSpreadsRef(keys[g*n*h.Dim:(g+1)*n*h.Dim]))
		idx.Spreads, idx.DimWeights = make([]float64, x.C), make([]float64, h.Dim)
		for c, want := range ref.Spreads {
			check(fmt.Sprintf("KV head %d, spread of cluster %d", g, c), want, spreads[g*x.C+c])
			idx.Spreads[c] = float64(spreads[g*x.C+c])
		}
		for i, want := range ref.DimWeights {
			check(fmt.Sprintf("KV head %d, weight of dimension %d", g, i), want, weights[g*h.Dim+i])
			idx.DimWeights[i] = float64(weights[g*h.Dim+i])
		}
	}
	require.Zero(t, *bad, "spreads differing from float64")
}

// cutMassTolerance is how far from P, in the reference's estimated mass
// fraction, a GPU cut may land when it differs from the reference's: the
// GPU fits in float32, and where the estimated curve is flat a change of
// 1e-4 in the fit moves the cut across several sparse bins.
const cutMassTolerance = 2e-3

// requireCut checks a head's GPU cut against the reference's budget over
// the binned groups of scores: equal, or, by the reference's estimate S,
// the GPU's groups reach P − cutMassTolerance of the total and all but the
// last of them stay below P + cutMassTolerance. At P = 1 it must be equal.
func requireCut(t *testing.T, b *TacticBudget, scores []float32, want, got int, p float64, what string) {
	t.Helper()
	if got == want {
		return
	}
	require.Less(t, p, 1.0, "%s: GPU %d, reference %d", what, got, want)
	m, u := ScoreBinScale(scores)
	taken := map[int]bool{}
	for _, x := range scores {
		if bin := ScoreBin(m, u, x); bin < got {
			taken[bin] = true
		}
	}
	j := len(taken) // groups are the non-empty bins, ascending
	reach := b.Estimate(b.Offsets[j]) / b.Total
	require.GreaterOrEqual(t, reach, p-cutMassTolerance, "%s: GPU %d reaches %.5f, reference %d", what, got, reach, want)
	if j > 0 {
		before := b.Estimate(b.Offsets[j-1]) / b.Total
		require.Less(t, before, p+cutMassTolerance, "%s: GPU %d already reached %.5f a group before, reference %d", what, got, before, want)
	}
	t.Logf("%s: GPU %d, reference %d; the GPU's groups reach %.5f of the estimate", what, got, want, reach)
}

// requireSampled checks the sampling of the last step: for every query
// head, that the workgroups' lists hold each sampled cluster (those in the
// exact bins, and those of a window of the head's plan whose index the
// fit's stride divides) once, in the list of the workgroup whose share it
// is, with its bin, and its exponential sum against Σ exp(scale·q·k − m)
// over its members in float64, m the head's best centroid score; the
// tokens the workgroups counted per window against the sampled clusters'
// sizes; and the sum over the fixed tokens the same way.
func requireSampled(t *testing.T, step *TacticStep, q []float32, keys []float64, index []*ClusterIndex, fixed []int32, n int) {
	t.Helper()
	h, x := step.dense.heads, step.tactic.clusters
	d, scale := h.Dim, 1/math.Sqrt(float64(h.Dim))
	plan := make([]uint32, h.Query*16)
	stride := x.C + maxSampleWorkgroups // list entries per head
	lists := make([]uint32, 2*h.Query*stride)
	counts := make([]uint32, 4*h.Query*maxSampleWorkgroups)
	require.NoError(t, step.tactic.planBuf.ReadUint32(0, plan))
	if step.tactic.sampled != nil { // the moment estimate lists none
		require.NoError(t, step.tactic.sampled.ReadUint32(0, lists))
	}
	require.NoError(t, step.tactic.fixedE.ReadUint32(0, counts))
	bins, err := step.BinsOf()
	require.NoError(t, err)
	scores, err := step.Scores()
	require.NoError(t, err)
	thin := step.tactic.fit.windowStride(x.Count, x.C)
	check, bad := gpuChecker(t)
	for hh := 0; hh < h.Query; hh++ {
		g := hh / h.Group()
		pl := plan[hh*16 : hh*16+16]
		m := float64(math.Float32frombits(pl[0]))
		e := func(tok int32) float64 {
			s := 0.0
			for i := 0; i < d; i++ {
				s += float64(q[hh*d+i]) * keys[(g*n+int(tok))*d+i]
			}
			return math.Exp(scale*s - m)
		}
		j0, windows := int(pl[1]), pl[3] != 0
		in := func(b int, lo, hi uint32) bool { return windows && b >= int(lo) && b <= int(hi) }
		w := int(pl[15])
		require.True(t, w >= 1 && w <= maxSampleWorkgroups, "head %d: %d workgroups", hh, w)
		listCap := (x.C + w - 1) / w
		listed := map[int]bool{}
		var counted [2]int // tokens the workgroups sampled per window
		for r := 0; r < w; r++ {
			at := 4 * (hh*maxSampleWorkgroups + r)
			count := int(counts[at+1])
			counted[0] += int(counts[at+2])
			counted[1] += int(counts[at+3])
			require.LessOrEqual(t, count, listCap, "head %d: workgroup %d lists %d clusters", hh, r, count)
			for i := 0; i < count; i++ {
				at := 2 * (hh*stride + r*listCap + i)
				c, b := int(lists[at])/ScoreBins, int(lists[at])%ScoreBins
				require.Less(t, c, x.C, "head %d: workgroup %d lists cluster %d", hh, r, c)
				require.Equal(t, r, c%w, "head %d: cluster %d listed by workgroup %d", hh, c, r)
				require.Equal(t, bins[hh*x.C+c], b, "head %d: bin of cluster %d", hh, c)
				require.False(t, listed[c], "head %d: cluster %d listed twice", hh, c)
				listed[c] = true
				want := 0.0
				for _, tok := range index[g].Members[c] {
					want += e(tok)
				}
				check(fmt.Sprintf("head %d, cluster %d", hh, c), want, math.Float32frombits(lists[at+1]))
			}
		}
		sampled := 0
		if step.tactic.fit.Moments {
			// No list: the workgroups' sums by bin of the clusters' estimates.
			require.Empty(t, listed, "head %d: the moment estimate lists no cluster", hh)
			require.Equal(t, [2]int{}, counted, "head %d: no window", hh)
			require.Equal(t, x.Count, int(pl[2]), "head %d: every clustered token is in the exact part", hh)
			require.LessOrEqual(t, w, step.tactic.momentSlots, "head %d: workgroups", hh)
			qh := make([]float64, d)
			for i := range qh {
				qh[i] = float64(q[hh*d+i])
			}
			shift := MomentShift(qh, scale, index[g].DimWeights)
			want := make([]float64, ScoreBins)
			for c := 0; c < x.C; c++ {
				want[bins[hh*x.C+c]] += MomentEstimate(index[g].Sizes[c], float64(scores[hh*x.C+c]), index[g].Spreads[c], shift, m)
			}
			sums := make([]float32, w*ScoreBins)
			require.NoError(t, step.tactic.binSums.ReadFloat32(uint64(hh*w*ScoreBins*4), sums))
			for b := range want {
				got := float32(0)
				for r := 0; r < w; r++ {
					got += sums[r*ScoreBins+b]
				}
				check(fmt.Sprintf("head %d, bin %d", hh, b), want[b], got)
			}
			sampled = -1 // no sampled cluster to check below
		}
		var windowTokens [2]int
		for c := 0; c < x.C && sampled >= 0; c++ {
			b := bins[hh*x.C+c]
			if b >= j0 && (!thinned(int32(c), thin) || !in(b, pl[4], pl[5]) && !in(b, pl[8], pl[9])) {
				continue
			}
			for k, at := range []int{4, 8} {
				if in(b, pl[at], pl[at+1]) {
					windowTokens[k] += len(index[g].Members[c])
				}
			}
			sampled++
			require.True(t, listed[c], "head %d: sampled cluster %d (bin %d) is not listed", hh, c, b)
		}
		if sampled >= 0 {
			require.Positive(t, sampled, "head %d samples no cluster", hh)
			require.Len(t, listed, sampled, "head %d: clusters listed that are not sampled", hh)
			require.Equal(t, windowTokens, counted, "head %d: tokens sampled per window", hh)
		}
		if hh == 0 && sampled >= 0 {
			t.Logf("head 0: %d clusters sampled by %d workgroups", sampled, w)
		}
		want := 0.0
		for _, tok := range fixed {
			want += e(tok)
		}
		check(fmt.Sprintf("head %d, fixed tokens", hh), want, math.Float32frombits(pl[13]))
	}
	require.Zero(t, *bad, "sampled exponential sums differing from float64")
}
