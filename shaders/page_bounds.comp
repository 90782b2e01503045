#version 450
// Quest's page metadata: per cluster (page) c of KV head g and channel i,
// the least and greatest key element of its members,
// lo[g][c][i] = min_{j < s_c} k[g][first + starts[g][c] + j][i] and hi
// likewise with max (0 for an empty cluster), s_c = sizes[g][c], over a
// layer stored in cluster order, stored as fp16 pairs like the keys (the
// extremes of fp16 values are fp16 values: nothing is rounded). One thread
// per (cluster, pair of channels): a word of two fp16 keys.

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 128;
layout(constant_id = 1) const uint D = 128;  // head dimension, even

const uint DW = D / 2;  // words per row

layout(std430, binding = 0) readonly buffer Keys { uint k[]; };        // [heads][headStride]
layout(std430, binding = 1) readonly buffer Starts { uint starts[]; }; // [heads][C]
layout(std430, binding = 2) readonly buffer Sizes { uint sizes[]; };   // [heads][C]
layout(std430, binding = 3) writeonly buffer Lo { uint lo[]; };        // [heads][C][D/2] fp16 pairs
layout(std430, binding = 4) writeonly buffer Hi { uint hi[]; };        // [heads][C][D/2] fp16 pairs

layout(push_constant) uniform Push {
	uint C;
	uint headStride;  // words between consecutive KV heads
	uint first;       // slot of the first indexed token
} pc;

void main() {
	uint g = gl_WorkGroupID.y;
	uint i = gl_GlobalInvocationID.x;
	if (i >= pc.C * DW) return;
	uint c = i / DW, w = i % DW;
	uint size = sizes[g * pc.C + c];
	uint row = g * pc.headStride + (pc.first + starts[g * pc.C + c]) * DW + w;
	vec2 mn = vec2(0.0), mx = vec2(0.0);
	if (size > 0) {
		mn = unpackHalf2x16(k[row]);
		mx = mn;
	}
	for (uint j = 1; j < size; j++) {
		vec2 x = unpackHalf2x16(k[row + j * DW]);
		mn = min(mn, x);
		mx = max(mx, x);
	}
	lo[(g * pc.C + c) * DW + w] = packHalf2x16(mn);
	hi[(g * pc.C + c) * DW + w] = packHalf2x16(mx);
}
