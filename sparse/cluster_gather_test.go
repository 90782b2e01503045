package sparse

import (
	"fmt"
	"math"
	"math/rand"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/vk/vktest"
)

// clusterCase is attention over a clustered cache: random clusters of the
// tokens [first, n−tail) of every KV head, random ranks and cuts.
type clusterCase struct {
	heads       Heads
	n, capacity int
	first, tail int // sinks [0, first); the last tail tokens unclustered
	clusters    int
	big         int          // members of one oversized cluster (0: none)
	opts        DenseOptions // of the kernels
	none        []int        // KV heads none of whose query heads takes a cluster
	// pseudo, when set, adds Double-P's pseudo-tokens to the plan and
	// receives their inputs; the ranks then leave the first half of every
	// KV head's clusters untaken, kept by the even query heads alone.
	pseudo *pseudoTokens
}

// pseudoTokens holds what clusterPlan made for a case with pseudo-tokens:
// every query head's ranks ([Hq][C]), cuts and keeps, the logits
// ([Hq][C]), the means as the GPU holds them ([KV][C][D], fp16 values)
// and each KV head's clusters' members.
type pseudoTokens struct {
	rank, cut, keep []uint32
	logits, means   []float64
	members         [][][]int32
}

// clusterPlan builds c's cache in cluster order, its ranks and cuts and a
// PlanClusters plan over them, all released when the test ends; it returns
// the plan, the keys and values the GPU sees ([KV][n][D]) and the tokens
// every KV head attends (the fixed ones, then the taken clusters' members).
func clusterPlan(t *testing.T, dev *vk.Device, rng *rand.Rand, c clusterCase) (*DensePlan, []float64, []float64, [][]int32) {
	t.Helper()
	h := c.heads
	dense, err := NewDenseWith(dev, h, c.opts)
	require.NoError(t, err)
	t.Cleanup(func() { dense.Release() })
	layer, k, v := randomLayer(t, dev, rng, h, c.n, c.capacity, 1)
	count := c.n - c.first - c.tail
	x, err := kvcache.NewClusters(dev, h.KV, h.Dim, c.clusters, c.first, count)
	require.NoError(t, err)
	t.Cleanup(func() { x.Release() })
	members := make([][][]int32, h.KV)
	for g := range members {
		members[g] = make([][]int32, c.clusters)
		for i, tok := range rng.Perm(count) {
			cl := rng.Intn(c.clusters)
			if i < c.big {
				cl = 0
			}
			members[g][cl] = append(members[g][cl], int32(c.first+tok))
		}
	}
	writeMembers(t, x, members)
	require.NoError(t, layer.Reorder(x))

	const ranks = 10
	rank := make([]uint32, h.Query*c.clusters)
	for i := range rank {
		rank[i] = uint32(rng.Intn(ranks))
		if hh, cl := i/c.clusters, i%c.clusters; c.pseudo != nil && cl < c.clusters/2 {
			// Past any cut; kept by even heads only (keep below).
			rank[i] = uint32(ranks/2 + rng.Intn(ranks/2))
			if hh%2 == 1 {
				rank[i] = ranks
			}
		}
	}
	cut := make([]uint32, h.Query)
	for i := range cut {
		cut[i] = uint32(rng.Intn(ranks/3) + 1)
		if slices.Contains(c.none, i/h.Group()) {
			cut[i] = 0
		}
	}
	rankBuf, err := dev.NewBuffer(uint64(len(rank))*4, vk.DeviceLocal)
	require.NoError(t, err)
	t.Cleanup(func() { rankBuf.Release() })
	cutBuf, err := dev.NewBuffer(uint64(len(cut))*4, vk.DeviceLocal)
	require.NoError(t, err)
	t.Cleanup(func() { cutBuf.Release() })
	require.NoError(t, rankBuf.WriteUint32(0, rank))
	require.NoError(t, cutBuf.WriteUint32(0, cut))

	sel := Selection{Clusters: x, Rank: rankBuf.All(), Cut: cutBuf.All()}
	if c.pseudo != nil {
		sel.Approx = pseudoBuffers(t, dev, rng, c, members, rank, cut)
	}
	plan, err := dense.PlanSelection(layer, sel)
	require.NoError(t, err)
	t.Cleanup(func() { plan.Release() })

	fixed, err := TacticFixedTokens(c.first, c.first+count, c.n-1)
	require.NoError(t, err)
	lists := make([][]int32, h.KV)
	for g := range lists {
		list := slices.Clone(fixed)
		for cl, m := range members[g] {
			for hh := g * h.Group(); hh < (g+1)*h.Group(); hh++ {
				if rank[hh*c.clusters+cl] < cut[hh] {
					list = append(list, m...)
					break
				}
			}
		}
		if slices.Contains(c.none, g) {
			require.Len(t, list, len(fixed))
		} else {
			require.Greater(t, len(list), len(fixed), "KV head %d takes some cluster", g)
		}
		lists[g] = list
	}
	return plan, k, v, lists
}

