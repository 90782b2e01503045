package decode

import (
	"math/rand"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/vk/vktest"
)

// TestModelMemoryBeyondCaches builds Llama-8B-shaped models (Hq 32, Hkv 8,
// D 128) of one slot at a capacity of 2 048 tokens under each policy,
// prefills every layer, attends each once (so that every batch exists),
// and checks that Memory accounts for every byte the model holds on the
// device. Models of 1, 2 and 4 layers are built: the memory beyond the
// caches must grow by the same bytes with every layer (the layers share
// the per-slot workspace and nothing else), so that a model of 32 layers,
// as Llama 8B has, holds O(1) + 31·(O(2) − O(1)) beyond its caches; that
// must stay within 10 % of its caches, 12.5 % for H2O, which keeps three
// words per token and query head (9.4 % of the caches at this head shape)
// so that its accumulation reads the logits its attention recorded
// instead of every key. What grows with the tokens (indexes, H2O's
// accumulated attention, ranks and recorded logits) weighs the same share
// at 32 768 tokens; what is sized per slot (the workspace's partials and
// scratch, shared by the layers) weighs less there, so at 4 slots of
// 32 768 tokens the share is lower than here.
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
	cacheLayer := uint64(slots * heads.KV * capacity * heads.Dim * 2 * 2)
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
		other := map[int]uint64{}
		for _, ls := range []int{1, 2, 4} {
			before := dev.Allocated()
			m, err := New(dev, Config{Fallback: FallbackNever, Heads: heads, Layers: ls, Slots: slots, Capacity: capacity, Policy: pol})
			require.NoError(t, err)
			for s := 0; s < slots; s++ {
				for l := 0; l < ls; l++ {
					require.NoError(t, m.Prefill(s, l, k, v, n))
				}
			}
			for l := 0; l < ls; l++ {
				_, err := m.Attend(l, q)
				require.NoError(t, err, "%s layer %d", pol, l)
			}
			mem, err := m.Memory()
			require.NoError(t, err)
			require.Equal(t, uint64(ls)*cacheLayer, mem.Caches, "%s, %d layers: the caches at capacity", pol, ls)
			require.Equal(t, dev.Allocated()-before, mem.Caches+mem.Other, "%s, %d layers: Memory accounts for every buffer the model holds", pol, ls)
			require.NoError(t, m.Release())
			require.Equal(t, before, dev.Allocated(), "%s, %d layers: Release frees every buffer", pol, ls)
			other[ls] = mem.Other
		}
		perLayer := other[2] - other[1]
		require.Equal(t, 2*perLayer, other[4]-other[2], "%s: every layer adds the same memory beyond the caches (1, 2, 4 layers: %d, %d, %d bytes)", pol, other[1], other[2], other[4])
		total, caches := other[1]+(layers-1)*perLayer, layers*cacheLayer
		t.Logf("%s: %d layers' caches %d MiB, other %.1f MiB (%.2f %%; %.1f MiB a layer, %.1f MiB shared)", pol, layers, caches>>20,
			float64(total)/(1<<20), 100*float64(total)/float64(caches), float64(perLayer)/(1<<20), float64(other[1]-perLayer)/(1<<20))
		require.LessOrEqual(t, float64(total), tc.bound*float64(caches), "%s: memory beyond the caches of %d layers", pol, layers)
	}
}
