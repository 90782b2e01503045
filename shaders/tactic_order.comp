#version 450
// Tactic's cluster order, one workgroup per query head h = gl_WorkGroupID.x,
// after centroid_score (LOG_SIZE = 0): it ranks the head's clusters by
// bin(s) = min(NB − 1, ⌊(m − s)·u⌋), m and m0 the head's best and worst
// scores (from the extremes centroid_score folded, which it resets to 0
// for the next step) and u = 2^(log2 NB − e) for m − m0 = f·2^e, f in
// [0.5, 1): a power of two, so the bin is exact, and the bins span between
// half and all of [m0, m]. Bins ascend as scores descend; the clusters of a
// bin form one group (the fit works on groups), and the order of the
// head's clustered tokens is bin by bin (in no particular order within a
// bin). It writes each cluster's bin, the token offset of every bin, the
// plan of Alg. 1 (the exact bins [0, j0) covering at least `need` tokens;
// the bins holding the two sampling windows' ends, and the windows' token
// ranges), and the list of sampled clusters (those in the exact bins or a
// window), each with its first position in the order, so that the next
// pass reads their members with many threads.
#extension GL_EXT_control_flow_attributes : enable
#extension GL_KHR_shader_subgroup_basic : enable
#extension GL_KHR_shader_subgroup_arithmetic : enable

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 256;   // threads, a power of two dividing NB
layout(constant_id = 1) const uint NB = 1024;  // bins
layout(constant_id = 2) const int LOG2NB = 10;
// SUBGROUPS = 1 scans with subgroup arithmetic (the host sets it only where
// supported, with subgroups of 4 to WG threads); 0 uses shared-memory trees.
layout(constant_id = 3) const uint SUBGROUPS = 0;

const uint T = WG;      // threads of the head
const uint BATCH = 8;   // clusters a thread loads at once

layout(std430, binding = 0) readonly buffer Scores { float s[]; };       // [Hq][C]
layout(std430, binding = 1) readonly buffer Sizes { uint sizes[]; };     // [Hkv][C]
layout(std430, binding = 2) writeonly buffer BinOf { uint binOf[]; };    // [Hq][C]
layout(std430, binding = 3) writeonly buffer TokStart { uint tokStart[]; };  // [Hq][NB+1]
layout(std430, binding = 4) writeonly buffer Plan { uint plan[]; };      // [Hq][16]
layout(std430, binding = 5) writeonly buffer Sampled { uvec2 sampled[]; }; // [Hq][C]: (cluster, position)
layout(std430, binding = 6) buffer Extremes { uvec2 ext[]; };            // [Hq], 0 between steps

layout(push_constant) uniform Push {
	uint C;
	uint groupSize;
	uint n;      // clustered tokens
	uint need;   // tokens the exact part covers at least
	uint lo1, hi1, lo2, hi2;  // window positions (1-based, inclusive)
} pc;

// The bins' token counts, scanned in place into token offsets, then used
// as cursors.
shared uint scratch[NB + 1];
shared uint part[WG];  // scan partial sums (trees) or subgroup totals
shared uint found[5];
shared uint nSampled;

// unkey inverts centroid_score's key.
float unkey(uint k) {
	return uintBitsToFloat((k & 0x80000000u) != 0 ? k & 0x7fffffffu : ~k);
}

uint binOfScore(float m, float u, float x) {
	return min(NB - 1, uint(floor((m - x) * u)));
}

// scanSlots returns, for each thread (slot lt), the exclusive prefix sum
// over the workgroup of x; lin is the thread's place in the subgroup order.
uint scanSlots(uint x, uint lin, uint lt) {
	if (SUBGROUPS != 0) {
		uint incl = subgroupInclusiveAdd(x);
		uint all = subgroupAdd(x);
		if (subgroupElect()) part[gl_SubgroupID] = all;
		barrier();
		uint run = incl - x;
		for (uint i = 0; i < gl_SubgroupID; i++) run += part[i];
		barrier();
		return run;
	}
	uint tid = gl_LocalInvocationID.x;
	part[tid] = x;
	barrier();
	for (uint k = 1; k < T; k <<= 1) {
		uint y = lt >= k ? part[tid - k] : 0;
		barrier();
		part[tid] += y;
		barrier();
	}
	uint run = part[tid] - x;
	barrier();
	return run;
}

// loadBatch loads the scores (from sb) and sizes of KV head g's clusters
// c0, c0 + T, ..., BATCH of them, all in flight together; past the last
// cluster it loads the last one again.
void loadBatch(uint c0, uint sb, uint g, out float sv[BATCH], out uint zv[BATCH]) {
	[[unroll]] for (uint i = 0; i < BATCH; i++) {
		uint cl = min(c0 + i * T, pc.C - 1);
		sv[i] = s[sb + cl];
		zv[i] = sizes[g * pc.C + cl];
	}
}

