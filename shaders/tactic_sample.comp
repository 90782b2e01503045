#version 450
// Tactic, exact exponentials the fit needs, for query head h =
// gl_WorkGroupID.y, with e(t) = exp(scale·q_h·k_t − m), m the head's best
// centroid score (the workgroups of a head stride over its work):
//   expo[h][x + j] = e(member j of cluster c) for every sampled cluster
//                (c, x) of tactic_plan (those of the exact part and the
//                windows), a team of TEAM threads per cluster;
//   expoFixed[h][f] = e(fixed token f), the sinks [0, sinks) then the
//                tail [clusteredEnd, n).
// TPR threads share a K row, each reading DV/TPR 16-byte words of it, and
// each thread scores RPT rows at once, so that a load instruction covers
// whole runs of rows and every q value read serves RPT rows.
#extension GL_EXT_control_flow_attributes : enable
#extension GL_KHR_shader_subgroup_basic : enable
#extension GL_KHR_shader_subgroup_shuffle : enable

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 256;
layout(constant_id = 1) const uint D = 128;
// TPR divides D/8, and divides the subgroup size where above 1 (shuffles).
layout(constant_id = 2) const uint TPR = 1;
layout(constant_id = 3) const uint RPT = 1;
// TEAM, a multiple of TPR dividing WG, is the threads per cluster.
layout(constant_id = 4) const uint TEAM = 16;

const uint DV = D / 8;
const uint WPT = DV / TPR;          // words per thread per row
const uint SLOTS = TEAM / TPR;      // rows a team scores side by side
const uint PASS = SLOTS * RPT;      // rows a team scores at once

layout(std430, binding = 0) readonly buffer Queries { vec4 q[]; };       // [Hq][D/4]
layout(std430, binding = 1) readonly buffer Keys { uvec4 k[]; };         // [Hkv][headStride]
layout(std430, binding = 2) readonly buffer Plan { uint plan[]; };       // [Hq][16]
layout(std430, binding = 3) readonly buffer Sampled { uvec2 sampled[]; }; // [Hq][C]: (cluster, position)
layout(std430, binding = 4) readonly buffer Starts { uint starts[]; };   // [Hkv][C] member offsets
layout(std430, binding = 5) readonly buffer Sizes { uint sizes[]; };     // [Hkv][C]
layout(std430, binding = 6) readonly buffer Members { uint members[]; }; // [Hkv][clustered], unused: clusters are runs of slots
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

shared vec4 qs[D / 4];

// scoreRows returns in ev[r] e(tok[r]) for the RPT rows of KV head g, on
// every one of the TPR threads sharing the rows (sub is the thread's part).
void scoreRows(uint g, uint tok[RPT], uint sub, float m, out float ev[RPT]) {
	uvec4 w[RPT * WPT];
	[[unroll]] for (uint r = 0; r < RPT; r++) {
		uint row = g * pc.headStride + tok[r] * DV;
		[[unroll]] for (uint j = 0; j < WPT; j++) w[r * WPT + j] = k[row + j * TPR + sub];
	}
	float acc[RPT];
	[[unroll]] for (uint r = 0; r < RPT; r++) acc[r] = 0.0;
	[[unroll]] for (uint j = 0; j < WPT; j++) {
		uint u = j * TPR + sub;
		vec4 qa = qs[2 * u], qb = qs[2 * u + 1];
		[[unroll]] for (uint r = 0; r < RPT; r++) {
			uvec4 x = w[r * WPT + j];
			acc[r] += dot(vec4(unpackHalf2x16(x.x), unpackHalf2x16(x.y)), qa) + dot(vec4(unpackHalf2x16(x.z), unpackHalf2x16(x.w)), qb);
		}
	}
	if (TPR > 1) {
		[[unroll]] for (uint o = TPR / 2; o > 0; o >>= 1) {
			[[unroll]] for (uint r = 0; r < RPT; r++) acc[r] += subgroupShuffleXor(acc[r], o);
		}
	}
	[[unroll]] for (uint r = 0; r < RPT; r++) ev[r] = exp(acc[r] - m);
}

void main() {
	uint h = gl_WorkGroupID.y;
	uint g = h / pc.groupSize;
	uint tid = gl_LocalInvocationID.x;
	for (uint i = tid; i < D / 4; i += WG) qs[i] = q[h * (D / 4) + i] * pc.scale;
	barrier();
	uint p = h * 16;
	float m = uintBitsToFloat(plan[p]);
	uint list = plan[p + 13];
	uint team = tid / TEAM, slot = (tid % TEAM) / TPR, sub = tid % TPR;
	const uint TEAMS = WG / TEAM;
	for (uint i = gl_WorkGroupID.x * TEAMS + team; i < list; i += gl_NumWorkGroups.x * TEAMS) {
		uvec2 cx = sampled[h * pc.C + i];
		// The layer holds clusters in cluster order (kvcache Layer.Reorder):
		// the cluster's members are the slots from sinks + its start.
		uint from = pc.sinks + starts[g * pc.C + cx.x];
		uint size = sizes[g * pc.C + cx.x];
		for (uint j0 = 0; j0 < size; j0 += PASS) {
			uint tok[RPT];
			[[unroll]] for (uint r = 0; r < RPT; r++) tok[r] = from + min(j0 + r * SLOTS + slot, size - 1);
			float ev[RPT];
			scoreRows(g, tok, sub, m, ev);
			[[unroll]] for (uint r = 0; r < RPT; r++) {
				uint j = j0 + r * SLOTS + slot;
				if (sub == 0 && j < size) expo[h * pc.clustered + cx.y + j] = ev[r];
			}
		}
	}
	uint fixedCount = pc.sinks + pc.n - pc.clusteredEnd;
	uint step = gl_NumWorkGroups.x * TEAMS * PASS;
	for (uint f0 = (gl_WorkGroupID.x * TEAMS + team) * PASS; f0 < fixedCount; f0 += step) {
		uint tok[RPT];
		[[unroll]] for (uint r = 0; r < RPT; r++) {
			uint f = min(f0 + r * SLOTS + slot, fixedCount - 1);
			tok[r] = f < pc.sinks ? f : pc.clusteredEnd + (f - pc.sinks);
		}
		float ev[RPT];
		scoreRows(g, tok, sub, m, ev);
		[[unroll]] for (uint r = 0; r < RPT; r++) {
			uint f = f0 + r * SLOTS + slot;
			if (sub == 0 && f < fixedCount) expoFixed[h * pc.fixedStride + f] = ev[r];
		}
	}
}
