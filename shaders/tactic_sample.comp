#version 450
// Tactic, exact exponentials the fit needs, for query head h =
// gl_WorkGroupID.y, with e(t) = exp(scale·q_h·k_t − m), m the head's best
// centroid score, one token per thread (the workgroups of a head stride
// over its work):
//   expo[h][x] = e(posTok[h][x]) for every position x of the head's order
//                in the exact part [0, exact) or a window [u, v);
//   expoFixed[h][f] = e(fixed token f), the sinks [0, sinks) then the
//                tail [clusteredEnd, n).
#extension GL_EXT_control_flow_attributes : enable

layout(local_size_x = 256) in;
layout(constant_id = 0) const uint D = 128;

const uint DV = D / 8;

layout(std430, binding = 0) readonly buffer Queries { vec4 q[]; };       // [Hq][D/4]
layout(std430, binding = 1) readonly buffer Keys { uvec4 k[]; };         // [Hkv][headStride]
layout(std430, binding = 2) readonly buffer Plan { uint plan[]; };       // [Hq][16]
layout(std430, binding = 3) readonly buffer PosTok { uint posTok[]; };   // [Hq][clustered]
layout(std430, binding = 4) writeonly buffer Expo { float expo[]; };     // [Hq][clustered]
layout(std430, binding = 5) writeonly buffer ExpoFixed { float expoFixed[]; }; // [Hq][fixedStride]

layout(push_constant) uniform Push {
	uint groupSize;
	uint headStride;    // uvec4 words between KV heads in Keys
	uint clustered;     // clustered tokens per head
	uint sinks;
	uint clusteredEnd;
	uint n;             // tokens stored
	uint fixedStride;
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
	for (uint i = gl_LocalInvocationID.x; i < D / 4; i += 256) qs[i] = q[h * (D / 4) + i] * pc.scale;
	barrier();
	uint p = h * 16;
	float m = uintBitsToFloat(plan[p]);
	uint exact = plan[p + 2];
	bool windows = plan[p + 3] != 0;
	uint u1 = windows ? plan[p + 6] : 0, w1 = windows ? plan[p + 7] - u1 : 0;
	uint u2 = windows ? plan[p + 10] : 0, w2 = windows ? plan[p + 11] - u2 : 0;
	uint fixedCount = pc.sinks + pc.n - pc.clusteredEnd;
	uint total = exact + w1 + w2 + fixedCount;
	for (uint i = gl_WorkGroupID.x * 256 + gl_LocalInvocationID.x; i < total; i += gl_NumWorkGroups.x * 256) {
		uint x = i;
		if (x < exact) {
		} else if (x < exact + w1) {
			x = u1 + (x - exact);
		} else if (x < exact + w1 + w2) {
			x = u2 + (x - exact - w1);
		} else {
			uint f = x - exact - w1 - w2;
			expoFixed[h * pc.fixedStride + f] = e(g, f < pc.sinks ? f : pc.clusteredEnd + (f - pc.sinks), m);
			continue;
		}
		expo[h * pc.clustered + x] = e(g, posTok[h * pc.clustered + x], m);
	}
}
