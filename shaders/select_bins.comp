#version 450
// A policy's selection of clusters by bins of a per-cluster score, in one
// dispatch: the fixed-budget baselines (Quest, top-k of page bounds) and
// the oracles (top-p of true mass over tokens or clusters).
//
// Rows: a workgroup scores ROWS rows of KV head gl_WorkGroupID.y for the up
// to HB query heads of block gl_WorkGroupID.z, LANES lanes sharing a row,
// and writes row[h][r] for every head h of the block:
//   KIND 0 (Quest), rows are clusters: scale · Σ_i max(q_i·lo_i, q_i·hi_i)
//     over the cluster's per-channel key bounds lo and hi (scale > 0);
//   KIND 1 (mass), rows are the layer's slots [0, n): the exact logit
//     scale · q · k of the key stored there.
// Cuts: the last workgroup of a block to arrive (an arrival counter; no
// workgroup waits for another) takes its heads up to four at a time
// (KIND 0; KIND 1 one after another). It
// gives each cluster c its score l_c (KIND 0 the row of c; KIND 1
// log Σ_{j < s_c} exp(row[first + start_c + j]), the log of the cluster's
// true mass), −∞ for an empty cluster, and ranks clusters by
// bin(l) = min(NB − 1, ⌊(m − l)·u⌋), m and m0 the best and worst finite
// scores, u = 2^(log2 NB − e) for m − m0 = f·2^e, f in [0.5, 1) (u = 1 if
// m = m0; NB for an empty cluster, past every cut). Then the cut, in bins:
//   TOPP 0: the fewest leading bins holding at least k clusters (whole
//     bins: at least k clusters; 0 for k = 0, NB if there are fewer);
//   TOPP 1 (KIND 1): the fewest leading bins whose mass T, with the mass F
//     of the slots outside the index ([0, first) and [first + clustered,
//     n), attended anyway), reaches p of all: F + T ≥ p·(F + M), M the
//     index's mass Σ_c exp(l_c); that is T ≥ p·M − (1 − p)·F (0 bins when
//     F alone reaches it). Each bin's mass is summed in fixed point with
//     integer atomics only: term exp(l − m_b), m_b = m − b/u the bin's
//     top, times pc.quant, truncated; the bin's mass is that sum / quant ·
//     exp(−b/u). F, relative to m, is summed in float32.
// It writes each cluster's score and bin and each head's cut, then resets
// the counter. KIND 0 folds the extremes while scoring the rows (every
// workgroup's into ext[h] with atomic maxima of order-preserving keys,
// which the last workgroup reads and resets), so that its heads take one
// pass over their clusters; KIND 1 takes two (the extremes, then the
// bins). The bins' pass keeps BATCH loads a thread in flight: BATCH / HC
// clusters of each head it takes at once (more held more registers and
// slowed the rows at batch 8).
#extension GL_EXT_control_flow_attributes : enable

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 256;   // threads, a power of two; WG·HB ≤ 4096, WG ≤ NB
layout(constant_id = 1) const uint D = 128;    // head dimension, a multiple of 8
layout(constant_id = 2) const uint HB = 4;     // query heads per block, 1 to 8
layout(constant_id = 3) const uint NB = 1024;  // bins, a multiple of WG
layout(constant_id = 4) const int LOG2NB = 10;
layout(constant_id = 5) const uint KIND = 0;
layout(constant_id = 6) const uint TOPP = 0;

const uint D4 = D / 4;
const uint DV = D / 8;         // uvec4 per fp16 key row
const uint LANES = 8;          // threads per row
const uint ROWS = WG / LANES;  // rows per workgroup
const uint SCRATCH = HB * WG > NB ? HB * WG : NB;
const float NEG = -1.0 / 0.0;
const uint BATCH = 8;          // clusters a thread of the last workgroup loads at once

