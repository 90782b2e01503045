package workload

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/x448/float16"

	"github.com/vksparse/vksparse/trace"
)

// HeadKind is the attention behaviour a query head is given.
type HeadKind int

const (
	// Streaming heads put most of their mass on the sinks and the
	// local window.
	Streaming HeadKind = iota
	// Retrieval heads spread their mass over the whole context.
	Retrieval
	// Topic heads concentrate on the tokens of one or two topics.
	Topic
)

var kindNames = [...]string{Streaming: "streaming", Retrieval: "retrieval", Topic: "topic"}

// String returns the kind's lower-case name.
func (k HeadKind) String() string {
	if k < 0 || int(k) >= len(kindNames) {
		return "HeadKind(" + strconv.Itoa(int(k)) + ")"
	}
	return kindNames[k]
}

// ParseHeadKind returns the kind named s ("streaming", "retrieval", "topic").
func ParseHeadKind(s string) (HeadKind, error) {
	for k, name := range kindNames {
		if s == name {
			return HeadKind(k), nil
		}
	}
	return 0, fmt.Errorf("workload: unknown head kind %q", s)
}

// Config describes a synthetic layer. Start from DefaultConfig and change
// what you need: every field is checked by Generate.
type Config struct {
	KVHeads, QHeads, HeadDim, Tokens, Queries int
	// Seed selects the random layer; equal configs give equal traces.
	Seed int64
	// RopeTheta is the RoPE base.
	RopeTheta float64
	// Sinks is the number of attention-sink tokens at the start (may be 0).
	Sinks int
	// Topics is the number of latent topic directions per KV head.
	Topics int
	// TopicRun is the mean length, in tokens, of a run of tokens on the
	// same topic.
	TopicRun float64
	// Window is the local-window width in tokens: keys carry a slowly
	// varying local context whose correlation falls to 0.41 at a distance
	// of Window tokens (see the package documentation).
	Window int
	// QueryCorrelation is the correlation, in [0, 1), of the random part
	// of a head's query between consecutive decode steps.
	QueryCorrelation float64
	// Kinds gives the kind of each query head; nil means DefaultKinds.
	Kinds []HeadKind
	// Profiles, if not nil, gives each query head its own profile in
	// place of its kind's (the kind then only labels the head).
	Profiles []Profile
	// GroupShare is the share, in [0, 1], of the variance of the random
	// and context parts of a query that the heads of one KV group have in
	// common; 0 makes them independent.
	GroupShare float64
	// SemanticNoise is the std of the key noise per element of the
	// semantic band; 0 means 1. Less noise lets the topics stand out.
	SemanticNoise float64
	// GroupTopics makes the heads of a KV group take their topics from one
	// list drawn per group, the topics of tokens drawn from the 4096 before
	// the decode tail: a head's i-th topic is the group's i-th.
	GroupTopics bool
}

// Profile gives, in logit units (q·k·Scale), what a query head gets from
// each part of the keys (see the package documentation).
type Profile struct {
	Sink       float64   // logit of the first sink
	Positional float64   // logit from the positional pairs at distance 0
	Local      float64   // logit from the local context at distance 0
	Topics     []float64 // logits of nearby tokens of the head's topics
	// Random is the std over tokens of the logit from the random part,
	// which lives in every pair but the positional ones.
	Random float64
	// SinkMass, if positive, replaces Sink: at every decode step the
	// head's sink logit is set so that the sinks take this share (below
	// 1) of its softmax mass over the tokens it attends.
	SinkMass float64
	// Context is the std over tokens of the logit from a random direction
	// of the fast band outside the positional pairs, where the keys carry
	// the local context: a logit that varies slowly along the context.
	Context float64
}

// DefaultConfig returns a Llama-3-8B-like layer of the given length: 8 KV
// heads, 32 query heads, head dim 128, 8 decode queries and 4 sinks (fewer
// if tokens is smaller), RoPE theta 500000, 32 topics in runs of about 64
// tokens, a 128-token window, query correlation 0.9 between steps and the
// DefaultKinds mix of heads.
func DefaultConfig(tokens int) Config {
	return Config{
		KVHeads: 8, QHeads: 32, HeadDim: 128, Tokens: tokens, Queries: min(8, max(tokens, 1)),
		Seed:             1,
		RopeTheta:        500000,
		Sinks:            min(4, max(tokens, 0)),
		Topics:           32,
		TopicRun:         64,
		Window:           128,
		QueryCorrelation: 0.9,
	}
}

// GroupedKinds returns the mix of DefaultKinds (half streaming, a quarter
// retrieval, a quarter topic) by KV group instead of by head: all query
// heads of a group share its kind, as in models whose retrieval heads come
// with their KV heads, so that a group's union over its heads is as sparse
// as its heads.
func GroupedKinds(qHeads, kvHeads int) []HeadKind {
	group := groupSize(qHeads, kvHeads)
	kinds := make([]HeadKind, qHeads)
	for h := range kinds {
		kinds[h] = kindPattern[(h/group)%len(kindPattern)]
	}
	return kinds
}

