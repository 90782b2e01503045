#version 450
#extension GL_EXT_control_flow_attributes : enable
// Split-K decode attention, merge pass. One workgroup per (query head,
// sequence) combines the chunks' (m, l, o) into
// out = sum_c exp(m_c - M) o_c / sum_c exp(m_c - M) l_c, M = max_c m_c.
// Threads are (chunk lane, vec4 of the output): CL = WG / (D/4) chunk lanes
// each sum every CL-th chunk, then the lanes are added. A chunk with
// m_c = −∞ attended nothing: its o_c is not read (it may be unwritten).

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 256;  // a power of two, at least D/4
layout(constant_id = 1) const uint D = 128;

const uint D4 = D / 4;
const uint CL = WG / D4;

layout(std430, binding = 0) readonly buffer PartialO { vec4 po[]; };   // [B][Hq][maxChunks][D/4]
layout(std430, binding = 1) readonly buffer PartialML { vec2 pml[]; }; // [B][Hq][maxChunks]
layout(std430, binding = 2) readonly buffer Chunks { uint chunks[]; };  // [B][KV heads] chunks (or tokens) used
layout(std430, binding = 3) writeonly buffer Out { vec4 o[]; };        // [B][Hq][D/4]

layout(push_constant) uniform Push {
	uint maxChunks;
	uint qHeads;
	uint groupSize;  // query heads per KV head
	uint chunkTokens;  // 0: Chunks holds chunk counts; else token counts, split as attend_partial's GATHER does
} pc;

shared float red[WG];
shared vec4 part[WG];

void main() {
	uint tid = gl_LocalInvocationID.x;
	uint h = gl_WorkGroupID.x;
	uint b = gl_WorkGroupID.y;
	uint n = chunks[b * (pc.qHeads / pc.groupSize) + h / pc.groupSize];
	if (pc.chunkTokens > 0) {
		uint total = 0;
		for (uint g = 0; g < pc.qHeads / pc.groupSize; g++) total += chunks[b * (pc.qHeads / pc.groupSize) + g];
		uint chunk = max(pc.chunkTokens, (total + pc.maxChunks - 1) / pc.maxChunks);
		n = (n + chunk - 1) / chunk;
	}
	uint base = (b * pc.qHeads + h) * pc.maxChunks;

	float m = -1.0 / 0.0;
	for (uint c = tid; c < n; c += WG) m = max(m, pml[base + c].x);
	red[tid] = m;
	barrier();
	for (uint s = WG / 2; s > 0; s >>= 1) {
		if (tid < s) red[tid] = max(red[tid], red[tid + s]);
		barrier();
	}
	float M = red[0];
	barrier();
	float l = 0.0;
	for (uint c = tid; c < n; c += WG) {
		vec2 ml = pml[base + c];
		l += exp(ml.x - M) * ml.y;
	}
	red[tid] = l;
	barrier();
	for (uint s = WG / 2; s > 0; s >>= 1) {
		if (tid < s) red[tid] += red[tid + s];
		barrier();
	}
	float L = red[0];

	uint lane = tid / D4;
	uint j = tid % D4;
	vec4 acc = vec4(0.0);
	if (lane < CL) {
		// Eight chunks' loads in flight at a time.
		uint c = lane;
		for (; c + 7 * CL < n; c += 8 * CL) {
			vec4 o8[8];
			float m8[8];
			[[unroll]] for (uint r = 0; r < 8; r++) m8[r] = pml[base + c + r * CL].x;
			[[unroll]] for (uint r = 0; r < 8; r++) o8[r] = m8[r] != -1.0 / 0.0 ? po[(base + c + r * CL) * D4 + j] : vec4(0.0);
			[[unroll]] for (uint r = 0; r < 8; r++) acc += exp(m8[r] - M) * o8[r];
		}
		for (; c < n; c += CL) {
			float mc = pml[base + c].x;
			if (mc != -1.0 / 0.0) acc += exp(mc - M) * po[(base + c) * D4 + j];
		}
	}
	part[tid] = acc;
	barrier();
	if (tid < D4) {
		vec4 sum = vec4(0.0);
		for (uint ln = 0; ln < CL; ln++) sum += part[ln * D4 + tid];
		o[(b * pc.qHeads + h) * D4 + tid] = sum / L;
	}
}
