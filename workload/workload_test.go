package workload

import (
	"fmt"
	"math"
	"path/filepath"
	"slices"
	"sort"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/trace"
)

// longLayer is DefaultConfig(32768), generated once for the tests that
// check the statistics.
var longLayer = sync.OnceValues(func() (*trace.Trace, error) {
	return Generate(DefaultConfig(32768))
})

func smallConfig() Config {
	cfg := DefaultConfig(300)
	cfg.KVHeads, cfg.QHeads, cfg.HeadDim = 2, 8, 32
	return cfg
}

func TestGenerateRejectsBadConfigs(t *testing.T) {
	cases := map[string]struct {
		change func(*Config)
		want   string
	}{
		"zero tokens":          {func(c *Config) { c.Tokens = 0 }, "must be positive"},
		"zero queries":         {func(c *Config) { c.Queries = 0 }, "must be positive"},
		"negative kv heads":    {func(c *Config) { c.KVHeads = -1 }, "must be positive"},
		"q heads not multiple": {func(c *Config) { c.QHeads = 12; c.KVHeads = 8 }, "not a multiple"},
		"odd head dim":         {func(c *Config) { c.HeadDim = 127 }, "must be even"},
		"tiny head dim":        {func(c *Config) { c.HeadDim = 6 }, "at least 8"},
		"queries over tokens":  {func(c *Config) { c.Queries = 400 }, "exceeds Tokens"},
		"too many elements":    {func(c *Config) { c.Tokens = math.MaxInt32; c.HeadDim = 1 << 20 }, "exceed"},
		"rope theta":           {func(c *Config) { c.RopeTheta = 1 }, "RopeTheta"},
		"rope theta NaN":       {func(c *Config) { c.RopeTheta = math.NaN() }, "RopeTheta"},
		"negative sinks":       {func(c *Config) { c.Sinks = -1 }, "Sinks"},
		"sinks over tokens":    {func(c *Config) { c.Sinks = 301 }, "Sinks"},
		"no topics":            {func(c *Config) { c.Topics = 0 }, "Topics"},
		"short topic runs":     {func(c *Config) { c.TopicRun = 0.5 }, "TopicRun"},
		"zero window":          {func(c *Config) { c.Window = 0 }, "Window"},
		"huge window":          {func(c *Config) { c.Window = 1 << 30 }, "Window"},
		"query correlation 1":  {func(c *Config) { c.QueryCorrelation = 1 }, "QueryCorrelation"},
		"kinds length":         {func(c *Config) { c.Kinds = []HeadKind{Topic} }, "Kinds"},
		"unknown kind":         {func(c *Config) { c.Kinds = make([]HeadKind, 8); c.Kinds[3] = 7 }, "not a head kind"},
		"profiles length":      {func(c *Config) { c.Profiles = make([]Profile, 3) }, "Profiles"},
		"group share":          {func(c *Config) { c.GroupShare = 1.5 }, "GroupShare"},
		"semantic noise":       {func(c *Config) { c.SemanticNoise = -1 }, "SemanticNoise"},
		"sink mass 1":          {func(c *Config) { c.Profiles = make([]Profile, 8); c.Profiles[2].SinkMass = 1 }, "SinkMass"},
		"negative random":      {func(c *Config) { c.Profiles = make([]Profile, 8); c.Profiles[2].Random = -1 }, "Random"},
		"huge sink logit":      {func(c *Config) { c.Profiles = make([]Profile, 8); c.Profiles[2].Sink = math.Inf(1) }, "Sink"},
		"too many topics":      {func(c *Config) { c.Profiles = make([]Profile, 8); c.Profiles[2].Topics = make([]float64, 9) }, "topics"},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			cfg := smallConfig()
			tc.change(&cfg)
			tr, err := Generate(cfg)
			require.ErrorContains(t, err, tc.want)
			assert.Nil(t, tr)
		})
	}
}