// pseudoBuffers makes the keeps (even heads keep every rank, odd ones
// ranks below 7), random logits and means of c's pseudo-tokens on dev,
// leaves them in c.pseudo with the ranks, cuts and members, and returns
// them as an Approximation.
func pseudoBuffers(t *testing.T, dev *vk.Device, rng *rand.Rand, c clusterCase, members [][][]int32, rank, cut []uint32) *Approximation {
	t.Helper()
	h, p := c.heads, c.pseudo
	p.rank, p.cut, p.members = rank, cut, members
	p.keep = make([]uint32, h.Query)
	for hh := range p.keep {
		p.keep[hh] = uint32(10 - 3*(hh%2))
	}
	logits := make([]float32, h.Query*c.clusters)
	bits := make([]uint32, len(logits))
	for i := range logits {
		logits[i] = float32(rng.NormFloat64()*2 + 1)
		bits[i] = math.Float32bits(logits[i])
	}
	means := make([]float32, h.KV*c.clusters*h.Dim)
	for i := range means {
		means[i] = float32(rng.NormFloat64())
	}
	halves, err := kvcache.ToHalves(means)
	require.NoError(t, err)
	p.logits, p.means = make([]float64, len(logits)), HalvesToFloat64(halves)
	for i, l := range logits {
		p.logits[i] = float64(l)
	}
	keep, logitBuf := uploadWords(t, dev, p.keep), uploadWords(t, dev, bits)
	meanBuf, err := dev.NewBuffer(uint64(len(halves))*2, vk.DeviceLocal)
	require.NoError(t, err)
	t.Cleanup(func() { meanBuf.Release() })
	require.NoError(t, meanBuf.WriteUint16(0, halves))
	return &Approximation{Keep: keep.All(), Logits: logitBuf.All(), Means: meanBuf.All()}
}

// pseudoRef returns DoublePGroupRef's output for every query head of c's
// plan (q, [Hq][D]) over keys and values k, v ([KV][n][D]) and the fixed
// tokens, with the pseudo-tokens clusterPlan left in c.pseudo.
func pseudoRef(t *testing.T, c clusterCase, q []float32, k, v []float64, fixed []int32) []float64 {
	t.Helper()
	h, p, d, nc := c.heads, c.pseudo, c.heads.Dim, c.clusters
	var want []float64
	for g := range h.KV {
		idx := &ClusterIndex{D: d, Members: p.members[g], Sizes: make([]int, nc)}
		for cl, m := range p.members[g] {
			idx.Sizes[cl] = len(m)
		}
		var qs, logits [][]float64
		var ranks [][]int
		var exact, keep []int
		for hh := g * h.Group(); hh < (g+1)*h.Group(); hh++ {
			qh := make([]float64, d)
			for i := range qh {
				qh[i] = float64(q[hh*d+i])
			}
			qs = append(qs, qh)
			logits = append(logits, p.logits[hh*nc:(hh+1)*nc])
			r := make([]int, nc)
			for cl := range r {
				r[cl] = int(p.rank[hh*nc+cl])
			}
			ranks = append(ranks, r)
			exact, keep = append(exact, int(p.cut[hh])), append(keep, int(p.keep[hh]))
		}
		outs, _, approx, err := DoublePGroupRef(qs, k[g*c.n*d:(g+1)*c.n*d], v[g*c.n*d:(g+1)*c.n*d], 1/math.Sqrt(float64(d)), idx, fixed,
			p.means[g*nc*d:(g+1)*nc*d], logits, ranks, exact, keep)
		require.NoError(t, err)
		require.NotEmpty(t, approx[0], "KV head %d: head 0 keeps pseudo-tokens", g)
		for _, o := range outs {
			want = append(want, o...)
		}
	}
	return want
}