void main() {
	uint tid = gl_LocalInvocationID.x;
	uint h = gl_WorkGroupID.x;
	uint g = h / pc.groupSize;
	uint lin = SUBGROUPS != 0 ? gl_SubgroupID * gl_SubgroupSize + gl_SubgroupInvocationID : tid;
	uint lt = lin;
	{
		bool ordering = true;
		uint sb = h * pc.C;
		uint st = 0;
		uvec2 e = ext[h];
		float m = unkey(e.x), m0 = unkey(~e.y);
		float u = 1.0;
		if (m - m0 > 0.0) {
			int ex;
			frexp(m - m0, ex);
			u = ldexp(1.0, LOG2NB - ex);
		}
		for (uint i = lt; i <= NB; i += T) scratch[st + i] = 0;
		if (lt < 5) found[lt] = lt == 0 ? NB : NB - 1;
		if (lt == 0) nSampled = 0;
		barrier();

		// Clusters BATCH at a time, their loads in flight together.
		if (ordering) {
			for (uint c0 = lt; c0 < pc.C; c0 += T * BATCH) {
				float sv[BATCH];
				uint zv[BATCH];
				loadBatch(c0, sb, g, sv, zv);
				[[unroll]] for (uint i = 0; i < BATCH; i++) {
					uint cl = c0 + i * T;
					if (cl < pc.C) {
						uint b = binOfScore(m, u, sv[i]);
						binOf[sb + cl] = b;
						atomicAdd(scratch[st + b], zv[i]);
					}
				}
			}
		}
		barrier();

		// Exclusive scan of the bins' token counts, in place: slot lt sums
		// bins [lt·PER, (lt+1)·PER).
		const uint PER = NB / T;
		uint sum = 0;
		for (uint i = 0; i < PER; i++) sum += scratch[st + lt * PER + i];
		uint run = scanSlots(sum, lin, lt);
		for (uint i = 0; i < PER; i++) {
			uint b = lt * PER + i;
			uint x = scratch[st + b];
			scratch[st + b] = run;
			run += x;
		}
		if (lt == T - 1) scratch[st + NB] = run;
		barrier();

		// j0: the least boundary with start >= need (NB if none); the
		// window ends: the least bin j with start[j+1] >= x (NB − 1 if none).
		if (ordering) {
			for (uint b = lt; b <= NB; b += T) {
				uint x = scratch[st + b];
				tokStart[h * (NB + 1) + b] = x;
				if (x >= pc.need) atomicMin(found[0], b);
				if (b < NB) {
					uint next = scratch[st + b + 1];
					if (next >= pc.lo1) atomicMin(found[1], b);
					if (next >= pc.hi1) atomicMin(found[2], b);
					if (next >= pc.lo2) atomicMin(found[3], b);
					if (next >= pc.hi2) atomicMin(found[4], b);
				}
			}
		}
		barrier();
		uint j0 = found[0];
		uint exact = scratch[st + j0];
		bool windows = exact < pc.n;
		uint r1 = found[1], r2 = found[2], r3 = found[3], r4 = found[4];
		if (ordering && lt == 0) {
			uint p = h * 16;
			plan[p + 0] = floatBitsToUint(m);
			plan[p + 12] = floatBitsToUint(u);
			plan[p + 1] = j0;
			plan[p + 2] = exact;
			plan[p + 3] = windows ? 1 : 0;
			if (windows) {
				plan[p + 4] = r1;
				plan[p + 5] = r2;
				plan[p + 6] = scratch[st + r1];
				plan[p + 7] = scratch[st + r2 + 1];
				plan[p + 8] = r3;
				plan[p + 9] = r4;
				plan[p + 10] = scratch[st + r3];
				plan[p + 11] = scratch[st + r4 + 1];
			}
		}
		barrier();  // the plan has read the offsets the cursors move

		// The sampled clusters and their first positions.
		if (ordering) {
			for (uint c0 = lt; c0 < pc.C; c0 += T * BATCH) {
				float sv[BATCH];
				uint zv[BATCH];
				loadBatch(c0, sb, g, sv, zv);
				[[unroll]] for (uint i = 0; i < BATCH; i++) {
					uint cl = c0 + i * T;
					uint b = binOfScore(m, u, sv[i]);
					bool take = b < j0 || (windows && ((b >= r1 && b <= r2) || (b >= r3 && b <= r4)));
					if (cl < pc.C && take) sampled[sb + atomicAdd(nSampled, 1)] = uvec2(cl, atomicAdd(scratch[st + b], zv[i]));
				}
			}
		}
		barrier();
		if (ordering && lt == 0) {
			plan[h * 16 + 13] = nSampled;
			ext[h] = uvec2(0);
		}
	}
}
