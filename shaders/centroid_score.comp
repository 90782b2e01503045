#version 450
// Centroid scores of a clustered layer: l[h][c] = scale · q_h · centroid_c
// (Tactic, LOG_SIZE = 0) or scale · q_h · centroid_c + ln s_c, the logit of
// cluster c's pseudo-token in Double-P (the Double-P paper, Eq. 5; −∞ for an empty
// cluster, LOG_SIZE = 1), for every query head h and cluster c of its KV
// head, the centroids in 8 bits: centroid_c[i] = r_c · m[i] · k_c[i], k_c
// signed bytes packed four to a 32-bit word (byte i mod 4 of word i/4
// holds element i, lowest first), r_c the row's float32 scale, m the KV
// head's dimension scales, so that l = r_c · Σ_i (scale · q_h[i] · m[i]) ·
// k_c[i], m folded into the queries as they are loaded. A workgroup
// scores pc.iters groups of ROWS consecutive centroids of KV head
// gl_WorkGroupID.y for the up to HB query heads of block gl_WorkGroupID.z
// (HB ≤ LANES), LANES lanes sharing a row so that each row is read once for
// all the block's heads, the next group's rows loaded while it scores the
// current one; it folds its finite scores into the heads' best and worst
// (atomic maxima of order-preserving keys, once per workgroup, which the
// next kernel reads and resets: doublep_cut, tactic_select).
#extension GL_EXT_control_flow_attributes : enable
#extension GL_KHR_shader_subgroup_basic : enable
#extension GL_KHR_shader_subgroup_shuffle : enable

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 256;   // threads, a power of two; WG·HB ≤ 4096
layout(constant_id = 1) const uint D = 128;
layout(constant_id = 2) const uint HB = 4;     // query heads per block, 1 to 8
layout(constant_id = 3) const uint LOG_SIZE = 1;
// SHUFFLE = 1 sums a row's lanes with subgroup shuffles (the host sets it
// only where shuffles work and LANES divides the subgroup size); 0 meets
// in shared memory.
layout(constant_id = 4) const uint SHUFFLE = 0;
layout(constant_id = 5) const uint LANES = 8;  // threads per centroid, a power of two, HB ≤ LANES

const uint D4 = D / 4;
const uint D8 = D / 8;         // uvec2 (8 codes) per centroid
const uint ROWS = WG / LANES;  // centroids per group
const float NEG = -1.0 / 0.0;

layout(std430, binding = 0) readonly buffer Queries { vec4 q[]; };       // [Hq][D/4]
layout(std430, binding = 1) readonly buffer Codes { uvec2 cent[]; };    // [Hkv][C][D/8] 8-bit codes
layout(std430, binding = 2) writeonly buffer Logits { float s[]; };      // [Hq][C]
layout(std430, binding = 3) readonly buffer Sizes { uint sizes[]; };     // [Hkv][C]
// Per head the largest key of its finite logits and of their complements
// (so both are maxima); 0 between steps.
layout(std430, binding = 4) buffer Extremes { uvec2 ext[]; };            // [Hq]
layout(std430, binding = 5) readonly buffer Scales { float rowScale[]; }; // [Hkv][C]
layout(std430, binding = 6) readonly buffer DimScales { vec4 dimScale[]; }; // [Hkv][D/4]

layout(push_constant) uniform Push {
	uint C;
	uint groupSize;
	float scale;
	uint iters;  // groups of ROWS centroids per workgroup
} pc;

shared vec4 qs[HB][D4];
shared float lanes[(1 - SHUFFLE) * (HB * ROWS * LANES - 1) + 1];  // the lanes' partial sums
shared uint keyMax[HB], keyMin[HB];

const uint PER = (D8 + LANES - 1) / LANES;  // uvec2 a lane loads per row

// key maps a float to a uint of the same order.
uint key(float x) {
	uint b = floatBitsToUint(x);
	return (b & 0x80000000u) != 0 ? ~b : b | 0x80000000u;
}

// codes returns the four signed bytes of w, lowest first.
vec4 codes(uint w) {
	return vec4((ivec4(w) << ivec4(24, 16, 8, 0)) >> 24);
}