// TestClusterGatherWithPseudoTokens attends over clusters with Double-P's
// pseudo-tokens listed in the runs' tiles, where the first half of every
// KV head's clusters is taken by no head and kept by the even heads
// alone: the odd heads' first tiles hold only rows they weigh nothing (a
// max of −∞ they must come back from), in runs of several tiles and
// windows. It compares every query head with DoublePGroupRef.
func TestClusterGatherWithPseudoTokens(t *testing.T) {
	dev := vktest.Open(t)
	rng := rand.New(rand.NewSource(rand.Int63()))
	for _, c := range []clusterCase{
		{heads: Heads{8, 2, 64}, n: 5000, capacity: 5100, first: 2, tail: 30, clusters: 600, opts: DenseOptions{ClusterChunk: 600, ClusterTile: 128, ClusterWindow: 64}},
		{heads: Heads{16, 2, 128}, n: 7001, capacity: 7001, first: 4, tail: 97, clusters: 900, opts: DenseOptions{ClusterChunk: 300, ClusterTile: 256}},
		// The default runs, windows and tiles.
		{heads: Heads{32, 8, 128}, n: 9000, capacity: 9000, first: 4, tail: 64, clusters: 560},
	} {
		c.pseudo = &pseudoTokens{}
		name := fmt.Sprintf("Hq%d_Hkv%d_D%d_N%d_C%d", c.heads.Query, c.heads.KV, c.heads.Dim, c.n, c.clusters)
		t.Run(name, func(t *testing.T) {
			h := c.heads
			plan, k, v, _ := clusterPlan(t, dev, rng, c)
			fixed, err := TacticFixedTokens(c.first, c.n-c.tail, c.n-1)
			require.NoError(t, err)
			q := randomQueries(rng, h.Query*h.Dim, 1.5)
			got := attendPoisoned(t, dev, plan, q)
			requireClose(t, pseudoRef(t, c, q, k, v, fixed), got, h.Dim, 1e-3, "over clusters with pseudo-tokens")
		})
	}
}

// TestFixedTile checks the chunks of fixed tokens: about
// clusterWorkgroups workgroups a sequence for 8 head blocks (fewer a
// sequence beyond clusterBatchSequences), never under fixedTileLeast
// tokens or over a tile, and always within the plan's slots.
func TestFixedTile(t *testing.T) {
	for _, c := range []struct{ count, capacity, sequences, tile, want int }{
		{6000, 32768, 1, 896, 256},      // StreamingLLM's fixed tokens at 32 768
		{16000, 131072, 1, 896, 500},    // and at 131 072
		{16000, 131072, 8, 896, 896},    // a batch of 8: a quarter of the workgroups
		{6000, 32768, 4, 896, 375},      // a batch of 4
		{100, 32768, 1, 896, 256},       // one part-full chunk
		{60000, 65536, 1, 896, 896},     // a tile at the most
		{3000, 3000, 1, 200, 200},       // tiles smaller than fixedTileLeast
		{1 << 20, 1 << 20, 1, 896, 896}, // slots in whole tiles
	} {
		slots := fixedSlots(c.capacity, c.tile)
		got := fixedTile(c.count, slots, 8, c.sequences, c.tile)
		require.Equal(t, c.want, got, "%d fixed tokens, %d sequences", c.count, c.sequences)
		require.LessOrEqual(t, ceilDiv(c.count, got), slots, "%d fixed tokens in chunks of %d: more than %d slots", c.count, got, slots)
	}
	require.Equal(t, fixedSlotsMost, fixedSlots(20000, 896), "slots for chunks of fixedTileLeast, at most fixedSlotsMost")
	require.Equal(t, ceilDiv(1<<20, 896), fixedSlots(1<<20, 896), "slots for whole tiles")
	require.Equal(t, 4, fixedSlots(1000, 896), "slots in chunks of fixedTileLeast")
}