// LateKinds returns the head kinds of a sparser layer, as late layers
// are: streaming heads except the first head of every other KV group, a
// topic head (every other head when the heads do not group). With
// DefaultConfig its GQA unions at P = 0.9 cover about 16% of the tokens at
// 32768 and 50% at 131072 (streaming heads spread as the context grows);
// the captured traces' late layer is sparser still, 0.3% on average.
func LateKinds(qHeads, kvHeads int) []HeadKind {
	group := groupSize(qHeads, kvHeads)
	kinds := make([]HeadKind, qHeads)
	for h := range kinds {
		if h%group == 0 && (h/group)%2 == 0 {
			kinds[h] = Topic
		}
	}
	return kinds
}

// DefaultKinds returns the default head kinds: half streaming, a quarter
// retrieval and a quarter topic heads, arranged so that every KV group of
// at least four heads holds all three kinds, in an order that shifts from
// group to group.
func DefaultKinds(qHeads, kvHeads int) []HeadKind {
	group := groupSize(qHeads, kvHeads)
	kinds := make([]HeadKind, qHeads)
	for h := range kinds {
		shift := h / group // the order shifts from group to group
		if group == 1 {
			shift = 0
		}
		kinds[h] = kindPattern[(h+shift)%len(kindPattern)]
	}
	return kinds
}

// groupSize returns the query heads per KV head, 1 when they do not divide.
func groupSize(qHeads, kvHeads int) int {
	if kvHeads > 0 && qHeads%kvHeads == 0 {
		return qHeads / kvHeads
	}
	return 1
}

// kindPattern is the mix of DefaultKinds and GroupedKinds.
var kindPattern = [...]HeadKind{Streaming, Retrieval, Streaming, Topic}

// Limits that keep the arithmetic of Generate sound.
const (
	maxElements = 1 << 36 // keys, values or queries in one trace
	maxWindow   = 1 << 24
)

// validate reports the first problem with c.
func (c *Config) validate() error {
	switch {
	case c.KVHeads <= 0 || c.QHeads <= 0 || c.Tokens <= 0 || c.Queries <= 0:
		return fmt.Errorf("workload: KVHeads %d, QHeads %d, Tokens %d and Queries %d must be positive", c.KVHeads, c.QHeads, c.Tokens, c.Queries)
	case c.QHeads%c.KVHeads != 0:
		return fmt.Errorf("workload: QHeads %d is not a multiple of KVHeads %d", c.QHeads, c.KVHeads)
	case c.HeadDim < 8 || c.HeadDim%2 != 0:
		return fmt.Errorf("workload: HeadDim %d must be even and at least 8", c.HeadDim)
	case c.Queries > c.Tokens:
		return fmt.Errorf("workload: Queries %d exceeds Tokens %d", c.Queries, c.Tokens)
	case c.Tokens > math.MaxInt32:
		return fmt.Errorf("workload: Tokens %d does not fit the int32 query positions", c.Tokens)
	case c.KVHeads > maxElements/c.HeadDim/c.Tokens || c.QHeads > maxElements/c.HeadDim/c.Queries:
		return fmt.Errorf("workload: %d×%d×%d keys or %d×%d×%d queries exceed %d elements", c.KVHeads, c.Tokens, c.HeadDim, c.Queries, c.QHeads, c.HeadDim, maxElements)
	case !(c.RopeTheta > 1) || math.IsInf(c.RopeTheta, 0):
		return fmt.Errorf("workload: RopeTheta %g must be a finite number above 1", c.RopeTheta)
	case c.Sinks < 0 || c.Sinks > c.Tokens:
		return fmt.Errorf("workload: Sinks %d outside [0, Tokens %d]", c.Sinks, c.Tokens)
	case c.Topics <= 0:
		return fmt.Errorf("workload: Topics %d must be positive", c.Topics)
	case !(c.TopicRun >= 1) || math.IsInf(c.TopicRun, 0):
		return fmt.Errorf("workload: TopicRun %g must be a finite number of at least 1", c.TopicRun)
	case c.Window <= 0 || c.Window > maxWindow:
		return fmt.Errorf("workload: Window %d outside [1, %d]", c.Window, maxWindow)
	case !(c.QueryCorrelation >= 0 && c.QueryCorrelation < 1):
		return fmt.Errorf("workload: QueryCorrelation %g outside [0, 1)", c.QueryCorrelation)
	case c.Kinds != nil && len(c.Kinds) != c.QHeads:
		return fmt.Errorf("workload: %d Kinds for %d query heads", len(c.Kinds), c.QHeads)
	}
	for h, k := range c.Kinds {
		if k < 0 || int(k) >= len(kindNames) {
			return fmt.Errorf("workload: Kinds[%d] = %d is not a head kind", h, int(k))
		}
	}
	switch {
	case c.Profiles != nil && len(c.Profiles) != c.QHeads:
		return fmt.Errorf("workload: %d Profiles for %d query heads", len(c.Profiles), c.QHeads)
	case !(c.GroupShare >= 0 && c.GroupShare <= 1):
		return fmt.Errorf("workload: GroupShare %g outside [0, 1]", c.GroupShare)
	case !(c.SemanticNoise >= 0) || math.IsInf(c.SemanticNoise, 0):
		return fmt.Errorf("workload: SemanticNoise %g must be a finite number ≥ 0", c.SemanticNoise)
	}
	for h, p := range c.Profiles {
		if err := p.validate(); err != nil {
			return fmt.Errorf("workload: Profiles[%d]: %w", h, err)
		}
	}
	return nil
}

