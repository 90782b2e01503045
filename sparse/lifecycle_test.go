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
