package sparse

import (
	"math/rand"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/vk/vktest"
)

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
			require.ErrorIs(t, runOnce(dev, plan.Record), vk.ErrReleased)
			require.Zero(t, plan.Bytes())
		})
	}
}
