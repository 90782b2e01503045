package workload

import (
	"fmt"
	"math"
	"slices"
	"strings"
)

// Calibrated layers: configs whose per-head sparsity, as Tactic's
// selection measures it, follows what the Tactic paper reports for real
// models (see the package documentation, "Calibrated layers").

// LlamaConfig returns a layer calibrated to Llama-3.1-8B-Instruct on
// RULER (Tactic paper, Appendix B, Table 9): 8 KV heads, 32 query heads,
// head dim 128 as DefaultConfig, LlamaHeads' heads, GroupShare 0.9 and
// GroupTopics. Its keys differ from DefaultConfig's in two ways: semantic
// noise 0.5, so that keys cluster by topic as real keys cluster by
// content, and one topic per 256 tokens (at least 32), so that a topic
// covers about the same number of tokens at every length (what a head
// focuses on does not grow with the context).
func LlamaConfig(tokens int) Config {
	cfg := DefaultConfig(tokens)
	cfg.Topics = max(32, tokens/256)
	cfg.SemanticNoise = 0.5
	cfg.GroupShare = 0.9
	cfg.GroupTopics = true
	cfg.Kinds, cfg.Profiles = LlamaHeads(tokens, cfg.QHeads, cfg.KVHeads)
	return cfg
}

// LlamaHeads returns the kinds and profiles of LlamaConfig's query heads
// for a layer of the given length and shape: KV group g takes the
// character llamaGroups[g mod 8] and its j-th query head that
// character's head j mod 4 (so with one query head per KV head, head h is
// the first head of character h mod 8). The kinds label the heads: sink
// heads Streaming, focus heads Topic, diffuse heads Retrieval.
func LlamaHeads(tokens, qHeads, kvHeads int) ([]HeadKind, []Profile) {
	return presetHeads(llamaGroups[:], llamaSharpening, tokens, qHeads, kvHeads)
}

// MegaBeamConfig returns a layer calibrated to MegaBeam-Mistral-7B
// (Tactic paper, Appendix B, Table 10): LlamaConfig's keys and shape with
// MegaBeamHeads' heads, which spread their mass more widely.
func MegaBeamConfig(tokens int) Config {
	cfg := LlamaConfig(tokens)
	cfg.Kinds, cfg.Profiles = MegaBeamHeads(tokens, cfg.QHeads, cfg.KVHeads)
	return cfg
}

// MegaBeamHeads returns the kinds and profiles of MegaBeamConfig's query
// heads, laid out as LlamaHeads lays out its own: four spread heads in
// every KV group.
func MegaBeamHeads(tokens, qHeads, kvHeads int) ([]HeadKind, []Profile) {
	return presetHeads(megaBeamGroups[:], 0, tokens, qHeads, kvHeads)
}

// LayerNames lists the layers NamedConfig makes: the head-kind mixes of
// DefaultKinds ("mixed"), GroupedKinds ("grouped") and LateKinds ("late")
// on DefaultConfig, and the calibrated LlamaConfig ("llama") and
// MegaBeamConfig ("megabeam").
var LayerNames = []string{"mixed", "grouped", "late", "llama", "megabeam"}

// NamedConfig returns the layer called name (one of LayerNames) with the
// given length and shape.
func NamedConfig(name string, tokens, qHeads, kvHeads, headDim int) (Config, error) {
	var cfg Config
	switch name {
	case "mixed", "grouped", "late":
		cfg = DefaultConfig(tokens)
	case "llama":
		cfg = LlamaConfig(tokens)
	case "megabeam":
		cfg = MegaBeamConfig(tokens)
	default:
		return Config{}, fmt.Errorf("workload: unknown layer %q (want %s)", name, strings.Join(LayerNames, ", "))
	}
	cfg.QHeads, cfg.KVHeads, cfg.HeadDim = qHeads, kvHeads, headDim
	switch name {
	case "mixed":
		cfg.Kinds = DefaultKinds(qHeads, kvHeads)
	case "grouped":
		cfg.Kinds = GroupedKinds(qHeads, kvHeads)
	case "late":
		cfg.Kinds = LateKinds(qHeads, kvHeads)
	case "llama":
		cfg.Kinds, cfg.Profiles = LlamaHeads(tokens, qHeads, kvHeads)
	case "megabeam":
		cfg.Kinds, cfg.Profiles = MegaBeamHeads(tokens, qHeads, kvHeads)
	}
	return cfg, nil
}