func TestGenerateShapes(t *testing.T) {
	for _, c := range []struct{ kv, q, dim, tokens int }{
		{1, 1, 8, 1}, {1, 3, 8, 5}, {2, 8, 16, 100}, {4, 16, 64, 1000}, {8, 32, 128, 64},
	} {
		cfg := DefaultConfig(c.tokens)
		cfg.KVHeads, cfg.QHeads, cfg.HeadDim = c.kv, c.q, c.dim
		tr, err := Generate(cfg)
		require.NoError(t, err, "%+v", c)
		require.NoError(t, tr.Validate())
		assert.Equal(t, c.tokens, tr.Tokens)
		assert.Equal(t, cfg.Queries, tr.Queries())
		assert.InDelta(t, 1/math.Sqrt(float64(c.dim)), tr.Scale, 1e-15)
		for i, p := range tr.QPos {
			assert.Equal(t, int32(c.tokens-cfg.Queries+i), p)
		}
		for _, x := range tr.Q {
			require.False(t, math.IsNaN(float64(x)) || math.IsInf(float64(x), 0), "query element %v", x)
		}
		for _, k := range tr.K {
			require.NotEqual(t, uint16(0x7c00), k&0x7c00, "key element is Inf or NaN")
		}
		kinds, err := KindsOf(tr)
		require.NoError(t, err)
		assert.Equal(t, DefaultKinds(c.q, c.kv), kinds)
	}
}

func TestGenerateIsDeterministic(t *testing.T) {
	cfg := smallConfig()
	a, err := Generate(cfg)
	require.NoError(t, err)
	b, err := Generate(cfg)
	require.NoError(t, err)
	assert.Equal(t, a, b)

	cfg.Seed++
	c, err := Generate(cfg)
	require.NoError(t, err)
	assert.NotEqual(t, a.K, c.K)
	assert.NotEqual(t, a.V, c.V)
	assert.NotEqual(t, a.Q, c.Q)
}

func TestConfiguredKinds(t *testing.T) {
	cfg := smallConfig()
	cfg.Kinds = []HeadKind{Retrieval, Topic, Retrieval, Topic, Topic, Topic, Retrieval, Streaming}
	tr, err := Generate(cfg)
	require.NoError(t, err)
	kinds, err := KindsOf(tr)
	require.NoError(t, err)
	assert.Equal(t, cfg.Kinds, kinds)
}

func TestDefaultKindsMixEveryGroup(t *testing.T) {
	kinds := DefaultKinds(32, 8)
	count := map[HeadKind]int{}
	for g := 0; g < 8; g++ {
		group := kinds[4*g : 4*g+4]
		for _, k := range []HeadKind{Streaming, Retrieval, Topic} {
			assert.Contains(t, group, k, "group %d", g)
		}
		for _, k := range group {
			count[k]++
		}
	}
	assert.Equal(t, map[HeadKind]int{Streaming: 16, Retrieval: 8, Topic: 8}, count)
	assert.NotEqual(t, kinds[0:4], kinds[4:8], "the order shifts from group to group")
	assert.Equal(t, []HeadKind{Streaming, Retrieval, Streaming, Topic}, DefaultKinds(4, 4), "without GQA too")
}

func TestGroupedKindsShareAKindPerGroup(t *testing.T) {
	for _, c := range []struct{ q, kv int }{{32, 8}, {8, 2}, {12, 4}, {8, 8}} {
		kinds := GroupedKinds(c.q, c.kv)
		require.Len(t, kinds, c.q)
		count := map[HeadKind]int{}
		group := c.q / c.kv
		for h, k := range kinds {
			assert.Equal(t, kinds[h/group*group], k, "%d/%d: head %d differs from its group's first", c.q, c.kv, h)
			count[k]++
		}
		if c.kv%4 == 0 {
			assert.Equal(t, c.q/2, count[Streaming], "%d/%d: half streaming", c.q, c.kv)
			assert.Positive(t, count[Retrieval], "%d/%d: some retrieval", c.q, c.kv)
			assert.Positive(t, count[Topic], "%d/%d: some topic", c.q, c.kv)
		}
	}
}

func TestLateKindsAreMostlyStreaming(t *testing.T) {
	for _, c := range []struct{ q, kv, topic int }{{32, 8, 4}, {8, 2, 1}, {8, 8, 4}, {6, 1, 1}} {
		kinds := LateKinds(c.q, c.kv)
		require.Len(t, kinds, c.q)
		count := map[HeadKind]int{}
		for _, k := range kinds {
			count[k]++
		}
		assert.Equal(t, c.topic, count[Topic], "%d/%d: topic heads", c.q, c.kv)
		assert.Equal(t, c.q-c.topic, count[Streaming], "%d/%d: the rest streaming", c.q, c.kv)
	}
}

func TestHeadKindNames(t *testing.T) {
	for _, k := range []HeadKind{Streaming, Retrieval, Topic} {
		parsed, err := ParseHeadKind(k.String())
		require.NoError(t, err)
		assert.Equal(t, k, parsed)
	}
	_, err := ParseHeadKind("sliding")
	assert.ErrorContains(t, err, "unknown head kind")
	assert.Equal(t, "HeadKind(9)", HeadKind(9).String())

	_, err = KindsOf(&trace.Trace{QHeads: 2})
	assert.ErrorContains(t, err, "no head_kinds")
	_, err = KindsOf(&trace.Trace{QHeads: 2, Meta: map[string]string{"head_kinds": "topic"}})
	assert.ErrorContains(t, err, "1 kinds for 2")
}

