#version 450
// The mean value row of every cluster of a layer stored in cluster order:
// means[g][c] = (1/s_c) · Σ_{j < s_c} v[g][first + starts[g][c] + j],
// summed in float32 and stored rounded to fp16, packed four to a uvec2 (a
// zero row for an empty cluster), s_c = sizes[g][c]. A workgroup
// takes ROWS clusters of KV head gl_WorkGroupID.y, DV threads a cluster,
// each summing one uvec4 (8 fp16 values) of every member row.
#extension GL_EXT_control_flow_attributes : enable

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 128;  // threads, a multiple of D / 8
layout(constant_id = 1) const uint D = 128;   // head dimension, a multiple of 8

const uint DV = D / 8;         // uvec4 per row
const uint ROWS = WG / DV;     // clusters per workgroup

layout(std430, binding = 0) readonly buffer Values { uvec4 v[]; };     // [heads][headStride]
layout(std430, binding = 1) readonly buffer Starts { uint starts[]; }; // [heads][C]
layout(std430, binding = 2) readonly buffer Sizes { uint sizes[]; };   // [heads][C]
layout(std430, binding = 3) writeonly buffer Means { uvec2 means[]; }; // [heads][C][D/4] fp16 quads

layout(push_constant) uniform Push {
	uint C;
	uint headStride;  // uvec4 words between consecutive KV heads
	uint first;       // slot of the first clustered token
} pc;

void main() {
	uint tid = gl_LocalInvocationID.x;
	uint g = gl_WorkGroupID.y;
	uint c = gl_WorkGroupID.x * ROWS + tid / DV;
	uint j = tid % DV;
	if (c >= pc.C) return;
	uint size = sizes[g * pc.C + c];
	uint row = g * pc.headStride + (pc.first + starts[g * pc.C + c]) * DV + j;
	vec4 lo = vec4(0.0), hi = vec4(0.0);
	for (uint i = 0; i < size; i++) {
		uvec4 w = v[row + i * DV];
		lo += vec4(unpackHalf2x16(w.x), unpackHalf2x16(w.y));
		hi += vec4(unpackHalf2x16(w.z), unpackHalf2x16(w.w));
	}
	float inv = size == 0 ? 0.0 : 1.0 / float(size);
	uint out0 = ((g * pc.C + c) * D + j * 8) / 4;
	lo *= inv;
	hi *= inv;
	means[out0] = uvec2(packHalf2x16(lo.xy), packHalf2x16(lo.zw));
	means[out0 + 1] = uvec2(packHalf2x16(hi.xy), packHalf2x16(hi.zw));
}
