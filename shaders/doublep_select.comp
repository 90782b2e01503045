#version 450
// Double-P's selection (seed 004, §4.2-4.3) in one dispatch.
//
// Scoring: l[h][c] = scale · q_h · centroid_c + ln s_c, the logit of
// cluster c's pseudo-token (Eq. 5), for every query head h and cluster c
// of its KV head, −∞ for an empty cluster. A workgroup scores ROWS
// centroids of KV head gl_WorkGroupID.y for the up to HB query heads of
// block gl_WorkGroupID.z, LANES lanes sharing a row so that each row is
// read once for all the block's heads, and folds its finite logits into
// the heads' best and worst (atomic maxima of order-preserving keys).
//
// Cuts: the last workgroup of a block to arrive (an arrival counter; no
// workgroup waits for another) ranks each head's clusters by
// bin(l) = min(NB − 1, ⌊(m − l)·u⌋), m and m0 the best and worst finite
// logits and u = 2^(log2 NB − e) for m − m0 = f·2^e, f in [0.5, 1) (NB for
// an empty cluster, past every cut). It sums each bin's estimated mass in
// fixed point, with integer atomics only: each term exp(l − m_b), m_b =
// m − b/u the bin's top (so the term is in (0, 1]), times pc.quant,
// truncated; the bin's mass is that sum / quant · exp(−b/u). A scan of the
// bins gives keep, the fewest leading bins holding at least p1 of the
// mass, and exact ≤ keep, the fewest holding at least p2 of the kept mass.
// It writes each cluster's bin (the rank the attention compares with the
// cuts) and the two cuts, then resets the counter and the extremes for the
// next step. HP heads are cut side by side, T = WG / HP threads each.
#extension GL_EXT_control_flow_attributes : enable

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 256;   // threads, a power of two; WG·HB ≤ 4096
layout(constant_id = 1) const uint D = 128;
layout(constant_id = 2) const uint HB = 4;     // query heads per block, 1 to 8
layout(constant_id = 3) const uint NB = 1024;  // bins, a multiple of T
layout(constant_id = 4) const int LOG2NB = 10;

const uint D4 = D / 4;
const uint LANES = 8;          // threads per centroid
const uint ROWS = WG / LANES;  // centroids per workgroup
const uint HP = HB >= 4 ? 4 : (HB >= 2 ? 2 : 1);  // heads cut side by side
const uint T = WG / HP;        // threads per head in the cuts
const uint BATCH = 8;          // logits a thread loads at once in the cuts
const uint SCRATCH = HB * ROWS * LANES > HP * NB ? HB * ROWS * LANES : HP * NB;
const float NEG = -1.0 / 0.0;

layout(std430, binding = 0) readonly buffer Queries { vec4 q[]; };       // [Hq][D/4]
layout(std430, binding = 1) readonly buffer Centroids { vec4 cent[]; };  // [Hkv][C][D/4]
// Written by every workgroup of a block, read by the last: coherent.
layout(std430, binding = 2) coherent buffer Logits { float s[]; };       // [Hq][C]
layout(std430, binding = 3) readonly buffer Sizes { uint sizes[]; };     // [Hkv][C]
layout(std430, binding = 4) writeonly buffer BinOf { uint binOf[]; };    // [Hq][C]
layout(std430, binding = 5) writeonly buffer Exact { uint exactCut[]; }; // [Hq]
layout(std430, binding = 6) writeonly buffer Keep { uint keepCut[]; };   // [Hq]
// Per head the largest key of its finite logits and of their complements
// (so both are maxima); 0 between steps.
layout(std430, binding = 7) coherent buffer Extremes { uvec2 ext[]; };   // [Hq]
layout(std430, binding = 8) coherent buffer Arrived { uint arrived[]; }; // [Hkv][blocks], 0 between steps

layout(push_constant) uniform Push {
	uint C;
	uint groupSize;
	float scale;
	float p1, p2;
	float quant;  // fixed-point scale of a term, C · quant ≤ 2^31
} pc;

shared vec4 qs[HB][D4];
// The scoring's lane sums, then each head's bins' fixed-point masses.
shared uint scratch[SCRATCH];
shared uint keyMax[HB], keyMin[HB];
shared float part[WG];  // scan of the bins' masses
shared uint found[HP][2];
shared float kept[HP];
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