// TestClusterGatherMatchesReference attends, per KV head, the fixed tokens
// and the clusters its query heads take under random ranks and cuts, and
// compares every query head with AttendSubsetRef over that union.
func TestClusterGatherMatchesReference(t *testing.T) {
	dev := vktest.Open(t)
	rng := rand.New(rand.NewSource(rand.Int63()))
	for _, c := range []clusterCase{
		{heads: Heads{8, 2, 64}, n: 3000, capacity: 3200, first: 4, tail: 196, clusters: 150, big: 1500},
		{heads: Heads{16, 4, 128}, n: 5000, capacity: 5000, first: 0, tail: 1, clusters: 400, none: []int{0}},
		// Chunks of more clusters than a window holds: tiles filled
		// across windows.
		{heads: Heads{4, 1, 128}, n: 4100, capacity: 4100, first: 1, tail: 0, clusters: 700, opts: DenseOptions{ClusterChunk: 600}},
		{heads: Heads{8, 2, 128}, n: 7000, capacity: 7000, first: 3, tail: 50, clusters: 900, opts: DenseOptions{ClusterChunk: 300, ClusterWindow: 32}},
		{heads: Heads{32, 8, 16}, n: 9001, capacity: 9500, first: 4, tail: 300, clusters: 900, big: 2000},
		// Tiles of attention over clusters apart from the dense ones.
		{heads: Heads{8, 2, 64}, n: 5000, capacity: 5000, first: 2, tail: 30, clusters: 300, opts: DenseOptions{ClusterTile: 300, ClusterWindow: 128}},
		// Two head blocks per KV head, each attending the whole group's union.
		{heads: Heads{16, 4, 128}, n: 6000, capacity: 6100, first: 4, tail: 100, clusters: 500, opts: DenseOptions{Group: 2, Tile: 512}},
		// Eight and sixteen query heads a KV head (takenByGroup's loop over
		// a group's heads), runs of several windows.
		{heads: Heads{8, 1, 64}, n: 4000, capacity: 4000, first: 2, tail: 20, clusters: 500, opts: DenseOptions{ClusterChunk: 300, ClusterWindow: 64}},
		{heads: Heads{16, 1, 64}, n: 3000, capacity: 3000, first: 1, tail: 9, clusters: 400, opts: DenseOptions{ClusterChunk: 200, ClusterWindow: 32}},
		// Thousands of fixed tokens: chunks of fixedTile tokens, shorter
		// than a tile, the last one part full.
		{heads: Heads{8, 2, 64}, n: 6000, capacity: 6500, first: 4, tail: 2700, clusters: 200},
	} {
		name := fmt.Sprintf("Hq%d_Hkv%d_D%d_N%d_C%d", c.heads.Query, c.heads.KV, c.heads.Dim, c.n, c.clusters)
		t.Run(name, func(t *testing.T) {
			h := c.heads
			plan, k, v, lists := clusterPlan(t, dev, rng, c)
			if c.opts.ClusterChunk > 0 {
				require.Greater(t, plan.mode.(*clusterMode).clusterChunk, plan.d.window, "a chunk must span several windows")
			}
			q := randomQueries(rng, h.Query*h.Dim, 1.5)
			got := attendPoisoned(t, dev, plan, q)
			requireClose(t, listsRef(t, h, q, k, v, c.n, lists), got, h.Dim, 1e-3, "over clusters")
		})
	}
}