// maxLogit bounds the logits of a Profile, far above anything useful, so
// that the queries stay finite in float32.
const maxLogit = 1000

func (p *Profile) validate() error {
	ok := func(x float64) bool { return math.Abs(x) <= maxLogit }
	switch {
	case !ok(p.Sink) || !ok(p.Positional) || !ok(p.Local):
		return fmt.Errorf("Sink %g, Positional %g and Local %g must lie in [-%d, %d]", p.Sink, p.Positional, p.Local, maxLogit, maxLogit)
	case !(p.Random >= 0 && p.Random <= maxLogit) || !(p.Context >= 0 && p.Context <= maxLogit):
		return fmt.Errorf("Random %g and Context %g must lie in [0, %d]", p.Random, p.Context, maxLogit)
	case !(p.SinkMass >= 0 && p.SinkMass < 1):
		return fmt.Errorf("SinkMass %g outside [0, 1)", p.SinkMass)
	case len(p.Topics) > maxGroupTopics:
		return fmt.Errorf("%d topics, more than %d", len(p.Topics), maxGroupTopics)
	}
	for _, x := range p.Topics {
		if !ok(x) {
			return fmt.Errorf("topic logit %g outside [-%d, %d]", x, maxLogit, maxLogit)
		}
	}
	return nil
}

// Key construction, in the units of one key element. The bands are
// disjoint sets of RoPE pairs (see bandsOf).
const (
	sinkNorm       = 64.0 // norm of the first sink's key along the sink direction
	topicNorm      = 3.0  // norm of a topic direction's contribution to a key
	positionalAmp  = 1.0  // amplitude of each pair of the shared positional vector
	contextStd     = 0.5  // std per element of the local context, fast band
	noiseFast      = 0.25 // std of key noise per element, fast band
	noiseSemantic  = 1.0  // std of key noise per element, semantic band
	sinkValueScale = 0.2  // sink values are smaller than the others, as in real models

	// positionalMinFreq is the slowest RoPE frequency, in radians per
	// token, of the positional pairs.
	positionalMinFreq = 1.0 / 32
)

// profiles gives the profile of each kind of query head.
var profiles = [...]Profile{
	Streaming: {Sink: 14, Positional: 2, Local: 7.5, Random: 0.3},
	Retrieval: {Sink: 8, Positional: 1, Local: 1, Random: 1.5},
	Topic:     {Sink: 9, Positional: 1, Local: 2, Topics: []float64{4, 3}, Random: 0.7},
}

// bands splits the head's RoPE pairs, fastest first: pairs [0, sem) are
// the fast band, of which [0, pos) are the positional pairs, and pairs
// [sem, half) are the slow, semantic band.
type bands struct{ half, pos, sem int }

func bandsOf(cfg *Config) bands {
	half := cfg.HeadDim / 2
	b := bands{half: half, sem: half - max(2, half/4)}
	for b.pos < half && ropeFreq(cfg, b.pos) >= positionalMinFreq {
		b.pos++
	}
	b.pos = min(max(b.pos, 1), b.sem)
	return b
}

// elems returns the element indices of pairs [from, to).
func (b bands) elems(from, to int) []int {
	var idx []int
	for j := from; j < to; j++ {
		idx = append(idx, j, j+b.half)
	}
	return idx
}

// ropeFreq returns θ_j = theta^(-2j/HeadDim), the angle pair j turns by per
// token.
func ropeFreq(cfg *Config, pair int) float64 {
	return math.Pow(cfg.RopeTheta, -2*float64(pair)/float64(cfg.HeadDim))
}

// rotate applies RoPE at position pos to x in place (rotate-half layout:
// pair j is elements j and j+HeadDim/2).
func rotate(x []float64, freqs []float64, pos int) {
	half := len(freqs)
	for j, f := range freqs {
		sin, cos := math.Sincos(float64(pos) * f)
		a, b := x[j], x[j+half]
		x[j], x[j+half] = a*cos-b*sin, a*sin+b*cos
	}
}

// headDirections holds one KV head's latent directions, before RoPE.
type headDirections struct {
	sink       []float64   // unit vector in the slowest pairs
	positional []float64   // shared positional vector, positional pairs
	topics     [][]float64 // unit vectors in the semantic band, orthogonal to sink
}