func TestTraceRoundTrip(t *testing.T) {
	tr, err := Generate(smallConfig())
	require.NoError(t, err)
	path := filepath.Join(t.TempDir(), "layer.safetensors")
	require.NoError(t, trace.Write(path, tr))
	back, err := trace.Read(path)
	require.NoError(t, err)

	assert.Equal(t, tr.KVHeads, back.KVHeads)
	assert.Equal(t, tr.QHeads, back.QHeads)
	assert.Equal(t, tr.HeadDim, back.HeadDim)
	assert.Equal(t, tr.Tokens, back.Tokens)
	assert.Equal(t, tr.K, back.K)
	assert.Equal(t, tr.V, back.V)
	assert.Equal(t, tr.Q, back.Q)
	assert.Equal(t, tr.QPos, back.QPos)
	assert.Equal(t, tr.Scale, back.Scale)
	for key, value := range tr.Meta {
		assert.Equal(t, value, back.Meta[key], "metadata %q", key)
	}
	kinds, err := KindsOf(back)
	require.NoError(t, err)
	assert.Equal(t, DefaultKinds(tr.QHeads, tr.KVHeads), kinds)
}

// kindStats gathers, for one head kind, one value per (head, query).
type kindStats struct {
	logitStd, p50, p70, p90 []float64 // p…: share of tokens for mass P
	sinkMass, windowMass    []float64 // mass on the sinks, on the last 256 tokens
}

func median(x []float64) float64 {
	s := slices.Clone(x)
	sort.Float64s(s)
	return s[len(s)/2]
}

// spread formats the median, min and max of x times unit.
func spread(x []float64, unit float64) string {
	return fmt.Sprintf("%.3g [%.3g, %.3g]", unit*median(x), unit*slices.Min(x), unit*slices.Max(x))
}

// fractionWhere returns the share of x for which keep holds.
func fractionWhere(x []float64, keep func(float64) bool) float64 {
	n := 0
	for _, v := range x {
		if keep(v) {
			n++
		}
	}
	return float64(n) / float64(len(x))
}

func TestStatisticsAt32K(t *testing.T) {
	tr, err := longLayer()
	require.NoError(t, err)
	kinds, err := KindsOf(tr)
	require.NoError(t, err)
	cfg := DefaultConfig(32768)

	stats := map[HeadKind]*kindStats{Streaming: {}, Retrieval: {}, Topic: {}}
	var allStd []float64
	for head, kind := range kinds {
		for _, query := range []int{0, tr.Queries() - 1} {
			a, err := HeadAttention(tr, query, head)
			require.NoError(t, err)
			n := float64(len(a.Probs))
			s := stats[kind]
			s.logitStd = append(s.logitStd, a.LogitStd())
			s.p50 = append(s.p50, float64(a.TokensFor(0.5))/n)
			s.p70 = append(s.p70, float64(a.TokensFor(0.7))/n)
			s.p90 = append(s.p90, float64(a.TokensFor(0.9))/n)
			s.sinkMass = append(s.sinkMass, a.Mass(0, cfg.Sinks))
			s.windowMass = append(s.windowMass, a.Mass(len(a.Probs)-256, len(a.Probs)))
			allStd = append(allStd, a.LogitStd())

			// Every query likes the sinks: the first sink's logit stands
			// well above the mean.
			var mean float64
			for _, l := range a.Logits {
				mean += l
			}
			mean /= n
			assert.Greater(t, a.Logits[0]-mean, 5.0, "head %d (%s) query %d: first sink logit", head, kind, query)
		}
	}
	for _, kind := range []HeadKind{Streaming, Retrieval, Topic} {
		s := stats[kind]
		t.Logf("%-9s logit std %s; %% of tokens for P=0.5 %s, P=0.7 %s, P=0.9 %s; sink mass %s, last-256 mass %s",
			kind, spread(s.logitStd, 1), spread(s.p50, 100), spread(s.p70, 100), spread(s.p90, 100), spread(s.sinkMass, 1), spread(s.windowMass, 1))
	}

	assert.GreaterOrEqual(t, fractionWhere(allStd, func(x float64) bool { return x >= 1 && x <= 3 }), 0.9, "logit std in [1, 3]")

	streaming, retrieval, topic := stats[Streaming], stats[Retrieval], stats[Topic]
	assert.Less(t, slices.Min(streaming.p90), 0.02, "some streaming head reaches P=0.9 with < 2% of the tokens")
	assert.GreaterOrEqual(t, fractionWhere(streaming.p90, func(x float64) bool { return x < 0.02 }), 0.9)
	assert.Greater(t, slices.Max(retrieval.p90), 0.2, "some retrieval head needs > 20% of the tokens for P=0.9")
	assert.GreaterOrEqual(t, fractionWhere(retrieval.p90, func(x float64) bool { return x > 0.2 }), 0.9)
	assert.Less(t, median(streaming.p90), median(topic.p90), "topic heads lie between")
	assert.Less(t, median(topic.p90), median(retrieval.p90), "topic heads lie between")

	assert.Greater(t, median(streaming.sinkMass), 0.3, "sinks hold much of the streaming heads' mass")
	assert.Greater(t, median(streaming.windowMass), 0.04, "the local window holds more than its 0.8% share of tokens")
	assert.Greater(t, median(retrieval.sinkMass), 0.005, "even retrieval heads give the sinks some mass")
}

