#version 450
// Tactic, sampling and fit of query head h = gl_WorkGroupID.y, in one
// dispatch. First the exact exponentials the fit needs, with
// e(t) = exp(scale·q_h·k_t − m), m the head's best centroid score (the
// workgroups of a head stride over its work):
//   expo[h][x + j] = e(member j of cluster c) for every sampled cluster
//                (c, x) of tactic_plan (those of the exact part and the
//                windows), a team of TEAM threads per cluster;
//   expoFixed[h][f] = e(fixed token f), the sinks [0, sinks) then the
//                tail [clusteredEnd, n).
// TPR threads share a K row, each reading DV/TPR 16-byte words of it, and
// each thread scores RPT rows at once, so that a load instruction covers
// whole runs of rows and every q value read serves RPT rows.
// Then the last of the head's workgroups to finish (an arrival counter,
// reset by it for the next step; no workgroup waits for another) fits the
// distribution and sets the budget (Alg. 1), over the bins of tactic_plan
// as ordered groups of tokens: exact sums of the bins [0, j0) and of the
// fixed tokens, the two windows' means μ and mean 1/x, the curve
// y = a/x + b through them in the 1/x coordinate, the estimated
// cumulative sum S at every bin boundary (exact below N', the fitted curve
// above, clamped at 0), and the cut: the least bin boundary j with
// S(j) ≥ P·S(n). The head selects the clusters of bins below the cut.
#extension GL_EXT_control_flow_attributes : enable
#extension GL_KHR_shader_subgroup_basic : enable
#extension GL_KHR_shader_subgroup_shuffle : enable
#extension GL_KHR_shader_subgroup_arithmetic : enable

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 256;
layout(constant_id = 1) const uint D = 128;
// TPR divides D/8, and divides the subgroup size where above 1 (shuffles).
layout(constant_id = 2) const uint TPR = 1;
layout(constant_id = 3) const uint RPT = 1;
// TEAM, a multiple of TPR dividing WG, is the threads per cluster.
layout(constant_id = 4) const uint TEAM = 16;
layout(constant_id = 5) const uint NB = 1024;  // bins of tactic_plan
// SUBGROUPS = 1 scans with subgroup arithmetic in the fit (the host sets it
// only where supported, with subgroups of 4 to WG threads); 0 uses a
// shared-memory tree.
layout(constant_id = 6) const uint SUBGROUPS = 0;

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
// Written by every workgroup of a head, read by the last: coherent.
layout(std430, binding = 7) coherent buffer Expo { float expo[]; };     // [Hq][clustered]
layout(std430, binding = 8) coherent buffer ExpoFixed { float expoFixed[]; }; // [Hq][fixedStride]
layout(std430, binding = 9) readonly buffer TokStart { uint tokStart[]; };   // [Hq][NB+1]
layout(std430, binding = 10) writeonly buffer Cut { uint cut[]; };           // [Hq]
layout(std430, binding = 11) coherent buffer Arrived { uint arrived[]; };    // [Hq], 0 between steps

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
	float p;            // target mass
} pc;

shared vec4 qs[D / 4];
shared float pre[NB + 1];   // S at bin boundaries
shared vec4 red[WG];        // scan of (exact segment, fixed, window 1, window 2) sums
shared uint best;
shared bool last;
shared vec4 sgSum[SUBGROUPS * (WG / 4 - 1) + 1];  // each subgroup's total

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

const float GAMMA = 0.5772156649;

// harmonic returns H_x = Σ_{i ≤ x} 1/i.
float harmonic(uint x) {
	if (x == 0) return 0.0;
	if (x < 32) {
		float h = 0.0;
		for (uint i = 1; i <= x; i++) h += 1.0 / float(i);
		return h;
	}
	float f = float(x);
	float f2 = f * f;
	return log(f) + GAMMA + 1.0 / (2.0 * f) - 1.0 / (12.0 * f2) + 1.0 / (120.0 * f2 * f2);
}

// curve returns Σ_{x=lo}^{hi} max(0, a/x + b), in closed form.
float curve(float a, float b, uint lo, uint hi) {
	lo = max(lo, 1u);
	if (lo > hi) return 0.0;
	if (b > 0.0 && a < 0.0) {
		float x0 = -a / b;
		if (x0 >= float(hi)) return 0.0;
		lo = max(lo, uint(floor(x0)) + 1);
	} else if (a <= 0.0 && b <= 0.0) {
		return 0.0;
	} else if (b < 0.0) {
		float x0 = -a / b;
		if (x0 <= float(lo)) return 0.0;
		if (x0 < float(hi)) hi = uint(ceil(x0)) - 1;
	}
	if (lo > hi) return 0.0;
	return max(0.0, a * (harmonic(hi) - harmonic(lo - 1)) + b * float(hi - lo + 1));
}