// randomUnit returns a random unit vector of length dim that is zero
// outside the elements idx and orthogonal to the unit vector avoid (if
// not nil).
func randomUnit(rng *rand.Rand, dim int, idx []int, avoid []float64) []float64 {
	v := make([]float64, dim)
	for _, i := range idx {
		v[i] = rng.NormFloat64()
	}
	if avoid != nil {
		var dot float64
		for i := range v {
			dot += v[i] * avoid[i]
		}
		for i := range v {
			v[i] -= dot * avoid[i]
		}
	}
	var norm float64
	for _, x := range v {
		norm += x * x
	}
	norm = math.Sqrt(norm)
	for i := range v {
		v[i] /= norm
	}
	return v
}

func newHeadDirections(rng *rand.Rand, b bands, topics int) headDirections {
	// The sink direction lives in the slowest half of the semantic band,
	// which barely turns over a long context, so every query position sees
	// the sinks alike.
	semantic := b.elems(b.sem, b.half)
	slowest := b.elems(b.half-max(1, (b.half-b.sem)/2), b.half)
	d := headDirections{
		sink:       randomUnit(rng, 2*b.half, slowest, nil),
		positional: make([]float64, 2*b.half),
	}
	for j := 0; j < b.pos; j++ {
		sin, cos := math.Sincos(2 * math.Pi * rng.Float64())
		d.positional[j], d.positional[j+b.half] = positionalAmp*cos, positionalAmp*sin
	}
	for range topics {
		d.topics = append(d.topics, randomUnit(rng, 2*b.half, semantic, d.sink))
	}
	return d
}

// Random streams: each part of the layer draws from its own stream of the
// seed, so the parts can be generated in parallel and stay deterministic.
const (
	streamTopics = iota
	streamDirections
	streamQueries
	streamKeys // streamKeys+h for KV head h

	// streamGroupQueries draws the parts of the queries that the heads of
	// a KV group share (Config.GroupShare, Config.GroupTopics).
	streamGroupQueries = 1 << 40
)

func newRand(seed int64, stream int) *rand.Rand {
	return rand.New(rand.NewPCG(uint64(seed), uint64(stream)))
}

// Generate builds a synthetic attention layer as described in the package
// documentation. The same config always gives the same trace.
func Generate(cfg Config) (*trace.Trace, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	kinds := cfg.Kinds
	if kinds == nil {
		kinds = DefaultKinds(cfg.QHeads, cfg.KVHeads)
	}
	b := bandsOf(&cfg)
	freqs := make([]float64, b.half)
	for j := range freqs {
		freqs[j] = ropeFreq(&cfg, j)
	}
	topicOf := topicSequence(&cfg)
	dirRng := newRand(cfg.Seed, streamDirections)
	dirs := make([]headDirections, cfg.KVHeads)
	for h := range dirs {
		dirs[h] = newHeadDirections(dirRng, b, cfg.Topics)
	}

	t := &trace.Trace{
		KVHeads: cfg.KVHeads, QHeads: cfg.QHeads, HeadDim: cfg.HeadDim, Tokens: cfg.Tokens,
		K:     make([]uint16, cfg.KVHeads*cfg.Tokens*cfg.HeadDim),
		V:     make([]uint16, cfg.KVHeads*cfg.Tokens*cfg.HeadDim),
		Scale: 1 / math.Sqrt(float64(cfg.HeadDim)),
	}
	contexts := make([][][]float64, cfg.KVHeads)
	var wg sync.WaitGroup
	for h := range dirs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			n := cfg.Tokens * cfg.HeadDim
			contexts[h] = fillKeysValues(&cfg, b, freqs, &dirs[h], topicOf, newRand(cfg.Seed, streamKeys+h),
				t.K[h*n:(h+1)*n], t.V[h*n:(h+1)*n])
		}()
	}
	wg.Wait()

	t.QPos = make([]int32, cfg.Queries)
	for i := range t.QPos {
		t.QPos[i] = int32(cfg.Tokens - cfg.Queries + i)
	}
	var parts []queryParts
	t.Q, parts = makeQueries(&cfg, b, freqs, dirs, contexts, topicOf, kinds, t.QPos, newRand(cfg.Seed, streamQueries))
	if cfg.Profiles != nil {
		calibrateQueries(&cfg, dirs, parts, t)
	}

	names := make([]string, len(kinds))
	for h, k := range kinds {
		names[h] = k.String()
	}
	t.Meta = map[string]string{
		"generator":  "vksparse/workload",
		"seed":       strconv.FormatInt(cfg.Seed, 10),
		"rope":       "rotate-half",
		"rope_theta": strconv.FormatFloat(cfg.RopeTheta, 'g', -1, 64),
		"sinks":      strconv.Itoa(cfg.Sinks),
		"head_kinds": strings.Join(names, ","),
	}
	if err := t.Validate(); err != nil {
		return nil, errors.Join(errors.New("workload: generated an invalid trace"), err)
	}
	return t, nil
}

