package workload

import (
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestNamedConfig(t *testing.T) {
	for _, name := range LayerNames {
		cfg, err := NamedConfig(name, 1000, 16, 4, 64)
		require.NoError(t, err, name)
		assert.Equal(t, 1000, cfg.Tokens, name)
		assert.Equal(t, [3]int{16, 4, 64}, [3]int{cfg.QHeads, cfg.KVHeads, cfg.HeadDim}, name)
		require.Len(t, cfg.Kinds, 16, name)
		require.NoError(t, cfg.validate(), name)
	}
	cfg, err := NamedConfig("grouped", 1000, 32, 8, 128)
	require.NoError(t, err)
	want := DefaultConfig(1000)
	want.Kinds = GroupedKinds(32, 8)
	assert.Equal(t, want, cfg)

	llama, err := NamedConfig("llama", 20000, 32, 8, 128)
	require.NoError(t, err)
	assert.Equal(t, LlamaConfig(20000), llama)
	megaBeam, err := NamedConfig("megabeam", 20000, 32, 8, 128)
	require.NoError(t, err)
	assert.Equal(t, MegaBeamConfig(20000), megaBeam)

	_, err = NamedConfig("falcon", 1000, 32, 8, 128)
	assert.ErrorContains(t, err, "unknown layer")
}

func TestLlamaHeadsMostlySharpDiffuseInTwoGroups(t *testing.T) {
	kinds, profiles := LlamaHeads(16384, 32, 8)
	require.Len(t, kinds, 32)
	require.Len(t, profiles, 32)
	count := map[HeadKind]int{}
	diffuseGroups := map[int]bool{}
	for h, k := range kinds {
		count[k]++
		if k == Retrieval {
			diffuseGroups[h/4] = true
		}
		assert.Greater(t, profiles[h].SinkMass, 0.0, "head %d", h)
	}
	assert.Equal(t, map[HeadKind]int{Streaming: 15, Topic: 9, Retrieval: 8}, count)
	assert.Len(t, diffuseGroups, 2, "the diffuse heads sit in two KV groups")

	// Other shapes take the characters group by group.
	for _, shape := range [][2]int{{8, 8}, {16, 4}, {12, 3}, {5, 2}} {
		kinds, profiles := LlamaHeads(4096, shape[0], shape[1])
		assert.Len(t, kinds, shape[0])
		assert.Len(t, profiles, shape[0])
	}

	// The local and topic logits grow with ln N, the spread with it.
	_, long := LlamaHeads(4*16384, 32, 8)
	g := math.Log(4)
	assert.InDelta(t, profiles[1].Local+g, long[1].Local, 1e-12)
	assert.InDelta(t, profiles[1].Topics[0]+g, long[1].Topics[0], 1e-12)
	assert.InDelta(t, profiles[0].Random*(1+llamaSharpening*g), long[0].Random, 1e-12)
	assert.Equal(t, profiles[0].SinkMass, long[0].SinkMass)
}

// profileConfig is a small layer whose heads all have profile p.
func profileConfig(p Profile) Config {
	cfg := DefaultConfig(4096)
	cfg.KVHeads, cfg.QHeads, cfg.HeadDim, cfg.Queries = 2, 8, 64, 2
	cfg.Kinds = make([]HeadKind, cfg.QHeads)
	for range cfg.QHeads {
		cfg.Profiles = append(cfg.Profiles, p)
	}
	return cfg
}

func TestProfilesMeetSinkMassAndSpread(t *testing.T) {
	for _, p := range []Profile{
		{SinkMass: 0.8, Random: 1.5},
		{SinkMass: 0.3, Random: 0.5, Context: 2},
		{SinkMass: 0.6, Local: 3, Topics: []float64{5}, Random: 0.4, Context: 1},
	} {
		cfg := profileConfig(p)
		tr, err := Generate(cfg)
		require.NoError(t, err)
		for head := range cfg.QHeads {
			for query := range cfg.Queries {
				a, err := HeadAttention(tr, query, head)
				require.NoError(t, err)
				assert.InDelta(t, p.SinkMass, a.Mass(0, cfg.Sinks), 1e-3, "%+v head %d query %d: sink mass", p, head, query)
				if p.Local == 0 && p.Topics == nil {
					// Only the random and context parts (and a trace of
					// the sink part) move the other logits.
					sd := stdDev(a.Logits[cfg.Sinks:])
					assert.InEpsilon(t, math.Hypot(p.Random, p.Context), sd, 0.03, "%+v head %d query %d: logit std", p, head, query)
				}
			}
		}
	}
}

func TestProfilesWithSinkLogit(t *testing.T) {
	cfg := profileConfig(Profile{Sink: 12, Random: 1})
	tr, err := Generate(cfg)
	require.NoError(t, err)
	a, err := HeadAttention(tr, 1, 5)
	require.NoError(t, err)
	assert.InDelta(t, 12, a.Logits[0], 3, "first sink's logit (the random part adds N(0, 1))")
	assert.InEpsilon(t, 1, stdDev(a.Logits[cfg.Sinks:]), 0.03)
}

func TestGroupShareAndTopics(t *testing.T) {
	cfg := profileConfig(Profile{SinkMass: 0.5, Topics: []float64{4, 3}, Random: 1, Context: 1})
	cfg.GroupShare, cfg.GroupTopics = 1, true
	tr, err := Generate(cfg)
	require.NoError(t, err)
	q := tr.Query(1)
	d := cfg.HeadDim
	head := func(h int) []float32 { return q[h*d : (h+1)*d] }
	// With everything shared, the heads of a group are one head.
	assert.Equal(t, head(0), head(3))
	assert.NotEqual(t, head(0), head(4))

	cfg.GroupShare = 0.5
	tr, err = Generate(cfg)
	require.NoError(t, err)
	q = tr.Query(1)
	cos := func(a, b []float32) float64 {
		var ab, aa, bb float64
		for i := range a {
			ab += float64(a[i]) * float64(b[i])
			aa += float64(a[i]) * float64(a[i])
			bb += float64(b[i]) * float64(b[i])
		}
		return ab / math.Sqrt(aa*bb)
	}
	assert.Less(t, cos(head(0), head(1)), 0.999, "heads of a group differ")
	assert.Greater(t, cos(head(0), head(1)), cos(head(0), head(4)), "heads of a group are closer than heads of two groups")
}