// attendPoisoned fills the plan's output and partials with NaN, so that
// an element no workgroup writes fails the comparison, and attends q.
func attendPoisoned(t *testing.T, dev *vk.Device, plan *DensePlan, q []float32) []float32 {
	t.Helper()
	nan := math.Float32bits(float32(math.NaN()))
	require.NoError(t, dev.Run(func(cmd *vk.Commands) {
		cmd.Fill(plan.Output().All(), nan)
		cmd.Fill(plan.partO.All(), nan)
		cmd.Fill(plan.partML.All(), nan)
	}))
	got, err := plan.Attend(q)
	require.NoError(t, err)
	return got
}

// TestClusterPlanTakesNoClusterForAHeadBlock attends over clusters where
// every query head of some KV heads (so every head block of theirs) takes
// no cluster: all their chunks of clusters are empty (m = −∞, output not
// written) and only the chunks of fixed tokens attend; in the last case
// no KV head takes any, and the only fixed token is the last one. Each
// plan runs several times (requireRepeats).
func TestClusterPlanTakesNoClusterForAHeadBlock(t *testing.T) {
	dev := vktest.Open(t)
	rng := rand.New(rand.NewSource(rand.Int63()))
	for _, c := range []clusterCase{
		// Two head blocks of 8 per KV head; KV head 1 takes nothing, its
		// fixed tokens spread over several tiles of 64.
		{heads: Heads{32, 2, 16}, n: 2000, capacity: 2000, first: 5, tail: 200, clusters: 100, opts: DenseOptions{Tile: 64, ClusterChunk: 8, Group: 8}, none: []int{1}},
		{heads: Heads{8, 2, 64}, n: 1500, capacity: 1600, first: 0, tail: 1, clusters: 60, opts: DenseOptions{ClusterChunk: 4}, none: []int{0, 1}},
	} {
		name := fmt.Sprintf("Hq%d_Hkv%d_D%d_N%d_none%v", c.heads.Query, c.heads.KV, c.heads.Dim, c.n, c.none)
		t.Run(name, func(t *testing.T) {
			h := c.heads
			plan, k, v, lists := clusterPlan(t, dev, rng, c)
			nan := math.Float32bits(float32(math.NaN()))
			require.NoError(t, dev.Run(func(cmd *vk.Commands) {
				cmd.Fill(plan.partO.All(), nan)
				cmd.Fill(plan.partML.All(), nan)
			}))
			var qs [][]float32
			for i := 0; i < 3; i++ {
				qs = append(qs, randomQueries(rng, h.Query*h.Dim, 1.5))
			}
			requireRepeats(t, dev, plan, qs, func(q []float32) []float64 { return listsRef(t, h, q, k, v, c.n, lists) })
		})
	}
}

// writeMembers stores members, each KV head's clusters' token lists
// ([KV][C][]), in the index x: starts, sizes and the flat member list.
func writeMembers(t testing.TB, x *kvcache.Clusters, members [][][]int32) {
	t.Helper()
	var starts, sizes, flat []uint32
	for _, head := range members {
		at := 0
		for _, m := range head {
			starts, sizes = append(starts, uint32(at)), append(sizes, uint32(len(m)))
			for _, tok := range m {
				flat = append(flat, uint32(tok))
			}
			at += len(m)
		}
	}
	require.NoError(t, x.Starts.WriteUint32(0, starts))
	require.NoError(t, x.Counts.WriteUint32(0, sizes))
	require.NoError(t, x.Members.WriteUint32(0, flat))
}

func TestClusterGatherRejectsBadIndex(t *testing.T) {
	dev := vktest.Open(t)
	rng := rand.New(rand.NewSource(1))
	h := Heads{4, 2, 64}
	dense, err := NewDense(dev, h)
	require.NoError(t, err)
	defer dense.Release()
	layer, _, _ := randomLayer(t, dev, rng, h, 100, 200, 1)
	x, err := kvcache.NewClusters(dev, h.KV, h.Dim, 10, 0, 100)
	require.NoError(t, err)
	defer x.Release()
	small, err := dev.NewBuffer(16, vk.DeviceLocal)
	require.NoError(t, err)
	defer small.Release()
	_, err = dense.PlanClusters(layer, x, small.All(), small.All())
	require.ErrorContains(t, err, "ranks")
	other, err := kvcache.NewClusters(dev, 1, h.Dim, 10, 0, 100)
	require.NoError(t, err)
	defer other.Release()
	_, err = dense.PlanClusters(layer, other, small.All(), small.All())
	require.ErrorContains(t, err, "index")
}