// KindsOf returns the head kinds recorded in a generated trace's metadata.
func KindsOf(t *trace.Trace) ([]HeadKind, error) {
	s, ok := t.Meta["head_kinds"]
	if !ok {
		return nil, errors.New("workload: trace has no head_kinds metadata")
	}
	names := strings.Split(s, ",")
	if len(names) != t.QHeads {
		return nil, fmt.Errorf("workload: head_kinds lists %d kinds for %d query heads", len(names), t.QHeads)
	}
	kinds := make([]HeadKind, len(names))
	for h, name := range names {
		k, err := ParseHeadKind(name)
		if err != nil {
			return nil, err
		}
		kinds[h] = k
	}
	return kinds, nil
}

// topicSequence returns each token's topic: -1 for sinks, then runs of
// one topic whose lengths are geometric with mean TopicRun.
func topicSequence(cfg *Config) []int {
	rng := newRand(cfg.Seed, streamTopics)
	topicOf := make([]int, cfg.Tokens)
	current := rng.IntN(cfg.Topics)
	for n := range topicOf {
		if n < cfg.Sinks {
			topicOf[n] = -1
			continue
		}
		if rng.Float64() < 1/cfg.TopicRun {
			current = rng.IntN(cfg.Topics)
		}
		topicOf[n] = current
	}
	return topicOf
}

func (c *Config) semanticNoise() float64 {
	if c.SemanticNoise == 0 {
		return noiseSemantic
	}
	return c.SemanticNoise
}

// keyNoiseStd returns the std of key noise for each element.
func keyNoiseStd(cfg *Config, b bands) []float64 {
	std := make([]float64, 2*b.half)
	for j := range b.half {
		s := cfg.semanticNoise()
		if j < b.sem {
			s = noiseFast
		}
		std[j], std[j+b.half] = s, s
	}
	return std
}

// localContext is the slowly varying context vector added to the keys
// after RoPE, in the fast band: every element is a stationary cascade of
// two AR(1) processes with coefficient rho = exp(-2/Window), so its
// correlation at distance Δ is about (1+2Δ/Window)·exp(-2Δ/Window): flat
// near 0 and 0.41 at Δ = Window.
type localContext struct {
	rho, norm float64
	idx       []int
	u, w      []float64 // the two stages, per element of idx
}

func newLocalContext(rng *rand.Rand, b bands, window int) *localContext {
	rho := math.Exp(-2 / float64(window))
	r2 := rho * rho
	c := &localContext{
		rho: rho,
		// Var(w) = (1+rho²)/(1-rho²)³ for unit innovations.
		norm: contextStd * math.Sqrt(math.Pow(1-r2, 3)/(1+r2)),
		idx:  b.elems(0, b.sem),
	}
	// Start from the stationary law: u ~ N(0, 1/(1-rho²)) and, given u,
	// w ~ N(u/(1-rho²), rho²/(1-rho²)³).
	for range c.idx {
		u := rng.NormFloat64() / math.Sqrt(1-r2)
		w := u/(1-r2) + rng.NormFloat64()*rho/math.Sqrt(math.Pow(1-r2, 3))
		c.u, c.w = append(c.u, u), append(c.w, w)
	}
	return c
}

// addTo adds the current context vector to x.
func (c *localContext) addTo(x []float64) {
	for k, i := range c.idx {
		x[i] += c.norm * c.w[k]
	}
}

// step advances the context by one token.
func (c *localContext) step(rng *rand.Rand) {
	for k := range c.idx {
		c.u[k] = c.rho*c.u[k] + rng.NormFloat64()
		c.w[k] = c.rho*c.w[k] + c.u[k]
	}
}

// fillKeysValues writes one KV head's keys and values as fp16, and returns
// the local-context vectors at the query positions, the last Queries
// tokens.
func fillKeysValues(cfg *Config, b bands, freqs []float64, dirs *headDirections, topicOf []int, rng *rand.Rand, k, v []uint16) [][]float64 {
	d := cfg.HeadDim
	noise := keyNoiseStd(cfg, b)
	ctx := newLocalContext(rng, b, cfg.Window)
	var queryContexts [][]float64
	key := make([]float64, d)
	for n := range cfg.Tokens {
		for i := range key {
			key[i] = noise[i] * rng.NormFloat64()
		}
		valueScale := 1.0
		if n < cfg.Sinks {
			// Sinks are special tokens: a strong sink direction, fading
			// over the first sinks, and no other part.
			valueScale = sinkValueScale
			strength := sinkNorm / (1 + float64(n)/4)
			for i, s := range dirs.sink {
				key[i] += strength * s
			}
			rotate(key, freqs, n)
		} else {
			for i, p := range dirs.positional {
				key[i] += p
			}
			strength := topicNorm * (0.75 + 0.5*rng.Float64())
			for i, s := range dirs.topics[topicOf[n]] {
				key[i] += strength * s
			}
			rotate(key, freqs, n)
			ctx.addTo(key)
		}
		if n >= cfg.Tokens-cfg.Queries {
			c := make([]float64, d)
			ctx.addTo(c)
			queryContexts = append(queryContexts, c)
		}
		ctx.step(rng)
		for i := range d {
			k[n*d+i] = float16.Fromfloat32(float32(key[i])).Bits()
			v[n*d+i] = float16.Fromfloat32(float32(valueScale * rng.NormFloat64())).Bits()
		}
	}
	return queryContexts
}