// binMass returns the estimated mass of bin b of a head: its fixed-point
// sum x, relative to m.
float binMass(uint x, uint b, float u) {
	return float(x) / pc.quant * exp(-float(b) / u);
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

	// Logits.
	uint r = tid / LANES, lane = tid % LANES;
	uint c = gl_WorkGroupID.x * ROWS + r;
	float acc[HB];
	[[unroll]] for (uint k = 0; k < HB; k++) acc[k] = 0.0;
	if (c < pc.C) {
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
		uint size = sizes[g * pc.C + c];
		float sum = 0.0;
		[[unroll]] for (uint j = 0; j < LANES; j++) sum += uintBitsToFloat(scratch[(lane * ROWS + r) * LANES + j]);
		float l = size == 0 ? NEG : sum + log(float(size));
		s[(h0 + lane) * pc.C + c] = l;
		if (size != 0) {
			atomicMax(keyMax[lane], key(l));
			atomicMax(keyMin[lane], ~key(l));
		}
	}
	barrier();
	if (tid < heads) {
		atomicMax(ext[h0 + tid].x, keyMax[tid]);
		atomicMax(ext[h0 + tid].y, keyMin[tid]);
	}

	// The last workgroup of the block to arrive cuts its heads.
	memoryBarrierBuffer();
	barrier();
	if (tid == 0) {
		last = atomicAdd(arrived[block], 1) == gl_NumWorkGroups.x - 1;
		if (last) arrived[block] = 0;
	}
	barrier();
	if (!last) return;
	memoryBarrierBuffer();

	uint hp = tid / T, lt = tid % T;
	const uint PER = NB / T;  // bins a thread scans
	for (uint pass = 0; pass < heads; pass += HP) {
		uint hl = pass + hp;
		bool cutting = hl < heads;
		uint h = h0 + min(hl, heads - 1);
		uint sb = h * pc.C;
		uint st = hp * NB;  // this head's bins in scratch
		uvec2 e = ext[h];
		float m = unkey(e.x), m0 = unkey(~e.y);
		float u = 1.0;
		if (m - m0 > 0.0) {
			int ex;
			frexp(m - m0, ex);
			u = ldexp(1.0, LOG2NB - ex);
		}
		for (uint i = lt; i < NB; i += T) scratch[st + i] = 0;
		if (lt < 2) found[hp][lt] = NB;
		barrier();

		if (cutting) {
			// BATCH logits loaded at once, all in flight together. A thread
			// adds up its run of clusters in one bin before one atomic: most
			// clusters fall in few bins.
			uint runBin = NB, runSum = 0;
			for (uint c0 = lt; c0 < pc.C; c0 += T * BATCH) {
				float lv[BATCH];
				[[unroll]] for (uint i = 0; i < BATCH; i++) lv[i] = s[sb + min(c0 + i * T, pc.C - 1)];
				[[unroll]] for (uint i = 0; i < BATCH; i++) {
					uint cl = c0 + i * T;
					if (cl >= pc.C) break;
					uint b = NB;
					if (lv[i] != NEG) {
						b = min(NB - 1, uint(floor((m - lv[i]) * u)));
						if (b != runBin) {
							if (runSum != 0) atomicAdd(scratch[st + runBin], runSum);
							runBin = b;
							runSum = 0;
						}
						runSum += uint(min(exp(lv[i] - (m - float(b) / u)), 1.0) * pc.quant);
					}
					binOf[sb + cl] = b;
				}
			}
			if (runSum != 0) atomicAdd(scratch[st + runBin], runSum);
		}
		barrier();

		// Inclusive scan of the bins' masses over the head's threads: slot
		// lt sums bins [lt·PER, (lt+1)·PER).
		float mine = 0.0;
		for (uint i = 0; i < PER; i++) mine += binMass(scratch[st + lt * PER + i], lt * PER + i, u);
		part[tid] = mine;
		barrier();
		for (uint k = 1; k < T; k <<= 1) {
			float y = lt >= k ? part[tid - k] : 0.0;
			barrier();
			part[tid] += y;
			barrier();
		}
		float total = part[hp * T + T - 1];
		float before = part[tid] - mine;
		// keep: the first bin where the running mass reaches p1 of the total.
		float run = before;
		for (uint i = 0; i < PER; i++) {
			uint b = lt * PER + i;
			run += binMass(scratch[st + b], b, u);
			if (run >= pc.p1 * total) {
				atomicMin(found[hp][0], b);
				break;
			}
		}
		barrier();
		uint keep = found[hp][0] == NB ? NB : found[hp][0] + 1;
		// The kept mass: the running mass through bin keep − 1.
		run = before;
		for (uint i = 0; i < PER; i++) {
			uint b = lt * PER + i;
			run += binMass(scratch[st + b], b, u);
			if (b + 1 == keep) kept[hp] = run;
		}
		barrier();
		float target = pc.p2 * kept[hp];
		run = before;
		for (uint i = 0; i < PER; i++) {
			uint b = lt * PER + i;
			run += binMass(scratch[st + b], b, u);
			if (run >= target) {
				atomicMin(found[hp][1], b);
				break;
			}
		}
		barrier();
		if (cutting && lt == 0) {
			uint exact = found[hp][1] == NB ? keep : min(found[hp][1] + 1, keep);
			exactCut[h] = total > 0.0 ? exact : 0;
			keepCut[h] = total > 0.0 ? keep : 0;
			ext[h] = uvec2(0);
		}
		barrier();  // the next pass clears the bins
	}
}