layout(std430, binding = 0) readonly buffer Queries { vec4 q[]; };     // [Hq][D/4]
layout(std430, binding = 1) readonly buffer Keys { uvec4 k[]; };       // [Hkv][headStride], KIND 1
layout(std430, binding = 2) readonly buffer Lo { uvec2 lo[]; };        // [Hkv][C][D/4] fp16 quads, KIND 0
layout(std430, binding = 3) readonly buffer Hi { uvec2 hi[]; };        // [Hkv][C][D/4] fp16 quads, KIND 0
// Written by every workgroup of a block, read by the last: coherent.
layout(std430, binding = 4) coherent buffer Rows { float row[]; };     // [Hq][R]
layout(std430, binding = 5) writeonly buffer Scores { float score[]; }; // [Hq][C]
layout(std430, binding = 6) readonly buffer Starts { uint starts[]; }; // [Hkv][C]
layout(std430, binding = 7) readonly buffer Sizes { uint sizes[]; };   // [Hkv][C]
layout(std430, binding = 8) writeonly buffer BinOf { uint binOf[]; };  // [Hq][C]
layout(std430, binding = 9) writeonly buffer Cut { uint cut[]; };      // [Hq]
layout(std430, binding = 10) coherent buffer Arrived { uint arrived[]; }; // [Hkv][blocks], 0 between steps
// KIND 0: per head the largest key of its non-empty clusters' scores and
// of their complements (so both are maxima); 0 between steps.
layout(std430, binding = 11) coherent buffer Extremes { uvec2 ext[]; };  // [Hq]

layout(push_constant) uniform Push {
	uint C;           // clusters per KV head
	uint R;           // row stride per query head: C (KIND 0) or the layer's capacity (KIND 1)
	uint groupSize;   // query heads per KV head
	float scale;      // multiplies q·k, > 0
	float p;          // TOPP 1: the mass target, in (0, 1]
	uint k;           // TOPP 0: the clusters to reach
	float quant;      // TOPP 1: fixed-point scale of a term, C · quant ≤ 2^31
	uint first;       // KIND 1: slot of row 0
	uint headStride;  // KIND 1: uvec4 words between consecutive KV heads
	uint n;           // rows scored: C (KIND 0) or the slots stored (KIND 1)
	uint clustered;   // KIND 1: the indexed slots are [first, first + clustered)
} pc;

shared vec4 qs[HB][D4];
// The rows' lane sums, then a head's bins' counts or fixed-point masses.
shared uint scratch[SCRATCH];
// The last workgroup cuts HC heads at a time (KIND 0: a power of two, as
// many as the scratch holds bins for, at most 4; KIND 1, whose passes
// score every cluster from its members, one: four took the cluster
// oracle's step from 1.2 to 1.8 ms at 131 072 tokens); each head's scan
// then takes T threads, P bins a thread.
const uint HCX = HB < SCRATCH / NB ? HB : SCRATCH / NB;
const uint HC = KIND != 0 ? 1 : (HCX >= 4 ? 4 : (HCX >= 2 ? 2 : 1));
const uint T = WG / HC;
const uint P = NB / T;
const uint HBATCH = BATCH / HC;  // clusters a thread loads at once for each head
shared uint keyMax[4], keyMin[4], found[4];  // per head of the chunk
shared uint rowMax[HB], rowMin[HB];  // KIND 0: the workgroup's extremes
shared float part[WG];  // scan of the bins
shared bool last;

// key maps a float to a uint of the same order.
uint key(float x) {
	uint b = floatBitsToUint(x);
	return (b & 0x80000000u) != 0 ? ~b : b | 0x80000000u;
}

// unkey inverts key.
float unkey(uint x) {
	return uintBitsToFloat((x & 0x80000000u) != 0 ? x & 0x7fffffffu : ~x);
}

// weight returns what bin b, at scratch[at], holds: its cluster count, or
// its mass relative to m from its fixed-point sum.
float weight(uint at, uint b, float u) {
	uint x = scratch[at];
	return TOPP == 0 ? float(x) : float(x) / pc.quant * exp(-float(b) / u);
}

// clusterScore returns the score of non-empty cluster c (of KV head g,
// size members) for head h from the rows.
float clusterScore(uint h, uint g, uint c, uint size) {
	if (KIND == 0) return row[h * pc.R + c];
	uint at = h * pc.R + pc.first + starts[g * pc.C + c];
	float m = NEG;
	for (uint j = 0; j < size; j++) m = max(m, row[at + j]);
	float s = 0.0;
	for (uint j = 0; j < size; j++) s += exp(row[at + j] - m);
	return m + log(s);
}