// TestClusterRun checks the runs of attention over clusters against the
// shapes they were measured on (8 KV heads of one head block each): about
// clusterWorkgroups workgroups a sequence up to clusterBatchSequences
// sequences, about clusterBatchSequences·clusterWorkgroups in all beyond,
// never runs under clusterChunkMin clusters.
func TestClusterRun(t *testing.T) {
	for _, c := range []struct{ clusters, sequences, want int }{
		{8192, 1, 256},   // 131 072 tokens in clusters of 16
		{2048, 1, 64},    // 32 768
		{1024, 1, 64},    // 32 768 in clusters of 32: the floor
		{8192, 2, 256},   // batches of up to 2 keep their runs
		{8192, 4, 512},   // a batch of 4: twice as long
		{8192, 8, 1024},  // a batch of 8: four times
		{2048, 8, 256},   // likewise
		{1024, 8, 128},   // clusters of 32
		{4096, 8, 512},   // 131 072 in clusters of 32
		{8192, 16, 2048}, // 16 sequences: eight times
		{10, 3, 64},
	} {
		got := clusterRun(c.clusters, 8, c.sequences)
		require.Equal(t, c.want, got, "%d clusters a KV head, %d sequences", c.clusters, c.sequences)
		if got > clusterChunkMin {
			runs := ceilDiv(c.clusters, got) * 8 * c.sequences
			require.LessOrEqual(t, runs, max(clusterBatchSequences, c.sequences)*clusterWorkgroups, "%d clusters, %d sequences: %d runs", c.clusters, c.sequences, runs)
		}
	}
}

// TestClusterRunsPerHeadBlock gives every head block of attention over
// clusters its own number of runs (SetRuns: random, from one to the most),
// checks the output against the reference over each KV head's union and
// the members each block reports attending (Taken) against the union's
// clustered part, then balances the runs by those counts (Rebalance) and
// checks the output of the next step again.
func TestClusterRunsPerHeadBlock(t *testing.T) {
	dev := vktest.Open(t)
	rng := rand.New(rand.NewSource(rand.Int63()))
	for _, c := range []clusterCase{
		{heads: Heads{32, 8, 128}, n: 6000, capacity: 6100, first: 4, tail: 70, clusters: 700, opts: DenseOptions{ClusterChunk: 64}, none: []int{5}},
		// Two head blocks per KV head, windows shorter than the runs.
		{heads: Heads{16, 4, 64}, n: 5003, capacity: 5003, first: 1, tail: 1, clusters: 333, opts: DenseOptions{Group: 2, ClusterChunk: 40, ClusterWindow: 16}},
		// More head blocks than a table holds: equal runs whatever is set.
		{heads: Heads{16, 16, 32}, n: 3000, capacity: 3000, first: 2, tail: 10, clusters: 200},
	} {
		name := fmt.Sprintf("Hq%d_Hkv%d_D%d_N%d_C%d", c.heads.Query, c.heads.KV, c.heads.Dim, c.n, c.clusters)
		t.Run(name, func(t *testing.T) {
			h := c.heads
			plan, k, v, lists := clusterPlan(t, dev, rng, c)
			blocks := h.Group() / plan.d.group
			fixed := len(lists[0]) - clusteredMembers(t, c, lists[0])
			runs := make([]int, h.KV*blocks)
			for i := range runs {
				runs[i] = 1 + rng.Intn(plan.MostRuns())
			}
			require.Error(t, plan.SetRuns(runs[1:]), "a table of the wrong length")
			require.Error(t, plan.SetRuns(append([]int{plan.MostRuns() + 1}, runs[1:]...)), "more runs than the plan has slots for")
			require.NoError(t, plan.SetRuns(runs))
			for step := 0; step < 2; step++ {
				q := randomQueries(rng, h.Query*h.Dim, 1.5)
				got := attendPoisoned(t, dev, plan, q)
				requireClose(t, listsRef(t, h, q, k, v, c.n, lists), got, h.Dim, 1e-3, fmt.Sprintf("step %d, runs %v", step, plan.mode.(*clusterMode).runs))
				taken, err := plan.Taken()
				require.NoError(t, err)
				for i, m := range taken {
					require.Equal(t, len(lists[i/blocks])-fixed, int(m), "members taken by head block %d", i)
				}
				require.NoError(t, plan.Rebalance(1))
				if h.KV*blocks > runTableBlocks {
					continue
				}
				equal := ceilDiv(c.clusters, plan.mode.(*clusterMode).clusterChunk)
				least, _ := runBounds(c.clusters, equal, plan.d.window)
				total := 0
				for i, r := range plan.mode.(*clusterMode).runs {
					total += r
					require.GreaterOrEqual(t, r, least, "head block %d", i)
					require.LessOrEqual(t, r, plan.MostRuns(), "head block %d", i)
				}
				require.LessOrEqual(t, total, equal*len(plan.mode.(*clusterMode).runs))
			}
		})
	}
}

