#version 450
// Tactic, exact exponentials the fit needs, for query head h =
// gl_WorkGroupID.y, with e(t) = exp(scale·q_h·k_t − m), m the head's best
// centroid score:
//  pass 0: for every cluster rank r (position in the bin order) that lies
//          in the exact bins or in a sampling window's bins,
//          clusterSum[h][r] = Σ e(t) over the cluster's members;
//  pass 1: fixedSum[h][i] = Σ e(t) over fixed tokens 16i .. 16i+15 (the
//          sinks [0, sinks), then the tail [clusteredEnd, n)).
#extension GL_EXT_control_flow_attributes : enable

layout(local_size_x = 64) in;
layout(constant_id = 0) const uint D = 128;
layout(constant_id = 1) const uint NB = 1024;

const uint DV = D / 8;

layout(std430, binding = 0) readonly buffer Queries { vec4 q[]; };       // [Hq][D/4]
layout(std430, binding = 1) readonly buffer Keys { uvec4 k[]; };         // [Hkv][headStride]
layout(std430, binding = 2) readonly buffer Order { uint order[]; };     // [Hq][C]
layout(std430, binding = 3) readonly buffer CluStart { uint cluStart[]; }; // [Hq][NB+1]
layout(std430, binding = 4) readonly buffer Plan { uint plan[]; };       // [Hq][16]
layout(std430, binding = 5) readonly buffer Starts { uint starts[]; };   // [Hkv][C] member offsets
layout(std430, binding = 6) readonly buffer Sizes { uint sizes[]; };     // [Hkv][C]
layout(std430, binding = 7) readonly buffer Members { uint members[]; }; // [Hkv][clustered]
layout(std430, binding = 8) writeonly buffer ClusterSum { float clusterSum[]; }; // [Hq][C]
layout(std430, binding = 9) writeonly buffer FixedSum { float fixedSum[]; };     // [Hq][fixedChunks]

layout(push_constant) uniform Push {
	uint pass;
	uint C;
	uint groupSize;
	uint headStride;    // uvec4 words between KV heads in Keys
	uint clustered;     // clustered tokens per head (Members stride)
	uint sinks;
	uint clusteredEnd;
	uint n;             // tokens stored
	uint fixedChunks;   // ceil((sinks + n − clusteredEnd) / 16)
	float scale;
} pc;

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
	for (uint i = gl_LocalInvocationID.x; i < D / 4; i += 64) qs[i] = q[h * (D / 4) + i] * pc.scale;
	barrier();
	uint p = h * 16;
	float m = uintBitsToFloat(plan[p]);
	uint i = gl_GlobalInvocationID.x;
	if (pc.pass == 1) {
		uint fixedCount = pc.sinks + pc.n - pc.clusteredEnd;
		if (i >= pc.fixedChunks) return;
		float sum = 0.0;
		for (uint f = 16 * i; f < min(16 * i + 16, fixedCount); f++) {
			sum += e(g, f < pc.sinks ? f : pc.clusteredEnd + (f - pc.sinks), m);
		}
		fixedSum[h * pc.fixedChunks + i] = sum;
		return;
	}
	if (i >= pc.C) return;
	uint cb = h * (NB + 1);
	bool take = i < cluStart[cb + plan[p + 1]];
	if (plan[p + 3] != 0) {
		take = take || (i >= cluStart[cb + plan[p + 4]] && i < cluStart[cb + plan[p + 5] + 1]);
		take = take || (i >= cluStart[cb + plan[p + 8]] && i < cluStart[cb + plan[p + 9] + 1]);
	}
	if (!take) return;
	uint c = order[h * pc.C + i];
	uint from = g * pc.clustered + starts[g * pc.C + c];
	uint size = sizes[g * pc.C + c];
	float sum = 0.0;
	for (uint j = 0; j < size; j++) sum += e(g, members[from + j], m);
	clusterSum[h * pc.C + i] = sum;
}