void main() {
	uint tid = gl_LocalInvocationID.x;
	uint g = gl_WorkGroupID.y;
	uint block = g * gl_NumWorkGroups.z + gl_WorkGroupID.z;
	uint h0 = g * pc.groupSize + gl_WorkGroupID.z * HB;
	uint heads = min(HB, g * pc.groupSize + pc.groupSize - h0);
	for (uint i = tid; i < heads * D4; i += WG) qs[i / D4][i % D4] = q[h0 * D4 + i] * pc.scale;
	if (KIND == 0 && tid < HB) {
		rowMax[tid] = 0;
		rowMin[tid] = 0;
	}
	barrier();

	// Rows.
	uint r = gl_WorkGroupID.x * ROWS + tid / LANES, lane = tid % LANES;
	float acc[HB];
	[[unroll]] for (uint j = 0; j < HB; j++) acc[j] = 0.0;
	// KIND 0: the page's size, loaded with its bounds (empty pages fold no extreme).
	uint size = KIND == 0 && r < pc.n && lane < heads ? sizes[g * pc.C + r] : 0;
	if (r < pc.n) {
		if (KIND == 0) {
			uint base = (g * pc.C + r) * D4;
			for (uint i = lane; i < D4; i += LANES) {
				uvec2 lw = lo[base + i], hw = hi[base + i];
				vec4 a = vec4(unpackHalf2x16(lw.x), unpackHalf2x16(lw.y));
				vec4 b = vec4(unpackHalf2x16(hw.x), unpackHalf2x16(hw.y));
				[[unroll]] for (uint j = 0; j < HB; j++) {
					if (j < heads) acc[j] += dot(max(qs[j][i] * a, qs[j][i] * b), vec4(1.0));
				}
			}
		} else {
			uint base = g * pc.headStride + r * DV;
			for (uint i = lane; i < DV; i += LANES) {
				uvec4 w = k[base + i];
				vec4 a = vec4(unpackHalf2x16(w.x), unpackHalf2x16(w.y));
				vec4 b = vec4(unpackHalf2x16(w.z), unpackHalf2x16(w.w));
				[[unroll]] for (uint j = 0; j < HB; j++) {
					if (j < heads) acc[j] += dot(a, qs[j][2 * i]) + dot(b, qs[j][2 * i + 1]);
				}
			}
		}
	}
	[[unroll]] for (uint j = 0; j < HB; j++) scratch[j * WG + tid] = floatBitsToUint(acc[j]);
	barrier();
	if (r < pc.n && lane < heads) {
		float sum = 0.0;
		uint at = lane * WG + (tid / LANES) * LANES;
		[[unroll]] for (uint j = 0; j < LANES; j++) sum += uintBitsToFloat(scratch[at + j]);
		row[(h0 + lane) * pc.R + r] = sum;
		if (KIND == 0 && size > 0) {
			atomicMax(rowMax[lane], key(sum));
			atomicMax(rowMin[lane], ~key(sum));
		}
	}
	if (KIND == 0) {
		barrier();
		if (tid < heads) {
			atomicMax(ext[h0 + tid].x, rowMax[tid]);
			atomicMax(ext[h0 + tid].y, rowMin[tid]);
		}
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

	for (uint c0h = 0; c0h < heads; c0h += HC) {
		uint hc = min(HC, heads - c0h);
		if (tid < HC) {
			keyMax[tid] = 0;
			keyMin[tid] = 0;
			found[tid] = NB;
		}
		for (uint i = tid; i < HC * NB; i += WG) scratch[i] = 0;
		barrier();
		if (KIND == 0) {
			// The extremes the rows folded.
			if (tid < hc) {
				uvec2 e = ext[h0 + c0h + tid];
				keyMax[tid] = e.x;
				keyMin[tid] = e.y;
				ext[h0 + c0h + tid] = uvec2(0);
			}
		} else {
			// Scores.
			for (uint c = tid; c < pc.C; c += WG) {
				uint size = sizes[g * pc.C + c];
				for (uint j = 0; j < hc; j++) {
					uint h = h0 + c0h + j;
					float l = size > 0 ? clusterScore(h, g, c, size) : NEG;
					if (size > 0) {
						atomicMax(keyMax[j], key(l));
						atomicMax(keyMin[j], ~key(l));
					}
					score[h * pc.C + c] = l;
				}
			}
		}
		barrier();
		float m[4], u[4];
		[[unroll]] for (uint j = 0; j < 4; j++) {
			m[j] = 0.0;
			u[j] = 1.0;
			if (j < hc) {
				m[j] = unkey(keyMax[j]);
				float m0 = unkey(~keyMin[j]);
				if (m[j] - m0 > 0.0) {
					int ex;
					frexp(m[j] - m0, ex);
					u[j] = ldexp(1.0, LOG2NB - ex);
				}
			}
		}
		// The bins of every head of the chunk, HBATCH clusters a thread at a
		// time for each (BATCH loads in flight), their sizes loaded once
		// (KIND 0 writes the scores here).
		for (uint c0 = tid; c0 < pc.C; c0 += WG * HBATCH) {
			float lv[4][BATCH];
			uint zv[BATCH];
			[[unroll]] for (uint i = 0; i < HBATCH; i++) {
				uint c = min(c0 + i * WG, pc.C - 1);
				zv[i] = sizes[g * pc.C + c];
				[[unroll]] for (uint j = 0; j < HC; j++) {
					if (KIND == 0 && j < hc) lv[j][i] = row[(h0 + c0h + j) * pc.R + c];
				}
			}
			[[unroll]] for (uint i = 0; i < HBATCH; i++) {
				uint c = c0 + i * WG;
				[[unroll]] for (uint j = 0; j < HC; j++) {
					if (c < pc.C && j < hc) {
						uint h = h0 + c0h + j;
						uint b = NB;
						float l = NEG;
						if (zv[i] > 0) {
							l = KIND == 0 ? lv[j][i] : clusterScore(h, g, c, zv[i]);  // KIND 1 again: Scores is write-only
							b = min(NB - 1, uint(floor((m[j] - l) * u[j])));
							uint add = 1;
							if (TOPP != 0) add = uint(min(exp(l - (m[j] - float(b) / u[j])), 1.0) * pc.quant);
							atomicAdd(scratch[j * NB + b], add);
						}
						if (KIND == 0) score[h * pc.C + c] = l;
						binOf[h * pc.C + c] = b;
					}
				}
			}
		}
		barrier();

		// From here each head of the chunk has T threads: this one is slot
		// j of head hl.
		uint hl = tid / T, j = tid % T;
		uint h = h0 + c0h + hl;
		float mh = m[0], uh = u[0];
		[[unroll]] for (uint i = 1; i < 4; i++) {
			if (i == hl) {
				mh = m[i];
				uh = u[i];
			}
		}

		// The mass of the slots outside the index, relative to m.
		float fixedMass = 0.0;
		if (TOPP != 0) {
			float mine = 0.0;
			if (hl < hc) {
				for (uint t = j; t < pc.n; t += T) {
					if (t < pc.first || t >= pc.first + pc.clustered) mine += exp(row[h * pc.R + t] - mh);
				}
			}
			part[tid] = mine;
			barrier();
			for (uint s = T / 2; s > 0; s >>= 1) {
				if (j < s) part[tid] += part[tid + s];
				barrier();
			}
			fixedMass = part[hl * T];
			barrier();
		}

		// Inclusive scan of each head's bins over its threads: slot j sums
		// bins [j·P, (j+1)·P).
		float mine = 0.0;
		for (uint i = 0; i < P; i++) mine += weight(hl * NB + j * P + i, j * P + i, uh);
		part[tid] = mine;
		barrier();
		for (uint s = 1; s < T; s <<= 1) {
			float y = j >= s ? part[tid - s] : 0.0;
			barrier();
			part[tid] += y;
			barrier();
		}
		float total = part[hl * T + T - 1];
		float target = TOPP == 0 ? float(pc.k) : pc.p * total - (pc.p < 1.0 ? (1.0 - pc.p) * fixedMass : 0.0);
		float run = part[tid] - mine;
		for (uint i = 0; i < P && hl < hc; i++) {
			uint b = j * P + i;
			run += weight(hl * NB + b, b, uh);
			if (run >= target) {
				atomicMin(found[hl], b);
				break;
			}
		}
		barrier();
		if (j == 0 && hl < hc) cut[h] = total > 0.0 && target > 0.0 ? (found[hl] == NB ? NB : found[hl] + 1) : 0;
		barrier();  // the next chunk clears the bins
	}
}
