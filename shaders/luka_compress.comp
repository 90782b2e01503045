#version 450
// LuKA's compressor: summary number s = pc.first + gl_WorkGroupID.x of KV
// head g = gl_WorkGroupID.y stands for the P tokens in slots [sP, sP + P):
//   sumK[g][s] = Σ_u π_u k_{sP+u},  sumV[g][s] = Σ_u π_u v_{sP+u}  (fp16),
// with π = softmax(λ) over the segment, by pc.mode:
//   0 (mean)      λ_u = 0;
//   1 (weighted)  λ_u = pc.invTau · Σ over the GROUP query heads of g of
//                 ring[h][slot & pc.ringMask], their accumulated cover masses;
//   2 (random)    λ = 0 at u = pick(pc.seed, g, s) and −∞ elsewhere,
//                 pick = pcg(seed ^ pcg(g · 0x9E3779B9 + s)) mod P.
// It then zeroes those tokens' ring entries (their weights are spent).
#extension GL_EXT_control_flow_attributes : enable

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 64;    // threads, at least D / 2
layout(constant_id = 1) const uint D = 128;    // head dimension, a multiple of 8
layout(constant_id = 2) const uint GROUP = 4;  // query heads per KV head
layout(constant_id = 3) const uint P = 16;     // tokens a summary stands for, at most 64

const uint HALF = D / 2;
const float NEG = -1.0 / 0.0;

layout(std430, binding = 0) readonly buffer Keys { uint k[]; };     // the layer's, [Hkv][vStride]
layout(std430, binding = 1) readonly buffer Values { uint v[]; };   // the layer's, [Hkv][vStride]
layout(std430, binding = 2) writeonly buffer SumKeys { uint sk[]; };   // [Hkv][sumStride]
layout(std430, binding = 3) writeonly buffer SumValues { uint sv[]; }; // [Hkv][sumStride]
layout(std430, binding = 4) buffer Ring { float ring[]; };          // [Hq][ringMask + 1]

layout(push_constant) uniform Push {
	uint first;      // the first summary made
	uint vStride;    // uint words between the layer's KV heads
	uint sumStride;  // uint words between the summaries' KV heads
	uint ringMask;   // ring slots − 1
	uint mode;       // 0 mean, 1 attention-weighted, 2 random
	float invTau;    // 1 / τ of the weighted compressor
	uint seed;       // the random compressor's
} pc;

shared float pi[P];

uint pcg(uint x) {
	uint state = x * 747796405u + 2891336453u;
	uint word = ((state >> ((state >> 28u) + 4u)) ^ state) * 277803737u;
	return (word >> 22u) ^ word;
}

void main() {
	uint tid = gl_LocalInvocationID.x;
	uint s = pc.first + gl_WorkGroupID.x;
	uint g = gl_WorkGroupID.y;
	uint ringSlots = pc.ringMask + 1;
	uint pick = pcg(pc.seed ^ pcg(g * 0x9E3779B9u + s)) % P;
	for (uint u = tid; u < P; u += WG) {
		float l = 0.0;
		if (pc.mode == 1) {
			uint slot = (s * P + u) & pc.ringMask;
			float w = 0.0;
			for (uint a = 0; a < GROUP; a++) w += ring[(g * GROUP + a) * ringSlots + slot];
			l = w * pc.invTau;
		} else if (pc.mode == 2) {
			l = u == pick ? 0.0 : NEG;
		}
		pi[u] = l;
	}
	barrier();
	float m = NEG;
	for (uint u = 0; u < P; u++) m = max(m, pi[u]);
	float z = 0.0;
	for (uint u = 0; u < P; u++) z += exp(pi[u] - m);
	if (tid < HALF) {
		vec2 ks = vec2(0.0), vs = vec2(0.0);
		for (uint u = 0; u < P; u++) {
			float w = exp(pi[u] - m) / z;
			uint at = g * pc.vStride + (s * P + u) * HALF + tid;
			ks += w * unpackHalf2x16(k[at]);
			vs += w * unpackHalf2x16(v[at]);
		}
		sk[g * pc.sumStride + s * HALF + tid] = packHalf2x16(ks);
		sv[g * pc.sumStride + s * HALF + tid] = packHalf2x16(vs);
	}
	barrier();
	for (uint e = tid; e < GROUP * P; e += WG) {
		uint a = e / P, u = e % P;
		ring[(g * GROUP + a) * ringSlots + ((s * P + u) & pc.ringMask)] = 0.0;
	}
}
