package workload

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
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

// profile gives, in logit units (q·k·Scale), what a kind of query head
// gets from each part of the keys.
type profile struct {
	sink       float64   // logit of the first sink
	positional float64   // logit from the positional pairs at distance 0
	local      float64   // logit from the local context at distance 0
	topics     []float64 // logits of nearby tokens of the head's topics
	random     float64   // std over tokens of the logit from the random part
}

var profiles = [...]profile{
	Streaming: {sink: 14, positional: 2, local: 7.5, random: 0.3},
	Retrieval: {sink: 8, positional: 1, local: 1, random: 1.5},
	Topic:     {sink: 9, positional: 1, local: 2, topics: []float64{4, 3}, random: 0.7},
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
	t.Q = makeQueries(&cfg, b, freqs, dirs, contexts, kinds, t.QPos, newRand(cfg.Seed, streamQueries))

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

// keyNoiseStd returns the std of key noise for each element.
func keyNoiseStd(b bands) []float64 {
	std := make([]float64, 2*b.half)
	for j := range b.half {
		s := noiseSemantic
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
	noise := keyNoiseStd(b)
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
// fixed by its kind's profile (positional and topic directions) plus a
// random part that follows an AR(1) process from step to step; then the
// local context at its position is added, like for the keys, and the
// component along the sinks' key direction is set to give the profile's
// sink logit (the sinks' large keys would turn any stray part along it
// into a large random sink logit).
func makeQueries(cfg *Config, b bands, freqs []float64, dirs []headDirections, contexts [][][]float64, kinds []HeadKind, qpos []int32, rng *rand.Rand) []float32 {
	d := cfg.HeadDim
	scale := 1 / math.Sqrt(float64(d))
	group := cfg.QHeads / cfg.KVHeads
	var positionalNorm2 float64
	for _, p := range dirs[0].positional {
		positionalNorm2 += p * p
	}
	// The random part has std randomStd per element of randomIdx (all but
	// the positional pairs); its logit has std randomStd·scale·sqrt(sum of
	// the key variances over randomIdx).
	randomIdx := b.elems(b.pos, b.half)
	semanticDims := float64(2 * (b.half - b.sem))
	var keyVariance float64
	for _, i := range randomIdx {
		if i%b.half < b.sem {
			keyVariance += contextStd*contextStd + noiseFast*noiseFast
		} else {
			keyVariance += noiseSemantic*noiseSemantic + topicNorm*topicNorm/semanticDims
		}
	}

	q := make([]float32, len(qpos)*cfg.QHeads*d)
	rho := cfg.QueryCorrelation
	innovation := math.Sqrt(1 - rho*rho)
	for h, kind := range kinds {
		p := profiles[kind]
		kv := h / group
		dir := &dirs[kv]
		fixed := make([]float64, d)
		for i := range fixed {
			fixed[i] = p.positional / (scale * positionalNorm2) * dir.positional[i]
		}
		previous := -1
		for _, logit := range p.topics {
			topic := rng.IntN(cfg.Topics)
			if topic == previous {
				topic = (topic + 1) % cfg.Topics
			}
			previous = topic
			for i, s := range dir.topics[topic] {
				fixed[i] += logit / (scale * topicNorm) * s
			}
		}
		randomStd := p.random / (scale * math.Sqrt(keyVariance))
		random := make([]float64, d)
		vec := make([]float64, d)
		for step, pos := range qpos {
			for _, i := range randomIdx {
				if step == 0 {
					random[i] = randomStd * rng.NormFloat64()
				} else {
					random[i] = rho*random[i] + innovation*randomStd*rng.NormFloat64()
				}
			}
			for i := range vec {
				vec[i] = fixed[i] + random[i]
			}
			rotate(vec, freqs, int(pos))
			c := contexts[kv][step]
			var c2 float64
			for _, x := range c {
				c2 += x * x
			}
			var along float64
			for i := range vec {
				vec[i] += p.local / (scale * c2) * c[i]
				along += vec[i] * dir.sink[i]
			}
			for i, s := range dir.sink {
				vec[i] += (p.sink/(scale*sinkNorm) - along) * s
			}
			out := q[(step*cfg.QHeads+h)*d:]
			for i := range d {
				out[i] = float32(vec[i])
			}
		}
	}
	return q
}