// fit sets head h's cut from the exponentials of every workgroup's sampling.
void fit(uint h, uint fixedCount) {
	uint tid = gl_LocalInvocationID.x;
	uint pl = h * 16;
	uint j0 = plan[pl + 1];
	uint exact = plan[pl + 2];
	bool windows = plan[pl + 3] != 0;
	uint u1 = plan[pl + 6], v1 = plan[pl + 7];
	uint u2 = plan[pl + 10], v2 = plan[pl + 11];
	uint ob = h * (NB + 1);
	uint eb = h * pc.clustered;

	// Scan slot j sums the exact positions [j·per, (j+1)·per) and a share
	// of the fixed tokens and windows; an inclusive scan over the slots
	// follows, into red. Slots are thread indexes, or with subgroups go
	// subgroup after subgroup, the order their scans follow.
	uint slot = SUBGROUPS != 0 ? gl_SubgroupID * gl_SubgroupSize + gl_SubgroupInvocationID : tid;
	uint per = (exact + WG - 1) / WG;
	vec4 acc = vec4(0.0);
	for (uint x = slot * per; x < min(exact, slot * per + per); x++) acc.x += expo[eb + x];
	for (uint i = tid; i < fixedCount; i += WG) acc.y += expoFixed[h * pc.fixedStride + i];
	if (windows) {
		for (uint x = u1 + tid; x < v1; x += WG) acc.z += expo[eb + x];
		for (uint x = u2 + tid; x < v2; x += WG) acc.w += expo[eb + x];
	}
	if (SUBGROUPS != 0) {
		vec4 incl = subgroupInclusiveAdd(acc);
		vec4 all = subgroupAdd(acc);
		if (subgroupElect()) sgSum[gl_SubgroupID] = all;
		barrier();
		for (uint i = 0; i < gl_SubgroupID; i++) incl += sgSum[i];
		red[slot] = incl;
		barrier();
	} else {
		red[tid] = acc;
		barrier();
		for (uint k = 1; k < WG; k <<= 1) {
			vec4 x = tid >= k ? red[tid - k] : vec4(0.0);
			barrier();
			red[tid] += x;
			barrier();
		}
	}
	float exactTotal = red[WG - 1].x, fixedTotal = red[WG - 1].y, win1 = red[WG - 1].z, win2 = red[WG - 1].w;

	float a = 0.0, bb = 0.0;
	if (windows) {
		float mu1 = win1 / float(v1 - u1), mu2 = win2 / float(v2 - u2);
		float h1 = (harmonic(v1) - harmonic(u1)) / float(v1 - u1);
		float h2 = (harmonic(v2) - harmonic(u2)) / float(v2 - u2);
		if (h1 != h2) {
			a = (mu1 - mu2) / (h1 - h2);
			bb = mu1 - a * h1;
		} else {
			bb = (win1 + win2) / float(v1 - u1 + v2 - u2);
		}
	}

	// S at every bin boundary: the exact prefix sum up to j0 (from the
	// scan, the owning thread's part summed again), the curve beyond.
	if (tid == 0) best = NB;
	for (uint j = tid; j <= NB; j += WG) {
		uint x = tokStart[ob + j];
		if (j > j0) {
			pre[j] = fixedTotal + exactTotal + curve(a, bb, exact + 1, x);
		} else if (x >= exact) {
			pre[j] = fixedTotal + exactTotal;
		} else {
			uint owner = x / per;
			float sum = owner == 0 ? 0.0 : red[owner - 1].x;
			for (uint y = owner * per; y < x; y++) sum += expo[eb + y];
			pre[j] = fixedTotal + sum;
		}
	}
	barrier();
	float total = fixedTotal + exactTotal + curve(a, bb, exact + 1, pc.clustered);
	if (j0 >= NB) total = pre[NB];
	if (pc.p < 1.0) {
		float target = pc.p * total;
		for (uint j = tid; j <= NB; j += WG) {
			if (pre[j] >= target) atomicMin(best, j);
		}
	}
	barrier();
	if (tid == 0) cut[h] = best;
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

	// The last of the head's workgroups to arrive fits.
	memoryBarrierBuffer();
	barrier();
	if (tid == 0) {
		last = atomicAdd(arrived[h], 1) == gl_NumWorkGroups.x - 1;
		if (last) arrived[h] = 0;
	}
	barrier();
	if (!last) return;
	memoryBarrierBuffer();
	fit(h, fixedCount);
}
