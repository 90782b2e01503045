#version 450
// Tactic, ordering and sampling plan of one query head per workgroup.
// Clusters are ranked by bin(s) = min(NB − 1, ⌊(m − s)·u⌋), m and m0 the
// head's best and worst centroid scores and u = 2^(log2 NB − e) for
// m − m0 = f·2^e, f in [0.5, 1): a power of two, so the bin is exact, and
// the bins span between half and all of [m0, m]. Bins ascend as scores
// descend; the clusters of a bin form one group (the fit works on groups).
// It writes each cluster's bin, the clusters ordered by bin (in no
// particular order within a bin), the token and cluster offsets of the
// bins, and the plan of Alg. 1: the exact bins [0, j0) covering at least
// `need` tokens, and the bins holding the two sampling windows' ends.

layout(local_size_x = 256) in;
layout(constant_id = 0) const uint NB = 1024;   // bins, a multiple of 256
layout(constant_id = 1) const int LOG2NB = 10;  // log2(NB)

layout(std430, binding = 0) readonly buffer Scores { float s[]; };      // [Hq][C]
layout(std430, binding = 1) readonly buffer Sizes { uint sizes[]; };    // [Hkv][C]
layout(std430, binding = 2) writeonly buffer BinOf { uint binOf[]; };   // [Hq][C]
layout(std430, binding = 3) writeonly buffer Order { uint order[]; };   // [Hq][C]
layout(std430, binding = 4) writeonly buffer TokStart { uint tokStart[]; };  // [Hq][NB+1]
layout(std430, binding = 5) writeonly buffer CluStart { uint cluStart[]; };  // [Hq][NB+1]
layout(std430, binding = 6) writeonly buffer Plan { uint plan[]; };     // [Hq][16]

layout(push_constant) uniform Push {
	uint C;
	uint groupSize;
	uint n;      // clustered tokens
	uint need;   // tokens the exact part covers at least
	uint lo1, hi1, lo2, hi2;  // window positions (1-based, inclusive)
} pc;

shared float red[256];
shared uint cntT[NB];
shared uint cntC[NB];
shared uint stT[NB + 1];
shared uint stC[NB + 1];
shared uint part[2][256];

uint binOfScore(float m, float u, float x) {
	return min(NB - 1, uint(floor((m - x) * u)));
}

// rank returns the least bin j with stT[j+1] >= x (the bin holding position x).
uint rank(uint x) {
	uint j = 0;
	while (j + 1 < NB && stT[j + 1] < x) j++;
	return j;
}

void main() {
	uint tid = gl_LocalInvocationID.x;
	uint h = gl_WorkGroupID.x;
	uint g = h / pc.groupSize;
	uint sb = h * pc.C;

	float m = -1.0 / 0.0, m0 = 1.0 / 0.0;
	for (uint c = tid; c < pc.C; c += 256) {
		m = max(m, s[sb + c]);
		m0 = min(m0, s[sb + c]);
	}
	red[tid] = m;
	for (uint i = tid; i < NB; i += 256) {
		cntT[i] = 0;
		cntC[i] = 0;
	}
	barrier();
	for (uint k = 128; k > 0; k >>= 1) {
		if (tid < k) red[tid] = max(red[tid], red[tid + k]);
		barrier();
	}
	m = red[0];
	barrier();
	red[tid] = m0;
	barrier();
	for (uint k = 128; k > 0; k >>= 1) {
		if (tid < k) red[tid] = min(red[tid], red[tid + k]);
		barrier();
	}
	m0 = red[0];
	float u = 1.0;
	if (m - m0 > 0.0) {
		int e;
		frexp(m - m0, e);
		u = ldexp(1.0, LOG2NB - e);
	}

	for (uint c = tid; c < pc.C; c += 256) {
		uint b = binOfScore(m, u, s[sb + c]);
		binOf[sb + c] = b;
		atomicAdd(cntT[b], sizes[g * pc.C + c]);
		atomicAdd(cntC[b], 1);
	}
	barrier();

	// Exclusive scans of the bins' token and cluster counts.
	const uint PER = NB / 256;
	uint sumT = 0, sumC = 0;
	for (uint i = 0; i < PER; i++) {
		sumT += cntT[tid * PER + i];
		sumC += cntC[tid * PER + i];
	}
	part[0][tid] = sumT;
	part[1][tid] = sumC;
	barrier();
	for (uint k = 1; k < 256; k <<= 1) {
		uint xT = tid >= k ? part[0][tid - k] : 0;
		uint xC = tid >= k ? part[1][tid - k] : 0;
		barrier();
		part[0][tid] += xT;
		part[1][tid] += xC;
		barrier();
	}
	uint runT = tid == 0 ? 0 : part[0][tid - 1];
	uint runC = tid == 0 ? 0 : part[1][tid - 1];
	for (uint i = 0; i < PER; i++) {
		uint b = tid * PER + i;
		stT[b] = runT;
		stC[b] = runC;
		runT += cntT[b];
		runC += cntC[b];
	}
	if (tid == 255) {
		stT[NB] = runT;
		stC[NB] = runC;
	}
	barrier();
	uint ob = h * (NB + 1);
	for (uint b = tid; b <= NB; b += 256) {
		tokStart[ob + b] = stT[b];
		cluStart[ob + b] = stC[b];
	}

	// Clusters grouped by bin (counting sort).
	for (uint b = tid; b < NB; b += 256) cntC[b] = stC[b];  // cursors
	barrier();
	for (uint c = tid; c < pc.C; c += 256) {
		uint b = binOfScore(m, u, s[sb + c]);
		order[sb + atomicAdd(cntC[b], 1)] = c;
	}

	if (tid == 0) {
		uint j0 = 0;
		while (j0 < NB && stT[j0] < pc.need) j0++;
		uint exact = stT[j0];
		uint p = h * 16;
		plan[p + 0] = floatBitsToUint(m);
		plan[p + 12] = floatBitsToUint(u);
		plan[p + 1] = j0;
		plan[p + 2] = exact;
		uint windows = exact < pc.n ? 1 : 0;
		plan[p + 3] = windows;
		if (windows != 0) {
			uint r1 = rank(pc.lo1), r2 = rank(pc.hi1);
			uint r3 = rank(pc.lo2), r4 = rank(pc.hi2);
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
}
