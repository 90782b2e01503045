#version 450
#extension GL_KHR_shader_subgroup_basic : enable
#extension GL_KHR_shader_subgroup_arithmetic : enable
// Tactic, ordering and sampling plan of one query head per workgroup.
// Clusters are ranked by bin(s) = min(NB − 1, ⌊(m − s)·u⌋), m and m0 the
// head's best and worst centroid scores and u = 2^(log2 NB − e) for
// m − m0 = f·2^e, f in [0.5, 1): a power of two, so the bin is exact, and
// the bins span between half and all of [m0, m]. Bins ascend as scores
// descend; the clusters of a bin form one group (the fit works on groups),
// and the order of the head's clustered tokens is bin by bin (in no
// particular order within a bin).
// It writes each cluster's bin, the token offset of every bin, the plan of
// Alg. 1 (the exact bins [0, j0) covering at least `need` tokens; the bins
// holding the two sampling windows' ends, and the windows' token ranges),
// and the list of sampled clusters (those in the exact bins or a window),
// each with its first position in the order, so that the next pass reads
// their members with many threads.

layout(local_size_x_id = 2) in;
layout(constant_id = 0) const uint NB = 1024;   // bins, a multiple of WG
layout(constant_id = 1) const int LOG2NB = 10;  // log2(NB)
layout(constant_id = 2) const uint WG = 256;    // threads, a power of two
// SUBGROUPS = 1 reduces and scans with subgroup arithmetic (the host sets
// it only where supported, with subgroups of 4 to WG threads); 0 uses
// shared-memory trees.
layout(constant_id = 3) const uint SUBGROUPS = 0;

layout(std430, binding = 0) readonly buffer Scores { float s[]; };      // [Hq][C]
layout(std430, binding = 1) readonly buffer Sizes { uint sizes[]; };    // [Hkv][C]
layout(std430, binding = 2) writeonly buffer BinOf { uint binOf[]; };   // [Hq][C]
layout(std430, binding = 3) writeonly buffer TokStart { uint tokStart[]; };  // [Hq][NB+1]
layout(std430, binding = 4) writeonly buffer Plan { uint plan[]; };     // [Hq][16]
layout(std430, binding = 5) writeonly buffer Sampled { uvec2 sampled[]; }; // [Hq][C]: (cluster, position)

layout(push_constant) uniform Push {
	uint C;
	uint groupSize;
	uint n;      // clustered tokens
	uint need;   // tokens the exact part covers at least
	uint lo1, hi1, lo2, hi2;  // window positions (1-based, inclusive)
} pc;

shared float red[WG];
shared uint cnt[NB];
shared uint stT[NB + 1];
shared uint part[WG];
shared uint found[5];
shared uint nSampled;

uint binOfScore(float m, float u, float x) {
	return min(NB - 1, uint(floor((m - x) * u)));
}

