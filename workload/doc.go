// Package workload generates synthetic attention layers, as trace.Trace
// values, that behave like one layer of a long-context LLM at decode. Tests
// and benchmarks use them when no captured trace is given.
//
// # Model
//
// RoPE uses the rotate-half layout: pair j is elements j and j+HeadDim/2
// and turns by θ_j = RopeTheta^(-2j/HeadDim) radians per token. The pairs
// fall into two bands: the fast band, the 3/4 fastest pairs, of which the
// pairs turning by at least 1/32 radian per token are the positional
// pairs; and the semantic band, the 1/4 slowest pairs, which turn little
// over a long context (with theta 500000 and HeadDim 128, the slowest half
// of it turns by less than 0.35 radian over 32768 tokens).
//
// Every KV head has its own random directions. Token n's key is, before
// RoPE at position n:
//   - a positional vector shared by all tokens (amplitude 1 per
//     positional pair, random phases);
//   - its topic's direction, a random unit vector of the semantic band,
//     times a strength drawn uniformly from [2.25, 3.75]. Topics come in
//     runs of geometric length (mean TopicRun tokens), each run on one of
//     Topics topics drawn uniformly, so the keys form clusters that
//     overlap: with the defaults a key's nearest topic centroid is its own
//     topic's for about 85% of the tokens at 32768 tokens (93% at 8192);
//   - noise, N(0, 0.25²) per element in the fast band and N(0, 1) in the
//     semantic band.
//
// After RoPE a local-context vector is added in the fast band: each element
// follows a stationary cascade of two AR(1) processes over the tokens, with
// std 0.5 and correlation (1+2Δ/W)·exp(-2Δ/W) at distance Δ for W = Window
// (1 at Δ = 0, 0.41 at Δ = W). It plays the part of the local context that
// nearby tokens share.
//
// The first Sinks tokens are attention sinks: only noise plus a large part,
// of norm 64/(1+n/4), along a sink direction in the slowest half of the
// semantic band. Values are N(0, 1) per element, except that sinks' values
// are scaled by 0.2, as sink tokens carry little in real models.
//
// # Queries
//
// The Queries decode steps sit at positions QPos[i] = Tokens-Queries+i, so
// the last Queries keys are the decode tail. Query head h uses KV head
// h/(QHeads/KVHeads) and has a kind (Config.Kinds, by default DefaultKinds:
// half streaming, a quarter retrieval, a quarter topic, mixed within every
// KV group; GroupedKinds gives the same mix with one kind per KV group;
// LateKinds a sparse late layer, streaming heads and a topic head in every
// other group). Heads that share a KV head share its keys; the kind lives in
// the query, which is built in logit units (q·k·Scale, Scale =
// 1/sqrt(HeadDim)):
//
//	                       streaming  retrieval  topic
//	first sink                14          8        9   later sinks get less
//	positional, Δ = 0          2          1        1   fades within ~30 tokens
//	local context, Δ = 0       7.5        1        2   fades over ~Window tokens
//	two topics, nearby         -          -      4, 3  fainter far away
//	random part, std           0.3        1.5      0.7
//
// The random part lives outside the positional pairs and follows an AR(1)
// process across the decode steps with correlation QueryCorrelation, so
// consecutive queries drift slowly rather than being drawn afresh; the
// local-context part follows the context at each query's position. The
// part along the sinks' key direction is set after RoPE so that every head
// likes the sinks to its profile's degree at any position.
//
// # Statistics
//
// With DefaultConfig(32768), over seeds 1 to 4 and the first and last
// decode query of every head (HeadAttention computes these), the median
// [min, max] shares of the attended tokens needed to reach a cumulative
// softmax mass P are:
//
//	           logit std          P = 0.5                 P = 0.7                P = 0.9
//	streaming  1.27 [1.04, 1.53]  0.003% [0.003, 0.006]%  0.003% [0.003, 0.02]%  0.02% [0.003, 0.32]%
//	retrieval  1.49 [1.22, 1.78]  5.7% [0.003, 11]%       14% [3.7, 24]%         40% [25, 51]%
//	topic      2.24 [1.79, 2.65]  0.6% [0.03, 1.7]%       2.3% [0.7, 6.3]%       12% [4.7, 25]%
//
// (0.003% is a single token: the first sink.) Streaming heads put a median
// 87% [24, 98]% of the mass on the 4 sinks and 9% [1, 73]% on the last 256
// tokens; retrieval heads put 6% [1, 52]% on the sinks. Shorter contexts
// and smaller head dims shift these numbers (fewer dimensions average less
// noise, so the logits spread more); the package tests check the main ones.
package workload
