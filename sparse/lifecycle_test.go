package sparse

import (
	"math/rand"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/vk/vktest"
)

// TestStepUseAfterRelease checks that a released step refuses the calls
// the conformance suite does not make (timing, rebalancing, the rows
// attended) with vk.ErrReleased, none panicking, and that releasing
// K-means twice says so.
func TestStepUseAfterRelease(t *testing.T) {
	dev := vktest.Open(t)
	rng := rand.New(rand.NewSource(5))
	h := Heads{Query: 8, KV: 2, Dim: 64}
	dense, err := NewDense(dev, h)
	require.NoError(t, err)
	defer dense.Release()
	layer, _, _ := randomLayer(t, dev, rng, h, 300, 300, 1)
	defer layer.Release()
	step, err := NewQuestStep(dense, layer, 64)
	require.NoError(t, err)
	q := randomQueries(rng, h.Query*h.Dim, 1)
	_, err = step.Attend(q)
	require.NoError(t, err)
	require.NoError(t, step.Release())
	require.ErrorIs(t, step.Rebalance(), vk.ErrReleased)
	_, err = step.Time(0, 1)
	require.ErrorIs(t, err, vk.ErrReleased)
	_, _, err = step.TimeStages(0, 1)
	require.ErrorIs(t, err, vk.ErrReleased)
	_, err = step.Attended()
	require.ErrorIs(t, err, vk.ErrReleased)
	require.Nil(t, step.Output())
	require.Nil(t, step.Stages())

	km, err := NewKMeans(dev, h.KV, h.Dim)
	require.NoError(t, err)
	require.NoError(t, km.Release())
	require.ErrorIs(t, km.Release(), vk.ErrReleased, "released twice")
	_, err = km.Cluster(layer, 4, 200, KMeansOptions{})
	require.ErrorIs(t, err, vk.ErrReleased)
}

// TestFixedBudgetsRefused checks that Quest and H2O refuse budgets of no
// token, negative ones and ones beyond the layer's capacity, and take the
// edges.
func TestFixedBudgetsRefused(t *testing.T) {
	dev := vktest.Open(t)
	rng := rand.New(rand.NewSource(6))
	h := Heads{Query: 8, KV: 2, Dim: 64}
	dense, err := NewDense(dev, h)
	require.NoError(t, err)
	defer dense.Release()
	layer, _, _ := randomLayer(t, dev, rng, h, 300, 320, 1)
	defer layer.Release()
	for name, make := range map[string]func(*Dense, *kvcache.Layer, int) (*Step, error){"Quest": NewQuestStep, "H2O": NewH2OStep} {
		for _, bad := range []int{0, -1, 321, 1e9} {
			_, err := make(dense, layer, bad)
			require.Error(t, err, "%s budget %d", name, bad)
		}
		for _, good := range []int{1, 320} {
			step, err := make(dense, layer, good)
			require.NoError(t, err, "%s budget %d", name, good)
			require.NoError(t, step.Release())
		}
	}
}

// TestInputsOutliveSteps checks that a layer and an index cannot be
// released, nor the layer prefilled anew, while a step reads them, and
// can once the step is released.
func TestInputsOutliveSteps(t *testing.T) {
	dev := vktest.Open(t)
	rng := rand.New(rand.NewSource(8))
	h := Heads{Query: 8, KV: 2, Dim: 64}
	dense, err := NewDense(dev, h)
	require.NoError(t, err)
	defer dense.Release()
	layer, k, _ := randomLayer(t, dev, rng, h, 400, 400, 1)
	km, err := NewKMeans(dev, h.KV, h.Dim)
	require.NoError(t, err)
	defer km.Release()
	x, err := km.Cluster(layer, 4, 300, KMeansOptions{})
	require.NoError(t, err)
	require.NoError(t, layer.Reorder(x))
	step, err := NewDoublePStep(dense, layer, x, DefaultDoubleP())
	require.NoError(t, err)
	require.ErrorContains(t, layer.Release(), "release them first")
	require.ErrorContains(t, x.Release(), "release them first")
	halves := make([]uint16, len(k))
	require.ErrorContains(t, layer.Prefill(halves, halves, 400), "release them first")
	_, err = step.Attend(randomQueries(rng, h.Query*h.Dim, 1))
	require.NoError(t, err, "the step still reads live buffers")
	require.NoError(t, step.Release())
	require.NoError(t, x.Release())
	require.NoError(t, layer.Release())
}

