#version 450
// DELTA's page scores at a Δ-layer (the DELTA paper, section 4): for every token t < n of
// one sequence's layer, s_t = max over query heads h of exp(l_{h,t} − L_h),
// the attention weight head h gives token t, from the logits l_{h,t} =
// scale·q_h·k_t that the dense attention of the same queries wrote
// (LOGITS) and L_h = M + ln Σ_c exp(m_c − M)·l_c, the log of its softmax's
// normaliser, folded from that attention's chunk partials (max m_c, sum
// l_c; M = max_c m_c; chunks with m_c = −∞ add nothing); and page u's score
// is S_u = Σ s_t over its tokens t ∈ [uP, uP + P) ∩ [0, n). A workgroup
// takes WG consecutive tokens (WG / P pages), a thread one token.

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 256;  // threads, a multiple of P, at least HQ
layout(constant_id = 1) const uint HQ = 32;   // query heads
layout(constant_id = 2) const uint P = 16;    // tokens a page

layout(std430, binding = 0) readonly buffer Logits { float logit[]; };  // [HQ][n]
layout(std430, binding = 1) readonly buffer Partials { vec2 ml[]; };    // [HQ][maxChunks]: (m, l)
layout(std430, binding = 2) writeonly buffer Pages { float pages[]; };  // [⌈n/P⌉]

layout(push_constant) uniform Push {
	uint n;
	uint chunks;     // chunks of the partials to fold
	uint maxChunks;  // the partials' stride per head
} pc;

shared float lse[HQ];
shared vec2 parts[WG];
shared float ts[WG];

void main() {
	uint tid = gl_LocalInvocationID.x;
	// The normalisers: WG / HQ threads a head each fold every
	// (WG / HQ)-th chunk, then one folds their parts.
	const float NEG = -1.0 / 0.0;
	const uint PER = WG / HQ;
	uint h = tid / PER, part = tid % PER;
	vec2 acc = vec2(NEG, 0.0);  // (max, Σ exp(m − max)·l)
	if (h < HQ) {
		for (uint c = part; c < pc.chunks; c += PER) {
			vec2 x = ml[h * pc.maxChunks + c];
			if (x.x == NEG) continue;
			float M = max(acc.x, x.x);
			acc = vec2(M, acc.y * exp(acc.x - M) + x.y * exp(x.x - M));
		}
	}
	parts[tid] = acc;
	barrier();
	if (tid < HQ) {
		vec2 a = vec2(NEG, 0.0);
		for (uint i = 0; i < PER; i++) {
			vec2 x = parts[tid * PER + i];
			if (x.x == NEG) continue;
			float M = max(a.x, x.x);
			a = vec2(M, a.y * exp(a.x - M) + x.y * exp(x.x - M));
		}
		lse[tid] = a.x + log(a.y);
	}
	barrier();
	uint t = gl_WorkGroupID.x * WG + tid;
	float s = 0.0;
	if (t < pc.n) {
		for (uint h = 0; h < HQ; h++) s = max(s, exp(logit[h * pc.n + t] - lse[h]));
	}
	ts[tid] = s;
	barrier();
	if (tid % P == 0 && t < pc.n) {
		float sum = 0.0;
		for (uint j = 0; j < P; j++) sum += ts[tid + j];  // 0 past n
		pages[t / P] = sum;
	}
}