// clusteredMembers returns how many tokens of a KV head's list lie in the
// clustered range of c.
func clusteredMembers(t *testing.T, c clusterCase, list []int32) int {
	t.Helper()
	n := 0
	for _, tok := range list {
		if int(tok) >= c.first && int(tok) < c.n-c.tail {
			n++
		}
	}
	return n
}

// TestBalancedRuns checks the sharing of runs among head blocks: in
// proportion to their members within the least and the most, every run
// given when the caps allow, none when no block attends anything.
func TestBalancedRuns(t *testing.T) {
	require.Nil(t, balancedRuns([]uint32{0, 0, 0}, 30, 2, 20))
	require.Equal(t, []int{10, 10, 10}, balancedRuns([]uint32{5, 5, 5}, 30, 2, 20))
	require.Equal(t, []int{2, 2, 20, 8}, balancedRuns([]uint32{0, 1, 1000, 300}, 32, 2, 20))
	rng := rand.New(rand.NewSource(rand.Int63()))
	for i := 0; i < 200; i++ {
		n := 1 + rng.Intn(8)
		members := make([]uint32, n)
		for j := range members {
			members[j] = uint32(rng.Intn(20000))
		}
		members[rng.Intn(n)]++
		equal := 1 + rng.Intn(64)
		least, most := max(1, equal/4), 4*equal
		runs := balancedRuns(members, equal*n, least, most)
		total, sum := 0, 0.0
		for _, m := range members {
			sum += float64(m)
		}
		for j, r := range runs {
			require.GreaterOrEqual(t, r, least)
			require.LessOrEqual(t, r, most)
			total += r
			// Within one run and the least of the proportional share.
			if r < most {
				share := float64(equal*n-least*n) * float64(members[j]) / sum
				require.InDelta(t, share, float64(r-least), 1.0+1e-9, "members %v, runs %v", members, runs)
			}
		}
		require.LessOrEqual(t, total, equal*n)
	}
}

// TestRunBounds checks the least and most runs of a balanced head block on
// the shapes measured: Tactic's clusters of 16 at 131 072 and 32 768 tokens
// keep an eighth of their runs; the token oracle's clusters of one token
// keep all of theirs, so that no run scans more than runScanWindows
// windows.
func TestRunBounds(t *testing.T) {
	for _, c := range []struct{ clusters, equal, window, least, most int }{
		{8192, 32, 256, 4, 128},
		{2048, 32, 256, 4, 128},
		{131072, 32, 256, 32, 128},
		{32768, 32, 256, 16, 128},
		{100, 2, 64, 1, 8},
	} {
		least, most := runBounds(c.clusters, c.equal, c.window)
		require.Equal(t, c.least, least, "%d clusters, %d equal runs", c.clusters, c.equal)
		require.Equal(t, c.most, most, "%d clusters, %d equal runs", c.clusters, c.equal)
		if least < c.equal {
			require.LessOrEqual(t, ceilDiv(c.clusters, least), runScanWindows*c.window, "%d clusters", c.clusters)
		}
	}
}