// makeQueries returns the decode queries, [Queries][QHeads][HeadDim]. A
// head's query at step i is the RoPE rotation, at its position, of a part
// fixed by its profile (positional and topic directions) plus random parts
// that follow an AR(1) process from step to step; then the local context
// at its position is added, like for the keys, and the component along the
// sinks' key direction is set to give the profile's sink logit (the sinks'
// large keys would turn any stray part along it into a large random sink
// logit).
func makeQueries(cfg *Config, b bands, freqs []float64, dirs []headDirections, contexts [][][]float64, topicOf []int, kinds []HeadKind, qpos []int32, rng *rand.Rand) ([]float32, []queryParts) {
	d := cfg.HeadDim
	scale := 1 / math.Sqrt(float64(d))
	group := cfg.QHeads / cfg.KVHeads
	var positionalNorm2 float64
	for _, p := range dirs[0].positional {
		positionalNorm2 += p * p
	}
	// The random part has std randomStd per element of randomIdx (all but
	// the positional pairs); its logit has std randomStd·scale·sqrt(sum of
	// the key variances over randomIdx). The context part likewise over
	// contextIdx, the fast band outside the positional pairs.
	randomIdx := b.elems(b.pos, b.half)
	contextIdx := b.elems(b.pos, b.sem)
	semanticDims := float64(2 * (b.half - b.sem))
	var keyVariance float64
	for _, i := range randomIdx {
		if i%b.half < b.sem {
			keyVariance += contextStd*contextStd + noiseFast*noiseFast
		} else {
			keyVariance += cfg.semanticNoise()*cfg.semanticNoise() + topicNorm*topicNorm/semanticDims
		}
	}
	contextVariance := float64(len(contextIdx)) * (contextStd*contextStd + noiseFast*noiseFast)

	rho := cfg.QueryCorrelation
	innovation := math.Sqrt(1 - rho*rho)
	// Parts shared by the heads of a KV group come from their own stream,
	// drawn only when asked for, so that configs without them give the
	// same queries as before.
	var shared *groupParts
	if cfg.GroupShare > 0 || cfg.GroupTopics {
		shared = newGroupParts(cfg, d, randomIdx, contextIdx, topicOf, len(qpos), rho)
	}
	ownShare := math.Sqrt(1 - cfg.GroupShare)
	groupShare := math.Sqrt(cfg.GroupShare)

	q := make([]float32, len(qpos)*cfg.QHeads*d)
	var parts []queryParts
	if cfg.Profiles != nil {
		parts = make([]queryParts, len(qpos)*cfg.QHeads)
	}
	for h, kind := range kinds {
		p := profiles[kind]
		if cfg.Profiles != nil {
			p = cfg.Profiles[h]
		}
		kv := h / group
		dir := &dirs[kv]
		fixed := make([]float64, d)
		for i := range fixed {
			fixed[i] = p.Positional / (scale * positionalNorm2) * dir.positional[i]
		}
		previous := -1
		for j, logit := range p.Topics {
			var topic int
			if cfg.GroupTopics {
				topic = shared.topics[kv][j%len(shared.topics[kv])]
			} else {
				topic = rng.IntN(cfg.Topics)
				if topic == previous {
					topic = (topic + 1) % cfg.Topics
				}
				previous = topic
			}
			for i, s := range dir.topics[topic] {
				fixed[i] += logit / (scale * topicNorm) * s
			}
		}
		randomStd := p.Random / (scale * math.Sqrt(keyVariance))
		contextRandomStd := p.Context / (scale * math.Sqrt(contextVariance))
		random := make([]float64, d)
		context := make([]float64, d)
		vec := make([]float64, d)
		for step, pos := range qpos {
			for _, i := range randomIdx {
				if step == 0 {
					random[i] = randomStd * rng.NormFloat64()
				} else {
					random[i] = rho*random[i] + innovation*randomStd*rng.NormFloat64()
				}
			}
			if p.Context != 0 {
				for _, i := range contextIdx {
					if step == 0 {
						context[i] = rng.NormFloat64()
					} else {
						context[i] = rho*context[i] + innovation*rng.NormFloat64()
					}
				}
			}
			for i := range vec {
				vec[i] = fixed[i]
			}
			var rpart, cpart []float64
			if parts != nil {
				rpart, cpart = make([]float64, d), make([]float64, d)
			}
			for _, i := range randomIdx {
				x := random[i]
				if shared != nil {
					x = ownShare*x + groupShare*randomStd*shared.random[kv][step][i]
				}
				vec[i] += x
				if rpart != nil {
					rpart[i] = x
				}
			}
			if p.Context != 0 {
				for _, i := range contextIdx {
					c := context[i]
					if shared != nil {
						c = ownShare*c + groupShare*shared.context[kv][step][i]
					}
					vec[i] += contextRandomStd * c
					if cpart != nil {
						cpart[i] = contextRandomStd * c
					}
				}
			}
			rotate(vec, freqs, int(pos))
			c := contexts[kv][step]
			var c2 float64
			for _, x := range c {
				c2 += x * x
			}
			if parts != nil {
				// With a profile the random and context parts leave the
				// local context at the query's position alone, so that the
				// local part alone sets the logits of the nearest tokens.
				for _, part := range [][]float64{rpart, cpart} {
					rotate(part, freqs, int(pos))
					var along float64
					for i, x := range c {
						along += part[i] * x
					}
					for i, x := range c {
						part[i] -= along / c2 * x
						vec[i] -= along / c2 * x
					}
				}
				parts[step*cfg.QHeads+h] = queryParts{random: rpart, context: cpart}
			}
			var along float64
			for i := range vec {
				vec[i] += p.Local / (scale * c2) * c[i]
				along += vec[i] * dir.sink[i]
			}
			for i, s := range dir.sink {
				vec[i] += (p.Sink/(scale*sinkNorm) - along) * s
			}
			out := q[(step*cfg.QHeads+h)*d:]
			for i := range d {
				out[i] = float32(vec[i])
			}
		}
	}
	return q, parts
}

