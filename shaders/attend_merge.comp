#version 450
// Split-K decode attention, merge pass. One workgroup per (query head,
// sequence) combines the chunks' (m, l, o) into
// out = sum_c exp(m_c - M) o_c / sum_c exp(m_c - M) l_c, M = max_c m_c.

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 128;
layout(constant_id = 1) const uint D = 128;

layout(std430, binding = 0) readonly buffer PartialO { float po[]; };  // [B][Hq][maxChunks][D]
layout(std430, binding = 1) readonly buffer PartialML { vec2 pml[]; }; // [B][Hq][maxChunks]
layout(std430, binding = 2) readonly buffer Chunks { uint chunks[]; };  // [B] chunks used
layout(std430, binding = 3) writeonly buffer Out { float o[]; };       // [B][Hq][D]

layout(push_constant) uniform Push {
	uint maxChunks;
	uint qHeads;
} pc;

void main() {
	uint h = gl_WorkGroupID.x;
	uint b = gl_WorkGroupID.y;
	uint n = chunks[b];
	uint base = (b * pc.qHeads + h) * pc.maxChunks;
	float M = -1.0 / 0.0;
	for (uint c = 0; c < n; c++) M = max(M, pml[base + c].x);
	float L = 0.0;
	for (uint c = 0; c < n; c++) {
		vec2 ml = pml[base + c];
		L += exp(ml.x - M) * ml.y;
	}
	for (uint d = gl_LocalInvocationID.x; d < D; d += WG) {
		float acc = 0.0;
		for (uint c = 0; c < n; c++) acc += exp(pml[base + c].x - M) * po[(base + c) * D + d];
		o[(b * pc.qHeads + h) * D + d] = acc / L;
	}
}