// loadRow loads this lane's part of centroid c of KV head g (the last
// one past the end), its scale and its cluster's size.
void loadRow(uint g, uint c, uint lane, out uvec2 x[PER], out float r, out uint size) {
	uint cc = g * pc.C + min(c, pc.C - 1);
	[[unroll]] for (uint i = 0; i < PER; i++) x[i] = lane + i * LANES < D8 ? cent[cc * D8 + lane + i * LANES] : uvec2(0);
	r = rowScale[cc];
	size = sizes[cc];
}

void main() {
	uint tid = gl_LocalInvocationID.x;
	uint g = gl_WorkGroupID.y;
	uint h0 = g * pc.groupSize + gl_WorkGroupID.z * HB;
	uint heads = min(HB, g * pc.groupSize + pc.groupSize - h0);
	uint r = tid / LANES, lane = tid % LANES;
	uint first = gl_WorkGroupID.x * pc.iters * ROWS;  // the workgroup's first centroid

	// The first group's loads in flight with the queries'.
	uvec2 x[PER];
	float rs;
	uint size;
	loadRow(g, first + r, lane, x, rs, size);
	for (uint i = tid; i < heads * D4; i += WG) qs[i / D4][i % D4] = q[h0 * D4 + i] * (pc.scale * dimScale[g * D4 + i % D4]);
	if (tid < HB) {
		keyMax[tid] = 0;
		keyMin[tid] = 0;
	}
	barrier();

	// Lane k of a row folds head k's keys (0: none yet).
	uint kMax = 0, kMin = 0;
	for (uint it = 0; it < pc.iters; it++) {
		uint c0 = first + it * ROWS;  // the same on every thread
		if (c0 >= pc.C) break;
		uint c = c0 + r;
		uvec2 y[PER];
		float yScale = 0.0;
		uint ySize = 0;
		bool more = it + 1 < pc.iters && c0 + ROWS < pc.C;
		if (more) loadRow(g, c + ROWS, lane, y, yScale, ySize);

		float acc[HB];
		[[unroll]] for (uint k = 0; k < HB; k++) acc[k] = 0.0;
		[[unroll]] for (uint i = 0; i < PER; i++) {
			uint j = lane + i * LANES;
			if (j < D8) {
				vec4 lo = codes(x[i].x), hi = codes(x[i].y);
				[[unroll]] for (uint k = 0; k < HB; k++) {
					if (k < heads) acc[k] += dot(lo, qs[k][2 * j]) + dot(hi, qs[k][2 * j + 1]);
				}
			}
		}
		// Lane k of the row ends with head k's sum of q·k_c.
		float sum = 0.0;
		if (SHUFFLE != 0) {
			[[unroll]] for (uint o = LANES / 2; o > 0; o >>= 1) {
				[[unroll]] for (uint k = 0; k < HB; k++) acc[k] += subgroupShuffleXor(acc[k], o);
			}
			[[unroll]] for (uint k = 0; k < HB; k++) {
				if (k == lane) sum = acc[k];
			}
		} else {
			[[unroll]] for (uint k = 0; k < HB; k++) lanes[(k * ROWS + r) * LANES + lane] = acc[k];
			barrier();
			if (lane < HB) {
				[[unroll]] for (uint j = 0; j < LANES; j++) sum += lanes[(lane * ROWS + r) * LANES + j];
			}
			barrier();  // the next group rewrites lanes
		}
		if (c < pc.C && lane < heads) {
			sum *= rs;
			float l = LOG_SIZE == 0 ? sum : (size == 0 ? NEG : sum + log(float(size)));
			s[(h0 + lane) * pc.C + c] = l;
			if (LOG_SIZE == 0 || size != 0) {
				kMax = max(kMax, key(l));
				kMin = max(kMin, ~key(l));
			}
		}
		if (more) {
			[[unroll]] for (uint i = 0; i < PER; i++) x[i] = y[i];
			rs = yScale;
			size = ySize;
		}
	}
	if (lane < heads) {
		atomicMax(keyMax[lane], kMax);
		atomicMax(keyMin[lane], kMin);
	}
	barrier();
	if (tid < heads) {
		atomicMax(ext[h0 + tid].x, keyMax[tid]);
		atomicMax(ext[h0 + tid].y, keyMin[tid]);
	}
}