// queryParts holds the random and context parts of one query, after RoPE.
type queryParts struct{ random, context []float64 }

// groupParts holds the parts of the queries that the heads of each KV
// group share: unit-variance random and context parts per decode step, and
// a list of topics.
type groupParts struct {
	random, context [][][]float64 // [KV group][step][element]
	topics          [][]int       // [KV group]
}

// maxGroupTopics is the length of a group's topic list (GroupTopics), and
// groupTopicSpan the recent tokens its topics come from.
const (
	maxGroupTopics = 8
	groupTopicSpan = 4096
)

func newGroupParts(cfg *Config, d int, randomIdx, contextIdx []int, topicOf []int, steps int, rho float64) *groupParts {
	rng := newRand(cfg.Seed, streamGroupQueries)
	innovation := math.Sqrt(1 - rho*rho)
	g := &groupParts{}
	ar := func(idx []int) [][]float64 {
		out := make([][]float64, steps)
		for step := range out {
			out[step] = make([]float64, d)
			for _, i := range idx {
				if step == 0 {
					out[step][i] = rng.NormFloat64()
				} else {
					out[step][i] = rho*out[step-1][i] + innovation*rng.NormFloat64()
				}
			}
		}
		return out
	}
	// A group's topics are those of tokens drawn uniformly from the
	// groupTopicSpan tokens before the decode tail: topics of the recent
	// context, the common ones more often. (Runs of a topic far away count
	// less, as RoPE turns the semantic band over long distances.) The draws
	// skip topics already taken and give up after a while, so short
	// contexts may give fewer.
	end := cfg.Tokens - cfg.Queries
	first := max(cfg.Sinks, end-groupTopicSpan)
	for range cfg.KVHeads {
		g.random = append(g.random, ar(randomIdx))
		g.context = append(g.context, ar(contextIdx))
		var topics []int
		for try := 0; try < 64*maxGroupTopics && len(topics) < maxGroupTopics && end > first; try++ {
			t := topicOf[first+rng.IntN(end-first)]
			if !slices.Contains(topics, t) {
				topics = append(topics, t)
			}
		}
		if len(topics) == 0 {
			topics = append(topics, rng.IntN(cfg.Topics))
		}
		g.topics = append(g.topics, topics)
	}
	return g
}

