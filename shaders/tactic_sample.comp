#version 450
// Tactic, exact exponentials the fit needs, for query head h =
// gl_WorkGroupID.y, with e(t) = exp(scale·q_h·k_t − m), m the head's best
// centroid score (the workgroups of a head stride over its work):
//   expo[h][x + j] = e(member j of cluster c) for every sampled cluster
//                (c, x) of tactic_plan (those of the exact part and the
//                windows), a team of 16 threads per cluster;
//   expoFixed[h][f] = e(fixed token f), the sinks [0, sinks) then the
//                tail [clusteredEnd, n), a thread per token.
#extension GL_EXT_control_flow_attributes : enable

layout(local_size_x = 256) in;
layout(constant_id = 0) const uint D = 128;

const uint DV = D / 8;

layout(std430, binding = 0) readonly buffer Queries { vec4 q[]; };       // [Hq][D/4]
layout(std430, binding = 1) readonly buffer Keys { uvec4 k[]; };         // [Hkv][headStride]
layout(std430, binding = 2) readonly buffer Plan { uint plan[]; };       // [Hq][16]
layout(std430, binding = 3) readonly buffer Sampled { uvec2 sampled[]; }; // [Hq][C]: (cluster, position)
layout(std430, binding = 4) readonly buffer Starts { uint starts[]; };   // [Hkv][C] member offsets
layout(std430, binding = 5) readonly buffer Sizes { uint sizes[]; };     // [Hkv][C]
layout(std430, binding = 6) readonly buffer Members { uint members[]; }; // [Hkv][clustered]
layout(std430, binding = 7) writeonly buffer Expo { float expo[]; };     // [Hq][clustered]
layout(std430, binding = 8) writeonly buffer ExpoFixed { float expoFixed[]; }; // [Hq][fixedStride]

layout(push_constant) uniform Push {
	uint groupSize;
	uint headStride;    // uvec4 words between KV heads in Keys
	uint clustered;     // clustered tokens per head
	uint sinks;
	uint clusteredEnd;
	uint n;             // tokens stored
	uint fixedStride;
	float scale;
	uint C;
} pc;

const uint TEAM = 16;  // threads per cluster

shared vec4 qs[D / 4];

float e(uint g, uint t, float m) {
	uint row = g * pc.headStride + t * DV;
	float acc = 0.0;
	[[unroll]] for (uint j = 0; j < DV; j++) {
		uvec4 w = k[row + j];
		acc += dot(vec4(unpackHalf2x16(w.x), unpackHalf2x16(w.y)), qs[2 * j]);
		acc += dot(vec4(unpackHalf2x16(w.z), unpackHalf2x16(w.w)), qs[2 * j + 1]);
	}
	return exp(acc - m);
}

void main() {
	uint h = gl_WorkGroupID.y;
	uint g = h / pc.groupSize;
	for (uint i = gl_LocalInvocationID.x; i < D / 4; i += 256) qs[i] = q[h * (D / 4) + i] * pc.scale;
	barrier();
	uint p = h * 16;
	float m = uintBitsToFloat(plan[p]);
	uint tid = gl_LocalInvocationID.x;
	uint list = plan[p + 13];
	uint team = tid / TEAM, lane = tid % TEAM;
	for (uint i = gl_WorkGroupID.x * (256 / TEAM) + team; i < list; i += gl_NumWorkGroups.x * (256 / TEAM)) {
		uvec2 cx = sampled[h * pc.C + i];
		uint from = g * pc.clustered + starts[g * pc.C + cx.x];
		uint size = sizes[g * pc.C + cx.x];
		for (uint j = lane; j < size; j += TEAM) expo[h * pc.clustered + cx.y + j] = e(g, members[from + j], m);
	}
	uint fixedCount = pc.sinks + pc.n - pc.clusteredEnd;
	for (uint f = gl_WorkGroupID.x * 256 + tid; f < fixedCount; f += gl_NumWorkGroups.x * 256) {
		expoFixed[h * pc.fixedStride + f] = e(g, f < pc.sinks ? f : pc.clusteredEnd + (f - pc.sinks), m);
	}
}
