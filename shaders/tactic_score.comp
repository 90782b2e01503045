#version 450
// Tactic, centroid scoring and cluster order in one dispatch.
//
// Scoring: s[h][c] = scale · q_h · centroid_c for every query head h and
// every cluster c of its KV head h / groupSize. A workgroup scores
// ROWS = WG / LANES centroids of KV head gl_WorkGroupID.y for the up to HB
// query heads of block gl_WorkGroupID.z of its group: LANES lanes share a
// centroid row, lane l reading its vec4s l, l+LANES, ..., so that each row
// is read once, in whole 128-byte runs, for all the block's heads. Each
// workgroup folds its scores into the heads' best and worst score (atomic
// maxima of order-preserving keys).
//
// Ordering: the last workgroup of a block to arrive (an arrival counter;
// no workgroup waits for another) ranks each head's clusters by
// bin(s) = min(NB − 1, ⌊(m − s)·u⌋), m and m0 the head's best and worst
// scores and u = 2^(log2 NB − e) for m − m0 = f·2^e, f in [0.5, 1): a
// power of two, so the bin is exact, and the bins span between half and
// all of [m0, m]. Bins ascend as scores descend; the clusters of a bin form
// one group (the fit works on groups), and the order of the head's
// clustered tokens is bin by bin (in no particular order within a bin).
// It writes each cluster's bin, the token offset of every bin, the plan of
// Alg. 1 (the exact bins [0, j0) covering at least `need` tokens; the bins
// holding the two sampling windows' ends, and the windows' token ranges),
// and the list of sampled clusters (those in the exact bins or a window),
// each with its first position in the order, so that the next pass reads
// their members with many threads. HP heads are ordered side by side, each
// by T = WG / HP threads; it then resets the counter and the extremes for
// the next step.
#extension GL_EXT_control_flow_attributes : enable
#extension GL_KHR_shader_subgroup_basic : enable
#extension GL_KHR_shader_subgroup_arithmetic : enable

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 256;   // threads, a power of two; WG·HB ≤ 4096
layout(constant_id = 1) const uint D = 128;
layout(constant_id = 2) const uint HB = 4;     // query heads per block, 1 to 8
layout(constant_id = 3) const uint NB = 1024;  // bins, a multiple of T
layout(constant_id = 4) const int LOG2NB = 10;
// SUBGROUPS = 1 scans with subgroup arithmetic (the host sets it only where
// supported, with subgroups of 4 to T threads); 0 uses shared-memory trees.
layout(constant_id = 5) const uint SUBGROUPS = 0;

const uint D4 = D / 4;
const uint LANES = 8;          // threads per centroid
const uint ROWS = WG / LANES;  // centroids per workgroup
const uint HP = HB >= 4 ? 4 : (HB >= 2 ? 2 : 1);  // heads ordered side by side
const uint T = WG / HP;        // threads per head in the ordering
const uint BATCH = 8;          // clusters a thread loads at once in the ordering
const uint SCRATCH = HB * ROWS * LANES > HP * (NB + 1) ? HB * ROWS * LANES : HP * (NB + 1);

layout(std430, binding = 0) readonly buffer Queries { vec4 q[]; };       // [Hq][D/4]
layout(std430, binding = 1) readonly buffer Centroids { vec4 cent[]; };  // [Hkv][C][D/4]
// Written by every workgroup of a block, read by the last: coherent.
layout(std430, binding = 2) coherent buffer Scores { float s[]; };       // [Hq][C]
layout(std430, binding = 3) readonly buffer Sizes { uint sizes[]; };     // [Hkv][C]
layout(std430, binding = 4) writeonly buffer BinOf { uint binOf[]; };    // [Hq][C]
layout(std430, binding = 5) writeonly buffer TokStart { uint tokStart[]; };  // [Hq][NB+1]
layout(std430, binding = 6) writeonly buffer Plan { uint plan[]; };      // [Hq][16]
layout(std430, binding = 7) writeonly buffer Sampled { uvec2 sampled[]; }; // [Hq][C]: (cluster, position)
// Per head the largest key of its scores and of their complements (so both
// are maxima); 0 between steps.
layout(std430, binding = 8) coherent buffer Extremes { uvec2 ext[]; };   // [Hq]
layout(std430, binding = 9) coherent buffer Arrived { uint arrived[]; }; // [Hkv][blocks], 0 between steps

layout(push_constant) uniform Push {
	uint C;
	uint groupSize;
	float scale;
	uint n;      // clustered tokens
	uint need;   // tokens the exact part covers at least
	uint lo1, hi1, lo2, hi2;  // window positions (1-based, inclusive)
} pc;

shared vec4 qs[HB][D4];
// The scoring's lane sums, then each ordered head's bin counts, scanned in
// place into token offsets, then used as cursors.
shared uint scratch[SCRATCH];
shared uint keyMax[HB], keyMin[HB];
shared uint part[WG];         // scan partial sums (trees) or subgroup totals
shared uint found[HP][5];
shared uint nSampled[HP];
shared bool last;

// key maps a float to a uint of the same order.
uint key(float x) {
	uint b = floatBitsToUint(x);
	return (b & 0x80000000u) != 0 ? ~b : b | 0x80000000u;
}

// unkey inverts key.
float unkey(uint k) {
	return uintBitsToFloat((k & 0x80000000u) != 0 ? k & 0x7fffffffu : ~k);
}

uint binOfScore(float m, float u, float x) {
	return min(NB - 1, uint(floor((m - x) * u)));
}