// calibrateQueries makes the queries of heads with Profiles meet their
// profile exactly over the keys they attend (as stored, in fp16): it
// rescales each query's random and context parts so that the std of their
// logits over the tokens after the sinks is Random and Context, then, for
// a SinkMass, sets the part along the sinks' key direction so that the
// sinks take that share of the softmax mass. With that part s·sink/(Scale·
// sinkNorm), token n's logit is b_n + s·a_n, b_n the logit without it and
// a_n = k_n·sink/sinkNorm; Newton's method on the log-odds of the sinks'
// mass finds s.
func calibrateQueries(cfg *Config, dirs []headDirections, parts []queryParts, t *trace.Trace) {
	d, group := cfg.HeadDim, cfg.QHeads/cfg.KVHeads
	halves := halfTable()
	// slope[kv][n] = k_n·sink/sinkNorm for every token of KV head kv.
	slope := make([][]float64, cfg.KVHeads)
	parallel(cfg.KVHeads, func(kv int) {
		sink := dirs[kv].sink
		keys := t.K[kv*cfg.Tokens*d : (kv+1)*cfg.Tokens*d]
		slope[kv] = make([]float64, cfg.Tokens)
		for n := range slope[kv] {
			var dot float64
			for i, x := range keys[n*d : (n+1)*d] {
				dot += sink[i] * float64(halves[x])
			}
			slope[kv][n] = dot / sinkNorm
		}
	})
	parallel(cfg.QHeads, func(h int) {
		p := cfg.Profiles[h]
		kv := h / group
		sink := dirs[kv].sink
		keys := t.K[kv*cfg.Tokens*d : (kv+1)*cfg.Tokens*d]
		logits := func(v []float64, n, stride int) []float64 {
			out := make([]float64, 0, n/stride+1)
			for tok := 0; tok < n; tok += stride {
				var dot float64
				for i, x := range keys[tok*d : (tok+1)*d] {
					dot += v[i] * float64(halves[x])
				}
				out = append(out, dot*t.Scale)
			}
			return out
		}
		q := make([]float64, d)
		for step, pos := range t.QPos {
			out := t.Q[(step*cfg.QHeads+h)*d : (step*cfg.QHeads+h+1)*d]
			for i := range q {
				q[i] = float64(out[i])
			}
			n := int(pos) + 1
			first := min(cfg.Sinks, n-1)
			// The spread is estimated on at most about 16384 tokens.
			stride := max(1, (n-first)/16384)
			// The part along the sinks' direction is set last: take it out
			// of the query and its parts first.
			qp := parts[step*cfg.QHeads+h]
			for _, v := range [][]float64{q, qp.random, qp.context} {
				var along float64
				for i := range v {
					along += v[i] * sink[i]
				}
				for i := range v {
					v[i] -= along * sink[i]
				}
			}
			// Scale each part to its std, then both together to the std
			// of their sum had they been independent.
			skip := (first + stride - 1) / stride
			sum := make([]float64, d)
			for _, part := range []struct {
				v    []float64
				want float64
			}{{qp.random, p.Random}, {qp.context, p.Context}} {
				if sd := stdDev(logits(part.v, n, stride)[skip:]); sd > 0 {
					for i := range sum {
						sum[i] += part.want / sd * part.v[i]
						q[i] -= part.v[i]
					}
				}
			}
			if sd := stdDev(logits(sum, n, stride)[skip:]); sd > 0 {
				for i := range q {
					q[i] += math.Hypot(p.Random, p.Context) / sd * sum[i]
				}
			}
			s := p.Sink
			if p.SinkMass > 0 && cfg.Sinks > 0 && n > cfg.Sinks {
				s = solveSinkLogit(logits(q, n, 1), slope[kv][:n], cfg.Sinks, math.Log(p.SinkMass/(1-p.SinkMass)))
			}
			for i := range q {
				q[i] += s / (t.Scale * sinkNorm) * sink[i]
			}
			for i := range out {
				out[i] = float32(q[i])
			}
		}
	})
}

// parallel runs f(0) … f(n−1) on GOMAXPROCS goroutines.
func parallel(n int, f func(i int)) {
	var wg sync.WaitGroup
	next := make(chan int)
	for range min(n, runtime.GOMAXPROCS(0)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				f(i)
			}
		}()
	}
	for i := range n {
		next <- i
	}
	close(next)
	wg.Wait()
}

// stdDev returns the standard deviation of x (0 for fewer than two).
func stdDev(x []float64) float64 {
	if len(x) < 2 {
		return 0
	}
	var mean, m2 float64
	for _, v := range x {
		mean += v
	}
	mean /= float64(len(x))
	for _, v := range x {
		m2 += (v - mean) * (v - mean)
	}
	return math.Sqrt(m2 / float64(len(x)))
}

// solveSinkLogit returns S such that the log-odds of the softmax mass of
// tokens [0, sinks) over the rest, with logits base[n] + S·slope[n], is
// target.
func solveSinkLogit(base, slope []float64, sinks int, target float64) float64 {
	// lse returns the log of Σ exp(base+S·slope) over tokens [lo, hi) and
	// the softmax-weighted mean of slope there.
	lse := func(s float64, lo, hi int) (float64, float64) {
		m := math.Inf(-1)
		for n := lo; n < hi; n++ {
			m = max(m, base[n]+s*slope[n])
		}
		var z, zs float64
		for n := lo; n < hi; n++ {
			e := math.Exp(base[n] + s*slope[n] - m)
			z += e
			zs += e * slope[n]
		}
		return m + math.Log(z), zs / z
	}
	if sinks >= len(base) {
		return 0
	}
	s := 10.0
	for range 50 {
		ls, ds := lse(s, 0, sinks)
		lr, dr := lse(s, sinks, len(base))
		f, df := ls-lr-target, ds-dr
		if df <= 0 {
			break
		}
		step := f / df
		s -= step
		if math.Abs(step) < 1e-6 {
			break
		}
	}
	return s
}