func TestQueriesDriftSlowly(t *testing.T) {
	tr, err := longLayer()
	require.NoError(t, err)
	d := tr.HeadDim
	cosine := func(a, b []float32) float64 {
		var ab, aa, bb float64
		for i := range a {
			ab += float64(a[i]) * float64(b[i])
			aa += float64(a[i]) * float64(a[i])
			bb += float64(b[i]) * float64(b[i])
		}
		return ab / math.Sqrt(aa*bb)
	}
	last := tr.Queries() - 1
	var next, far float64
	for h := range tr.QHeads {
		query := func(i int) []float32 { return tr.Query(i)[h*d : (h+1)*d] }
		for i := range last {
			c := cosine(query(i), query(i+1))
			assert.Less(t, c, 0.9999, "head %d steps %d, %d are not the same query", h, i, i+1)
			next += c / float64(last*tr.QHeads)
		}
		far += cosine(query(0), query(last)) / float64(tr.QHeads)
	}
	t.Logf("mean cosine of consecutive queries %.3f, of the first and last %.3f", next, far)
	assert.Greater(t, next, 0.9)
	assert.Less(t, far, next)
}

// TestKeysClusterWithOverlap checks that the keys form topic clusters that
// overlap: nearest-centroid assignment with the true topics' centroids is
// mostly but far from always right.
func TestKeysClusterWithOverlap(t *testing.T) {
	cfg := DefaultConfig(8192)
	cfg.KVHeads, cfg.QHeads = 1, 4
	tr, err := Generate(cfg)
	require.NoError(t, err)
	topicOf := topicSequence(&cfg)
	d := tr.HeadDim
	key := func(n int) []float64 {
		k := make([]float64, d)
		for i := range k {
			k[i] = float64(halfTable()[tr.K[n*d+i]])
		}
		return k
	}
	centroids := make([][]float64, cfg.Topics)
	counts := make([]int, cfg.Topics)
	for c := range centroids {
		centroids[c] = make([]float64, d)
	}
	for n := cfg.Sinks; n < cfg.Tokens; n++ {
		for i, x := range key(n) {
			centroids[topicOf[n]][i] += x
		}
		counts[topicOf[n]]++
	}
	for c := range centroids {
		for i := range centroids[c] {
			centroids[c][i] /= float64(max(counts[c], 1))
		}
	}
	right := 0
	for n := cfg.Sinks; n < cfg.Tokens; n++ {
		k := key(n)
		nearest, best := -1, math.Inf(1)
		for c, centroid := range centroids {
			var dist float64
			for i := range k {
				dist += (k[i] - centroid[i]) * (k[i] - centroid[i])
			}
			if counts[c] > 0 && dist < best {
				nearest, best = c, dist
			}
		}
		if nearest == topicOf[n] {
			right++
		}
	}
	accuracy := float64(right) / float64(cfg.Tokens-cfg.Sinks)
	t.Logf("nearest true centroid is the token's topic for %.1f%% of the keys", 100*accuracy)
	assert.Greater(t, accuracy, 0.6)
	assert.Less(t, accuracy, 0.95)
}

func BenchmarkGenerate32K(b *testing.B) {
	cfg := DefaultConfig(32768)
	for range b.N {
		if _, err := Generate(cfg); err != nil {
			b.Fatal(err)
		}
	}
}