// scanSlots returns, for each thread of a head's T threads (slot lt), the
// exclusive prefix sum over its head's slots of x; lin is the thread's
// place in the subgroup order, part the head.
uint scanSlots(uint x, uint lin, uint hp, uint lt) {
	if (SUBGROUPS != 0) {
		uint incl = subgroupInclusiveAdd(x);
		uint all = subgroupAdd(x);
		if (subgroupElect()) part[gl_SubgroupID] = all;
		barrier();
		uint run = incl - x;
		for (uint i = hp * T / gl_SubgroupSize; i < gl_SubgroupID; i++) run += part[i];
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
	uint g = gl_WorkGroupID.y;
	uint block = g * gl_NumWorkGroups.z + gl_WorkGroupID.z;
	uint h0 = g * pc.groupSize + gl_WorkGroupID.z * HB;
	uint heads = min(HB, g * pc.groupSize + pc.groupSize - h0);
	for (uint i = tid; i < heads * D4; i += WG) qs[i / D4][i % D4] = q[h0 * D4 + i] * pc.scale;
	if (tid < HB) {
		keyMax[tid] = 0;
		keyMin[tid] = 0;
	}
	barrier();

	// Scores.
	uint r = tid / LANES, lane = tid % LANES;
	uint c = gl_WorkGroupID.x * ROWS + r;
	float acc[HB];
	[[unroll]] for (uint k = 0; k < HB; k++) acc[k] = 0.0;
	if (c < pc.C) {
		// Every load of the row in flight at once.
		const uint PER = (D4 + LANES - 1) / LANES;
		uint row = (g * pc.C + c) * D4;
		vec4 x[PER];
		[[unroll]] for (uint i = 0; i < PER; i++) x[i] = lane + i * LANES < D4 ? cent[row + lane + i * LANES] : vec4(0.0);
		[[unroll]] for (uint i = 0; i < PER; i++) {
			if (lane + i * LANES < D4) {
				[[unroll]] for (uint k = 0; k < HB; k++) {
					if (k < heads) acc[k] += dot(x[i], qs[k][lane + i * LANES]);
				}
			}
		}
	}
	[[unroll]] for (uint k = 0; k < HB; k++) scratch[(k * ROWS + r) * LANES + lane] = floatBitsToUint(acc[k]);
	barrier();
	if (c < pc.C && lane < heads) {
		float sum = 0.0;
		[[unroll]] for (uint j = 0; j < LANES; j++) sum += uintBitsToFloat(scratch[(lane * ROWS + r) * LANES + j]);
		s[(h0 + lane) * pc.C + c] = sum;
		atomicMax(keyMax[lane], key(sum));
		atomicMax(keyMin[lane], ~key(sum));
	}
	barrier();
	if (tid < heads) {
		atomicMax(ext[h0 + tid].x, keyMax[tid]);
		atomicMax(ext[h0 + tid].y, keyMin[tid]);
	}

	// The last workgroup of the block to arrive orders its heads.
	memoryBarrierBuffer();
	barrier();
	if (tid == 0) {
		last = atomicAdd(arrived[block], 1) == gl_NumWorkGroups.x - 1;
		if (last) arrived[block] = 0;
	}
	barrier();
	if (!last) return;
	memoryBarrierBuffer();

	uint lin = SUBGROUPS != 0 ? gl_SubgroupID * gl_SubgroupSize + gl_SubgroupInvocationID : tid;
	uint hp = lin / T, lt = lin % T;
	for (uint pass = 0; pass < heads; pass += HP) {
		uint hl = pass + hp;
		bool ordering = hl < heads;
		uint h = h0 + min(hl, heads - 1);
		uint sb = h * pc.C;
		uint st = hp * (NB + 1);  // this head's counts in scratch
		uvec2 e = ext[h];
		float m = unkey(e.x), m0 = unkey(~e.y);
		float u = 1.0;
		if (m - m0 > 0.0) {
			int ex;
			frexp(m - m0, ex);
			u = ldexp(1.0, LOG2NB - ex);
		}
		for (uint i = lt; i <= NB; i += T) scratch[st + i] = 0;
		if (lt < 5) found[hp][lt] = lt == 0 ? NB : NB - 1;
		if (lt == 0) nSampled[hp] = 0;
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
		uint run = scanSlots(sum, lin, hp, lt);
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
				if (x >= pc.need) atomicMin(found[hp][0], b);
				if (b < NB) {
					uint next = scratch[st + b + 1];
					if (next >= pc.lo1) atomicMin(found[hp][1], b);
					if (next >= pc.hi1) atomicMin(found[hp][2], b);
					if (next >= pc.lo2) atomicMin(found[hp][3], b);
					if (next >= pc.hi2) atomicMin(found[hp][4], b);
				}
			}
		}
		barrier();
		uint j0 = found[hp][0];
		uint exact = scratch[st + j0];
		bool windows = exact < pc.n;
		uint r1 = found[hp][1], r2 = found[hp][2], r3 = found[hp][3], r4 = found[hp][4];
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
					if (cl < pc.C && take) sampled[sb + atomicAdd(nSampled[hp], 1)] = uvec2(cl, atomicAdd(scratch[st + b], zv[i]));
				}
			}
		}
		barrier();
		if (ordering && lt == 0) {
			plan[h * 16 + 13] = nSampled[hp];
			ext[h] = uvec2(0);
		}
		barrier();  // the next pass clears the counts
	}
}
