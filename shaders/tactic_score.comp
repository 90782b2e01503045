#version 450
// Tactic, centroid scoring: s[h][c] = scale · q_h · centroid_c for every
// query head h and every cluster c of its KV head h / groupSize. One thread
// per cluster; the workgroup shares q_h.

layout(local_size_x = 64) in;
layout(constant_id = 0) const uint D = 128;

layout(std430, binding = 0) readonly buffer Queries { float q[]; };      // [Hq][D]
layout(std430, binding = 1) readonly buffer Centroids { vec4 cent[]; };  // [Hkv][C][D/4]
layout(std430, binding = 2) writeonly buffer Scores { float s[]; };      // [Hq][C]

layout(push_constant) uniform Push {
	uint C;
	uint groupSize;
	float scale;
} pc;

shared vec4 qs[D / 4];

void main() {
	uint h = gl_WorkGroupID.y;
	uint c = gl_GlobalInvocationID.x;
	for (uint i = gl_LocalInvocationID.x; i < D / 4; i += 64) {
		uint b = h * D + 4 * i;
		qs[i] = vec4(q[b], q[b + 1], q[b + 2], q[b + 3]) * pc.scale;
	}
	barrier();
	if (c >= pc.C) return;
	uint row = ((h / pc.groupSize) * pc.C + c) * (D / 4);
	float acc = 0.0;
	for (uint i = 0; i < D / 4; i++) acc += dot(qs[i], cent[row + i]);
	s[h * pc.C + c] = acc;
}
