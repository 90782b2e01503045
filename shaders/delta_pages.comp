#version 450
// DELTA's page scores at a Δ-layer (seed 002, §4): for every token t < n of
// one sequence's layer, s_t = max over query heads h of
// exp(scale·q_h·k_{g(h),t} − L_h), the attention weight head h gives token
// t, with g(h) = h / GROUP and L_h = M + ln Σ_c exp(m_c − M)·l_c the log of
// its softmax's normaliser, folded from the chunk partials (max m_c, sum
// l_c; M = max_c m_c; chunks with m_c = −∞ add nothing) that the dense
// attention of the same queries left; and page u's score is
// S_u = Σ s_t over its tokens t ∈ [uP, uP + P) ∩ [0, n). A workgroup
// takes WG consecutive tokens (WG / P pages), a thread one token.
#extension GL_EXT_control_flow_attributes : enable

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 256;   // threads, a multiple of P, at least HQ
layout(constant_id = 1) const uint D = 128;    // head dimension, even
layout(constant_id = 2) const uint HQ = 32;    // query heads
layout(constant_id = 3) const uint GROUP = 4;  // query heads per KV head, at most 8
layout(constant_id = 4) const uint P = 16;     // tokens a page

const uint DW = D / 2;  // words per key row: fp16 pairs

layout(std430, binding = 0) readonly buffer Queries { float q[]; };     // [HQ][D]
layout(std430, binding = 1) readonly buffer Keys { uint k[]; };         // [KV][headStride]
layout(std430, binding = 2) readonly buffer Partials { vec2 ml[]; };    // [HQ][maxChunks]: (m, l)
layout(std430, binding = 3) writeonly buffer Pages { float pages[]; };  // [⌈n/P⌉]

layout(push_constant) uniform Push {
	uint n;
	uint headStride;  // words between consecutive KV heads
	uint chunks;      // chunks of the partials to fold
	uint maxChunks;   // the partials' stride per head
	float scale;
} pc;

shared float qs[HQ * D];
shared float lse[HQ];
shared float ts[WG];

void main() {
	uint tid = gl_LocalInvocationID.x;
	for (uint i = tid; i < HQ * D; i += WG) qs[i] = q[i];
	if (tid < HQ) {
		const float NEG = -1.0 / 0.0;
		float M = NEG;
		for (uint c = 0; c < pc.chunks; c++) M = max(M, ml[tid * pc.maxChunks + c].x);
		float L = 0.0;
		for (uint c = 0; c < pc.chunks; c++) {
			vec2 x = ml[tid * pc.maxChunks + c];
			if (x.x != NEG) L += exp(x.x - M) * x.y;
		}
		lse[tid] = M + log(L);
	}
	barrier();
	uint t = gl_WorkGroupID.x * WG + tid;
	float s = 0.0;
	if (t < pc.n) {
		for (uint g = 0; g < HQ / GROUP; g++) {
			float acc[GROUP];
			[[unroll]] for (uint j = 0; j < GROUP; j++) acc[j] = 0.0;
			uint row = g * pc.headStride + t * DW;
			for (uint i = 0; i < DW; i++) {
				vec2 kv = unpackHalf2x16(k[row + i]);
				[[unroll]] for (uint j = 0; j < GROUP; j++) {
					uint h = g * GROUP + j;
					acc[j] += qs[h * D + 2 * i] * kv.x + qs[h * D + 2 * i + 1] * kv.y;
				}
			}
			[[unroll]] for (uint j = 0; j < GROUP; j++) s = max(s, exp(pc.scale * acc[j] - lse[g * GROUP + j]));
		}
	}
	ts[tid] = s;
	barrier();
	if (tid % P == 0 && t < pc.n) {
		float sum = 0.0;
		for (uint j = 0; j < P; j++) sum += ts[tid + j];  // 0 past n
		pages[t / P] = sum;
	}
}
