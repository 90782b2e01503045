#version 450
// H2O, second stage: accumulate the attention h2o_score scored, then
// select the heavy hitters.
//
// Accumulate: a workgroup takes WG indexed tokens c of KV head
// gl_WorkGroupID.y for the up to HB query heads of block
// gl_WorkGroupID.z and adds each head's softmax weight
// exp(row[h][first + c] − m_h) / z_h ((m, z) = mz[h]) to acc[h][c] where
// the token was attended (a finite row) within the N slots h2o_score
// scored (N = state[block], pc.n when pc.observe is set; nothing when 0).
// With pc.observe set that is all.
//
// Select: the last workgroup of the block to arrive (an arrival counter)
// takes its heads one after another. The candidates are the indexed
// tokens c < S; the others (the recent part) are always taken. It finds
// the heavy-th greatest accumulated score v among the candidates exactly
// (a radix select over the float bits, 11 + 11 + 10 bits: the scores are
// never negative, so their bits order as they do) and takes every
// candidate above v and, of those equal to v, the lowest ids first, so
// that exactly heavy candidates are taken (none for heavy = 0). It writes
// rank[h][c] = 0 for a token taken and 1 for the others, cut[h] = 1,
// copies the step's queries for the next step's h2o_score, records the
// step's length in state[block] and resets the counter.
#extension GL_EXT_control_flow_attributes : enable

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 256;  // threads, a power of two
layout(constant_id = 1) const uint D = 128;   // head dimension, a multiple of 8
layout(constant_id = 2) const uint HB = 4;    // query heads per block, 1 to 8

const uint D4 = D / 4;
const uint NBINS = 2048;  // bins of the widest radix level
const float NEG = -1.0 / 0.0;

layout(std430, binding = 0) readonly buffer Queries { vec4 q[]; };     // [Hq][D/4], the step's
layout(std430, binding = 1) writeonly buffer Prev { vec4 prev[]; };    // [Hq][D/4]
layout(std430, binding = 2) readonly buffer Rows { float row[]; };     // [Hq][R]
layout(std430, binding = 3) readonly buffer MZ { vec2 mz[]; };         // [Hq]
// Written by every workgroup of a block, read by the last: coherent.
layout(std430, binding = 4) coherent buffer Acc { float acc[]; };      // [Hq][C]
layout(std430, binding = 5) writeonly buffer Rank { uint rank[]; };    // [Hq][C]
layout(std430, binding = 6) writeonly buffer Cut { uint cut[]; };      // [Hq]
layout(std430, binding = 7) coherent buffer Arrived { uint arrived[]; }; // [blocks], 0 between steps
layout(std430, binding = 8) buffer State { uint state[]; };            // [blocks]

layout(push_constant) uniform Push {
	uint C;          // indexed tokens per KV head
	uint first;      // slot of indexed token 0
	uint groupSize;  // query heads per KV head
	uint n;          // slots stored: the step's length
	uint R;          // row stride per query head
	uint heavy;      // candidates to take, below S
	uint S;          // candidates: indexed tokens [0, S)
	uint observe;    // 1: accumulate only (every slot of n scored)
} pc;

shared uint hist[NBINS];
shared uint scan[WG];
shared uint sPrefix, sNeed;
shared bool last;

void main() {
	uint tid = gl_LocalInvocationID.x;
	uint g = gl_WorkGroupID.y;
	uint block = g * gl_NumWorkGroups.z + gl_WorkGroupID.z;
	uint h0 = g * pc.groupSize + gl_WorkGroupID.z * HB;
	uint heads = min(HB, g * pc.groupSize + pc.groupSize - h0);
	uint N = pc.observe != 0 ? pc.n : state[block];

	// Accumulate.
	uint c = gl_WorkGroupID.x * WG + tid;
	if (N > 0 && c < pc.C && pc.first + c < N) {
		for (uint j = 0; j < heads; j++) {
			uint h = h0 + j;
			float l = row[h * pc.R + pc.first + c];
			if (l != NEG) {
				vec2 s = mz[h];
				acc[h * pc.C + c] += exp(l - s.x) / s.y;
			}
		}
	}
	if (pc.observe != 0) return;

	// The last workgroup of the block to arrive selects for its heads.
	memoryBarrierBuffer();
	barrier();
	if (tid == 0) {
		last = atomicAdd(arrived[block], 1) == gl_NumWorkGroups.x - 1;
		if (last) arrived[block] = 0;
	}
	barrier();
	if (!last) return;
	memoryBarrierBuffer();

	for (uint i = tid; i < heads * D4; i += WG) prev[h0 * D4 + i] = q[h0 * D4 + i];
	if (tid == 0) state[block] = pc.n;
	uint per = (pc.S + WG - 1) / WG;
	uint from = min(pc.S, tid * per), to = min(pc.S, from + per);
	for (uint hl = 0; hl < heads; hl++) {
		uint h = h0 + hl, base = h * pc.C;
		// The heavy-th greatest key among the candidates, v = prefix, and
		// how many of those equal to it to take, need.
		uint prefix = 0, mask = 0, need = pc.heavy;
		if (pc.heavy > 0) {
			[[unroll]] for (int level = 0; level < 3; level++) {
				uint shift = level == 0 ? 21 : (level == 1 ? 10 : 0);
				uint bins = level == 2 ? 1024 : 2048;
				for (uint i = tid; i < NBINS; i += WG) hist[i] = 0;
				barrier();
				for (uint x = tid; x < pc.S; x += WG) {
					uint key = floatBitsToUint(acc[base + x]);
					if ((key & mask) == prefix) atomicAdd(hist[(key >> shift) & (bins - 1)], 1);
				}
				barrier();
				if (tid == 0) {
					uint b = bins - 1, left = need;
					for (;; b--) {
						if (hist[b] >= left || b == 0) break;
						left -= hist[b];
					}
					sPrefix = prefix | (b << shift);
					sNeed = left;
				}
				barrier();
				prefix = sPrefix;
				need = sNeed;
				mask |= (bins - 1) << shift;
				barrier();
			}
		}
		// Ties at v: the lowest ids first (each thread a run of candidates).
		uint eq = 0;
		for (uint x = from; x < to; x++) {
			if (floatBitsToUint(acc[base + x]) == prefix) eq++;
		}
		scan[tid] = eq;
		barrier();
		for (uint s = 1; s < WG; s <<= 1) {
			uint y = tid >= s ? scan[tid - s] : 0;
			barrier();
			scan[tid] += y;
			barrier();
		}
		uint before = scan[tid] - eq;
		for (uint x = from; x < to; x++) {
			uint key = floatBitsToUint(acc[base + x]);
			bool take = pc.heavy > 0 && (key > prefix || (key == prefix && before < need));
			if (key == prefix) before++;
			rank[base + x] = take ? 0 : 1;
		}
		for (uint x = pc.S + tid; x < pc.C; x += WG) rank[base + x] = 0;
		if (tid == 0) cut[h] = 1;
		barrier();  // the next head reuses the scan and the bins
	}
}