void main() {
	uint tid = gl_LocalInvocationID.x;
	uint h = gl_WorkGroupID.x;
	uint g = h / pc.groupSize;
	uint sb = h * pc.C;

	float m = -1.0 / 0.0, m0 = 1.0 / 0.0;
	for (uint c = tid; c < pc.C; c += WG) {
		m = max(m, s[sb + c]);
		m0 = min(m0, s[sb + c]);
	}
	for (uint i = tid; i < NB; i += WG) cnt[i] = 0;
	if (tid < 5) found[tid] = tid == 0 ? NB : NB - 1;
	if (tid == 0) nSampled = 0;
	if (SUBGROUPS != 0) {
		// Each subgroup's max and min, then every thread combines them.
		m = subgroupMax(m);
		m0 = subgroupMin(m0);
		if (subgroupElect()) {
			red[gl_SubgroupID] = m;
			red[WG / 2 + gl_SubgroupID] = m0;
		}
		barrier();
		m = red[0];
		m0 = red[WG / 2];
		for (uint i = 1; i < gl_NumSubgroups; i++) {
			m = max(m, red[i]);
			m0 = min(m0, red[WG / 2 + i]);
		}
	} else {
		red[tid] = m;
		barrier();
		for (uint k = WG / 2; k > 0; k >>= 1) {
			if (tid < k) red[tid] = max(red[tid], red[tid + k]);
			barrier();
		}
		m = red[0];
		barrier();
		red[tid] = m0;
		barrier();
		for (uint k = WG / 2; k > 0; k >>= 1) {
			if (tid < k) red[tid] = min(red[tid], red[tid + k]);
			barrier();
		}
		m0 = red[0];
	}
	float u = 1.0;
	if (m - m0 > 0.0) {
		int e;
		frexp(m - m0, e);
		u = ldexp(1.0, LOG2NB - e);
	}

	for (uint c = tid; c < pc.C; c += WG) {
		uint b = binOfScore(m, u, s[sb + c]);
		binOf[sb + c] = b;
		atomicAdd(cnt[b], sizes[g * pc.C + c]);
	}
	barrier();

	// Exclusive scan of the bins' token counts: slot j of the scan sums
	// bins [j·PER, (j+1)·PER). With subgroups the slots go subgroup after
	// subgroup, the order their scans follow.
	const uint PER = NB / WG;
	uint slot = SUBGROUPS != 0 ? gl_SubgroupID * gl_SubgroupSize + gl_SubgroupInvocationID : tid;
	uint sum = 0;
	for (uint i = 0; i < PER; i++) sum += cnt[slot * PER + i];
	uint run;
	if (SUBGROUPS != 0) {
		uint incl = subgroupInclusiveAdd(sum);
		uint all = subgroupAdd(sum);
		if (subgroupElect()) part[gl_SubgroupID] = all;
		barrier();
		run = incl - sum;
		for (uint i = 0; i < gl_SubgroupID; i++) run += part[i];
	} else {
		part[tid] = sum;
		barrier();
		for (uint k = 1; k < WG; k <<= 1) {
			uint x = tid >= k ? part[tid - k] : 0;
			barrier();
			part[tid] += x;
			barrier();
		}
		run = tid == 0 ? 0 : part[tid - 1];
	}
	for (uint i = 0; i < PER; i++) {
		uint b = slot * PER + i;
		stT[b] = run;
		run += cnt[b];
	}
	if (slot == WG - 1) stT[NB] = run;
	barrier();
	uint ob = h * (NB + 1);
	for (uint b = tid; b <= NB; b += WG) tokStart[ob + b] = stT[b];

	// j0: the least boundary with stT[j0] >= need (NB if none); the window
	// ends: the least bin j with stT[j+1] >= x (NB − 1 if none).
	for (uint b = tid; b <= NB; b += WG) {
		if (stT[b] >= pc.need) atomicMin(found[0], b);
		if (b < NB) {
			uint next = stT[b + 1];
			if (next >= pc.lo1) atomicMin(found[1], b);
			if (next >= pc.hi1) atomicMin(found[2], b);
			if (next >= pc.lo2) atomicMin(found[3], b);
			if (next >= pc.hi2) atomicMin(found[4], b);
		}
	}
	for (uint b = tid; b < NB; b += WG) cnt[b] = 0;  // cursors
	barrier();
	uint j0 = found[0];
	uint exact = stT[j0];
	bool windows = exact < pc.n;
	uint r1 = found[1], r2 = found[2], r3 = found[3], r4 = found[4];
	if (tid == 0) {
		uint p = h * 16;
		plan[p + 0] = floatBitsToUint(m);
		plan[p + 12] = floatBitsToUint(u);
		plan[p + 1] = j0;
		plan[p + 2] = exact;
		plan[p + 3] = windows ? 1 : 0;
		if (windows) {
			plan[p + 4] = r1;
			plan[p + 5] = r2;
			plan[p + 6] = stT[r1];
			plan[p + 7] = stT[r2 + 1];
			plan[p + 8] = r3;
			plan[p + 9] = r4;
			plan[p + 10] = stT[r3];
			plan[p + 11] = stT[r4 + 1];
		}
	}

	// The sampled clusters and their first positions.
	for (uint c = tid; c < pc.C; c += WG) {
		uint b = binOfScore(m, u, s[sb + c]);
		bool take = b < j0 || (windows && ((b >= r1 && b <= r2) || (b >= r3 && b <= r4)));
		if (take) sampled[sb + atomicAdd(nSampled, 1)] = uvec2(c, stT[b] + atomicAdd(cnt[b], sizes[g * pc.C + c]));
	}
	barrier();
	if (tid == 0) plan[h * 16 + 13] = nSampled;
}