// The heads of the calibrated layers, with their logits at
// calibrationTokens. A sink head gives the sinks the share mass of its
// attention and spreads the rest over the local window and a background;
// a focus head keeps less for the sinks and puts most of the rest on its
// KV group's first topic; diffuse and spread heads put most of their mass
// on the background, a wide one.
func sinkHead(mass float64) Profile {
	return Profile{SinkMass: mass, Positional: 2, Local: 5, Random: 0.645, Context: 1.29}
}

func focusHead(mass float64) Profile {
	return Profile{SinkMass: mass, Positional: 1, Local: 4, Topics: []float64{7.5}, Random: 0.43, Context: 1.29}
}

func diffuseHead(mass float64) Profile {
	return Profile{SinkMass: mass, Positional: 1, Local: 1.5, Random: 0.97, Context: 2.14}
}

func spreadHead(mass float64) Profile {
	return Profile{SinkMass: mass, Positional: 1, Local: 1.5, Random: 1.26, Context: 2.73}
}

// llamaGroups are the characters of LlamaHeads' KV groups, in the order
// they repeat: sharp groups (sink and focus heads that need few tokens
// even at P = 0.9), tailed groups (sink heads with a diffuse tail) and
// diffuse groups. Heads of a group are alike, as heads that share a KV
// head tend to be, so that a group's union is not much larger than its
// widest head.
var llamaGroups = [...][4]Profile{
	{sinkHead(0.95), focusHead(0.45), sinkHead(0.92), focusHead(0.3)},          // sharp
	{sinkHead(0.72), sinkHead(0.78), sinkHead(0.7), focusHead(0.4)},            // tailed
	{sinkHead(0.95), focusHead(0.45), sinkHead(0.92), focusHead(0.3)},          // sharp
	{diffuseHead(0.2), diffuseHead(0.3), diffuseHead(0.25), diffuseHead(0.35)}, // diffuse
	{sinkHead(0.72), sinkHead(0.78), sinkHead(0.7), focusHead(0.4)},            // tailed
	{sinkHead(0.95), focusHead(0.45), sinkHead(0.92), focusHead(0.3)},          // sharp
	{sinkHead(0.72), sinkHead(0.78), sinkHead(0.7), focusHead(0.4)},            // tailed
	{diffuseHead(0.2), diffuseHead(0.3), diffuseHead(0.25), diffuseHead(0.35)}, // diffuse
}

// megaBeamGroups is the one character of MegaBeamHeads' KV groups.
var megaBeamGroups = [...][4]Profile{
	{spreadHead(0.1), spreadHead(0.2), spreadHead(0.15), spreadHead(0.25)},
}

// calibrationTokens is the context length at which the presets' profiles
// are given.
const calibrationTokens = 16384

// llamaSharpening sets how LlamaHeads' random and context spreads grow
// with the context: by the factor 1 + llamaSharpening·growth(tokens). The
// selected share then falls with the length about as Table 9's does (by
// about a sixth per doubling at P = 0.9).
const llamaSharpening = 0.08

// growth returns ln(tokens/calibrationTokens), which the presets add to
// the local and topic logits: e^logit then grows like the number of
// tokens the background spreads over, so that the local window and the
// topic (whose tokens do not grow with the context) keep their share of
// the mass, as a trained model keeps finding a needle in a longer
// haystack.
func growth(tokens int) float64 {
	return math.Log(float64(max(tokens, 1)) / calibrationTokens)
}

// presetHeads lays out groups over the KV groups of the given shape,
// labels each head and moves its profile to the given length: growth
// added to the local and topic logits, the random and context spreads
// scaled by 1 + sharpening·growth.
func presetHeads(groups [][4]Profile, sharpening float64, tokens, qHeads, kvHeads int) ([]HeadKind, []Profile) {
	size := groupSize(qHeads, kvHeads)
	g := growth(tokens)
	kinds := make([]HeadKind, qHeads)
	profiles := make([]Profile, qHeads)
	for h := range profiles {
		p := groups[(h/size)%len(groups)][(h%size)%4]
		p.Topics = slices.Clone(p.Topics)
		for i := range p.Topics {
			p.Topics[i] += g
		}
		p.Local += g
		p.Random *= 1 + sharpening*g
		p.Context *= 1 + sharpening*g
		switch {
		case p.Topics != nil:
			kinds[h] = Topic
		case p.SinkMass >= 0.5:
			kinds[h] = Streaming
		default:
			kinds[h] = Retrieval
		}
		profiles[h] = p
	}
	return kinds, profiles
}
