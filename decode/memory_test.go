package decode

import (
	"math/rand"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/vk/vktest"
)

// TestModelMemoryBeyondCaches builds a Llama-8B-shaped model (32 layers,
// Hq 32, Hkv 8, D 128) of one slot at a capacity of 2 048 tokens under
// each policy, prefills every layer, attends each once (so that every
// batch exists), and checks that Memory accounts for every byte the model
// holds on the device and that the memory beyond the KV caches stays
// within 10 % of the caches, 12.5 % for H2O, which keeps three words per
// token and query head (9.4 % of the caches at this head shape) so that
// its accumulation reads the logits its attention recorded instead of
// every key. What grows with the tokens (indexes, H2O's
// accumulated attention, ranks and recorded logits) weighs the same share
// at 32 768 tokens; what is sized per slot (the workspace's partials and scratch,
// shared by the layers) weighs less there, so at 4 slots of 32 768
// tokens the share is lower than here.
func TestModelMemoryBeyondCaches(t *testing.T) {
	dev := vktest.Open(t)
	heads := sparse.Heads{Query: 32, KV: 8, Dim: 128}
	const layers, slots, capacity, n = 32, 1, 2048, 2000
	rng := rand.New(rand.NewSource(11))
	kf := make([]float32, heads.KV*n*heads.Dim)
	vf := make([]float32, len(kf))
	for i := range kf {
		kf[i], vf[i] = float32(rng.NormFloat64()), float32(rng.NormFloat64())
	}
	k, err := kvcache.ToHalves(kf)
	require.NoError(t, err)
	v, err := kvcache.ToHalves(vf)
	require.NoError(t, err)
	q := make([]float32, slots*heads.Query*heads.Dim)
	for i := range q {
		q[i] = float32(rng.NormFloat64())
	}
	for _, tc := range []struct {
		pol   Policy
		bound float64
	}{
		{Dense(), 0.10},
		{Tactic(0.9, sparse.TacticDecoderOptions{}), 0.10},
		{DoubleP(sparse.DefaultDoubleP(), sparse.TacticDecoderOptions{}), 0.10},
		{Quest(256), 0.10},
		{StreamingLLM(256), 0.10},
		{H2O(256), 0.125},
	} {
		pol := tc.pol
		before := dev.Allocated()
		m, err := New(dev, Config{Fallback: FallbackNever, Heads: heads, Layers: layers, Slots: slots, Capacity: capacity, Policy: pol})
		require.NoError(t, err)
		for s := 0; s < slots; s++ {
			for l := 0; l < layers; l++ {
				require.NoError(t, m.Prefill(s, l, k, v, n))
			}
		}
		for l := 0; l < layers; l++ {
			_, err := m.Attend(l, q)
			require.NoError(t, err, "%s layer %d", pol, l)
		}
		mem, err := m.Memory()
		require.NoError(t, err)
		t.Logf("%s: caches %d MiB, other %.1f MiB (%.2f %%)", pol, mem.Caches>>20, float64(mem.Other)/(1<<20), 100*float64(mem.Other)/float64(mem.Caches))
		require.Equal(t, uint64(layers*slots*heads.KV*capacity*heads.Dim*2*2), mem.Caches, "%s: the caches at capacity", pol)
		require.Equal(t, dev.Allocated()-before, mem.Caches+mem.Other, "%s: Memory accounts for every buffer the model holds", pol)
		require.LessOrEqual(t, float64(mem.Other), tc.bound*float64(mem.Caches), "%s: memory beyond the caches", pol)
		require.NoError(t, m.Release())
		require.Equal(t, before, dev.Allocated(), "%s: Release frees every buffer", pol)
	}
}