// TestDensePlanModesReleaseWhatTheyMake makes a plan of every mode while
// each of its allocations and submissions in turn fails: the constructor
// returns the failure (errors.Is ErrOutOfMemory) and leaves no object
// alive (the device's release, when the test ends, reports any). The plan
// made without a failure attends, releases with no error, and then refuses
// a second Release and Record with vk.ErrReleased.
func TestDensePlanModesReleaseWhatTheyMake(t *testing.T) {
	opts := vk.OptionsFromEnv()
	opts.Faults = true
	dev := vktest.OpenWith(t, opts)
	rng := rand.New(rand.NewSource(11))
	h := Heads{Query: 8, KV: 2, Dim: 64}
	dense, err := NewDense(dev, h)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, dense.Release()) })
	seqs := make([]*kvcache.Layer, 2)
	for i := range seqs {
		seqs[i], _, _ = randomLayer(t, dev, rng, h, 300+100*i, 500, 1)
	}

	// A layer in cluster order: 30 clusters of its tokens [2, 250).
	const first, count, c = 2, 248, 30
	clustered, _, _ := randomLayer(t, dev, rng, h, 260, 260, 1)
	x, err := kvcache.NewClusters(dev, h.KV, h.Dim, c, first, count)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, x.Release()) })
	members := make([][][]int32, h.KV)
	for g := range members {
		members[g] = make([][]int32, c)
		for i, tok := range rng.Perm(count) {
			members[g][i%c] = append(members[g][i%c], int32(first+tok))
		}
	}
	writeMembers(t, x, members)
	require.NoError(t, clustered.Reorder(x))
	words := func(n int, fill uint32) vk.Range {
		b, err := dev.NewBuffer(uint64(n)*4, vk.DeviceLocal)
		require.NoError(t, err)
		t.Cleanup(func() { require.NoError(t, b.Release()) })
		require.NoError(t, dev.Run(func(cmd *vk.Commands) { cmd.Fill(b.All(), fill) }))
		return b.All()
	}
	sel := Selection{Clusters: x, Rank: words(h.Query*c, 0), Cut: words(h.Query, 1),
		Approx: &Approximation{Keep: words(h.Query, 2), Logits: words(h.Query*c, 0), Means: words(h.KV*c*h.Dim/2, 0)}}

	modes := []struct {
		name string
		make func() (*DensePlan, error)
	}{
		{"dense", func() (*DensePlan, error) { return dense.Plan(seqs) }},
		{"logits", func() (*DensePlan, error) { return dense.PlanLogits(seqs[0]) }},
		{"gather", func() (*DensePlan, error) { return dense.PlanGather(seqs[1], 64) }},
		{"selection", func() (*DensePlan, error) { return dense.PlanSelection(clustered, sel) }},
	}
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			for _, site := range []vk.Site{vk.Allocation, vk.Submission} {
				for nth := 1; ; nth++ {
					require.NoError(t, dev.InjectFault(vk.Fault{Site: site, Nth: nth, Err: vk.ErrOutOfMemory}))
					plan, err := m.make()
					if !dev.ClearFault() {
						require.NoError(t, err)
						require.NoError(t, plan.Release())
						break
					}
					require.ErrorIs(t, err, vk.ErrOutOfMemory, "%v %d failed", site, nth)
					require.Nil(t, plan)
				}
			}
			plan, err := m.make()
			require.NoError(t, err)
			if tokens := plan.Tokens(); tokens != nil {
				require.NoError(t, plan.SetTokens([][]int32{{0, 5, 9}, {299}}))
			}
			_, err = plan.Attend(randomQueries(rng, h.Query*h.Dim*len(plan.seqs), 1))
			require.NoError(t, err)
			require.NotZero(t, plan.Bytes())
			require.NoError(t, plan.Release())
			require.ErrorIs(t, plan.Release(), vk.ErrReleased, "released twice")
			require.ErrorIs(t, dev.Do(plan.Record), vk.ErrReleased)
			require.Zero(t, plan.Bytes())
		})
	}
}
