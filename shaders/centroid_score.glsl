// Centroid scores of a clustered layer (included by centroid_score.comp,
// DOT 0, and centroid_score_dot.comp, DOT 1): l[h][c] = scale · q_h · centroid_c
// (Tactic, LOG_SIZE = 0) or scale · q_h · centroid_c + ln s_c, the logit of
// cluster c's pseudo-token in Double-P (the Double-P paper, Eq. 5; −∞ for an empty
// cluster, LOG_SIZE = 1), for every query head h and cluster c of its KV
// head, the centroids in 8 bits: centroid_c[i] = r_c · m[i] · k_c[i], k_c
// signed bytes packed four to a 32-bit word (byte i mod 4 of word i/4
// holds element i, lowest first), r_c the row's float32 scale, m the KV
// head's dimension scales, so that l = r_c · Σ_i (scale · q_h[i] · m[i]) ·
// k_c[i].
//
// A workgroup scores pc.iters groups of ROWS consecutive centroids of KV
// head gl_WorkGroupID.y for the up to HB query heads of block
// gl_WorkGroupID.z. LANES lanes share a row, each reading the same 8-byte
// parts of every row (so each row is read once for all the block's heads),
// and each lane holds its parts of the block's queries, m and scale folded
// in, in registers from the start: the products need no other memory than
// the codes. A lane takes U rows of a group, and the next group's rows are
// loaded while it scores the current one. The lanes of a row meet by
// subgroup shuffles that halve the heads each round (SHUFFLE = 1), or in
// shared memory. The workgroup folds its finite scores into the heads'
// best and worst (atomic maxima of order-preserving keys, once per
// workgroup, which the next kernel reads and resets: doublep_cut,
// tactic_select).
//
// DOT = 1 takes the products with integer dot products of four bytes
// (SPV_KHR_integer_dot_product): each head's scaled query x_i = scale ·
// q_h[i] · m[i] is held in two signed bytes a_i, b_i against the head's
// step s = max_i |x_i| / 127, a_i = round(x_i / s) and b_i = round(256 ·
// (x_i − s·a_i) / s) clamped to ±127, so that x_i ≈ s·(a_i + b_i/256) (an
// error of at most s/256, 1/32 512 of the largest |x_i|), and
// l = r_c · (s/256) · Σ_i (256·a_i + b_i)·k_c[i], the sum in 32-bit
// integers (exact for D ≤ 512). A row's lanes then meet in integers.
#extension GL_EXT_control_flow_attributes : enable
#extension GL_KHR_shader_subgroup_basic : enable
#extension GL_KHR_shader_subgroup_shuffle : enable
#if DOT
#extension GL_EXT_spirv_intrinsics : require
// sdot4 is OpSDotKHR: the dot product of two words of four signed bytes
// each (packed vector format 0: 4×8 bits).
spirv_instruction(extensions = ["SPV_KHR_integer_dot_product"], capabilities = [6019, 6018], id = 4450)
int sdot4(uint x, uint y, spirv_literal int format);
#endif

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 256;   // threads, a power of two; WG·HB·U ≤ 4096
layout(constant_id = 1) const uint D = 128;
layout(constant_id = 2) const uint HB = 4;     // query heads per block: 1, 2, 4 or 8
layout(constant_id = 3) const uint LOG_SIZE = 1;
// SHUFFLE = 1 sums a row's lanes with subgroup shuffles (the host sets it
// only where shuffles work and LANES divides the subgroup size); 0 meets
// in shared memory.
layout(constant_id = 4) const uint SHUFFLE = 0;
layout(constant_id = 5) const uint LANES = 8;  // threads per centroid, a power of two, HB ≤ LANES ≤ WG
layout(constant_id = 6) const uint U = 2;      // rows a lane takes per group

const uint D4 = D / 4;
const uint D8 = D / 8;             // uvec2 (8 codes) per centroid
const uint SLOTS = WG / LANES;     // rows a group's threads take at once
const uint ROWS = SLOTS * U;       // centroids per group
const uint PER = (D8 + LANES - 1) / LANES;  // uvec2 a lane loads per row
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

shared float lanes[(1 - SHUFFLE) * (HB * ROWS * LANES - 1) + 1];  // the lanes' partial sums
shared uint keyMax[HB], keyMin[HB];
#if DOT
// The block's scaled queries quantized once a workgroup: each four
// dimensions' largest |x_i|, then the two bytes of every x_i (word w of
// head k at k·D4 + w) and each head's step s/256.
shared float quadMax[HB * D4];
shared uint bytesA[HB * D4], bytesB[HB * D4];
shared float headStep[HB];
#endif

// key maps a float to a uint of the same order.
uint key(float x) {
	uint b = floatBitsToUint(x);
	return (b & 0x80000000u) != 0 ? ~b : b | 0x80000000u;
}

// codes returns the four signed bytes of w, lowest first, exactly and
// without integer-to-float conversions: a byte with its sign bit flipped
// is the unsigned k + 128, which as the low mantissa bits of 2^23 makes
// the float 2^23 + 128 + k.
vec4 codes(uint w) {
	uint u = w ^ 0x80808080u;
	return uintBitsToFloat(uvec4(u & 0xFFu, (u >> 8) & 0xFFu, (u >> 16) & 0xFFu, u >> 24) | 0x4B000000u) - 8388736.0;
}

#if DOT
// packBytes packs the low bytes of v into a word, v.x lowest.
uint packBytes(ivec4 v) {
	return uint(v.x & 0xFF) | (uint(v.y & 0xFF) << 8) | (uint(v.z & 0xFF) << 16) | (uint(v.w) << 24);
}

// quantize writes x's two bytes a and b (four values each, packed) against
// the step s (inv = 1/s, 0 where s = 0).
void quantize(vec4 x, float s, float inv, out uint a, out uint b) {
	vec4 ai = clamp(roundEven(x * inv), -127.0, 127.0);
	vec4 bi = clamp(roundEven((x - ai * s) * (256.0 * inv)), -127.0, 127.0);
	a = packBytes(ivec4(ai));
	b = packBytes(ivec4(bi));
}
#endif

// add sums two of a lane's partial sums: floats, or with DOT the bits of
// 32-bit integers.
float add(float x, float y) {
#if DOT
	return intBitsToFloat(floatBitsToInt(x) + floatBitsToInt(y));
#else
	return x + y;
#endif
}

// loadGroup loads this lane's parts of the U rows of slot `slot` of the
// group starting at centroid c0 of KV head g (rows past the end read the
// last one), their scales and their clusters' sizes.
void loadGroup(uint g, uint c0, uint slot, uint lane, out uvec2 x[U][PER], out float r[U], out uint size[U]) {
	[[unroll]] for (uint u = 0; u < U; u++) {
		uint cc = g * pc.C + min(c0 + slot + u * SLOTS, pc.C - 1);
		[[unroll]] for (uint i = 0; i < PER; i++) x[u][i] = lane + i * LANES < D8 ? cent[cc * D8 + lane + i * LANES] : uvec2(0);
		r[u] = rowScale[cc];
		size[u] = sizes[cc];
	}
}

void main() {
	uint tid = gl_LocalInvocationID.x;
	uint g = gl_WorkGroupID.y;
	uint h0 = g * pc.groupSize + gl_WorkGroupID.z * HB;
	uint heads = min(HB, g * pc.groupSize + pc.groupSize - h0);
	uint slot = tid / LANES, lane = tid % LANES;
	uint first = gl_WorkGroupID.x * pc.iters * ROWS;  // the workgroup's first centroid
	// The head whose sums this lane ends with, and whether it writes them:
	// each shuffle round keeps half the heads on either side of a lane bit,
	// from the highest, so a lane's top bits name its head.
	uint mine = SHUFFLE != 0 ? lane / (LANES / HB) : lane;
	bool writer = (SHUFFLE != 0 ? lane % (LANES / HB) == 0 : lane < HB) && mine < heads;

	// The first group's loads in flight with the queries'.
	uvec2 x[U][PER];
	float rs[U];
	uint size[U];
	loadGroup(g, first, slot, lane, x, rs, size);
#if DOT
	// Four dimensions of one head a thread: x, and their largest |x_i|.
	vec4 xq[(HB * D4 + WG - 1) / WG];
	[[unroll]] for (uint r = 0; r < (HB * D4 + WG - 1) / WG; r++) {
		uint w = tid + r * WG, k = w / D4, j = w % D4;
		xq[r] = w < HB * D4 && k < heads ? q[(h0 + k) * D4 + j] * (pc.scale * dimScale[g * D4 + j]) : vec4(0.0);
		vec4 a = abs(xq[r]);
		if (w < HB * D4) quadMax[w] = max(max(a.x, a.y), max(a.z, a.w));
	}
#else
	vec4 ql[PER][HB], qh[PER][HB];  // this lane's parts of the queries, scaled
	[[unroll]] for (uint i = 0; i < PER; i++) {
		uint j = lane + i * LANES;
		vec4 m0 = vec4(0.0), m1 = vec4(0.0);
		if (j < D8) {
			m0 = pc.scale * dimScale[g * D4 + 2 * j];
			m1 = pc.scale * dimScale[g * D4 + 2 * j + 1];
		}
		[[unroll]] for (uint k = 0; k < HB; k++) {
			bool ok = j < D8 && k < heads;
			ql[i][k] = ok ? q[(h0 + k) * D4 + 2 * j] * m0 : vec4(0.0);
			qh[i][k] = ok ? q[(h0 + k) * D4 + 2 * j + 1] * m1 : vec4(0.0);
		}
	}
#endif
	if (tid < HB) {
		keyMax[tid] = 0;
		keyMin[tid] = 0;
	}
	barrier();
#if DOT
	// Each head's step from its quads' maxima, the bytes into shared
	// memory, then this lane's parts of them.
	[[unroll]] for (uint r = 0; r < (HB * D4 + WG - 1) / WG; r++) {
		uint w = tid + r * WG, k = w / D4;
		if (w < HB * D4) {
			float mx = 0.0;
			for (uint j = 0; j < D4; j++) mx = max(mx, quadMax[k * D4 + j]);
			float s = mx / 127.0;
			quantize(xq[r], s, mx > 0.0 ? 127.0 / mx : 0.0, bytesA[w], bytesB[w]);
			if (w % D4 == 0) headStep[k] = s / 256.0;
		}
	}
	barrier();
	uvec2 qa[PER][HB], qb[PER][HB];
	[[unroll]] for (uint i = 0; i < PER; i++) {
		uint j = lane + i * LANES;
		[[unroll]] for (uint k = 0; k < HB; k++) {
			qa[i][k] = j < D8 ? uvec2(bytesA[k * D4 + 2 * j], bytesA[k * D4 + 2 * j + 1]) : uvec2(0);
			qb[i][k] = j < D8 ? uvec2(bytesB[k * D4 + 2 * j], bytesB[k * D4 + 2 * j + 1]) : uvec2(0);
		}
	}
	float myStep = headStep[min(mine, HB - 1)];  // s/256 of head `mine`
#endif

	uint kMax = 0, kMin = 0;  // this lane's head's keys (0: none yet)
	for (uint it = 0; it < pc.iters; it++) {
		uint c0 = first + it * ROWS;  // the same on every thread
		if (c0 >= pc.C) break;
		uvec2 y[U][PER];
		float yScale[U];
		uint ySize[U];
		bool more = it + 1 < pc.iters && c0 + ROWS < pc.C;
		if (more) loadGroup(g, c0 + ROWS, slot, lane, y, yScale, ySize);

		float acc[U][HB];  // with DOT, the bits of 32-bit integers
#if DOT
		[[unroll]] for (uint u = 0; u < U; u++) {
			[[unroll]] for (uint k = 0; k < HB; k++) {
				int a = 0, b = 0;
				[[unroll]] for (uint i = 0; i < PER; i++) {
					a += sdot4(x[u][i].x, qa[i][k].x, 0) + sdot4(x[u][i].y, qa[i][k].y, 0);
					b += sdot4(x[u][i].x, qb[i][k].x, 0) + sdot4(x[u][i].y, qb[i][k].y, 0);
				}
				acc[u][k] = intBitsToFloat(a * 256 + b);
			}
		}
#else
		[[unroll]] for (uint u = 0; u < U; u++) {
			[[unroll]] for (uint k = 0; k < HB; k++) acc[u][k] = 0.0;
			[[unroll]] for (uint i = 0; i < PER; i++) {
				vec4 lo = codes(x[u][i].x), hi = codes(x[u][i].y);
				[[unroll]] for (uint k = 0; k < HB; k++) acc[u][k] += dot(lo, ql[i][k]) + dot(hi, qh[i][k]);
			}
		}
#endif
		// sum[u] ends with head `mine`'s q·k of row u, on the writers.
		float sum[U];
		if (SHUFFLE != 0) {
			[[unroll]] for (uint u = 0; u < U; u++) {
				// Round r halves the heads: a lane keeps the lower half
				// where its bit LANES >> (r + 1) is clear, the upper half
				// where set, and adds its partner's sums of them; once one
				// head is left, the remaining rounds add.
				[[unroll]] for (uint r = 0; (HB >> r) > 1; r++) {
					uint m = HB >> (r + 1), o = LANES >> (r + 1);
					bool low = (lane & o) == 0;
					[[unroll]] for (uint k = 0; k < m; k++) {
						float keep = low ? acc[u][k] : acc[u][k + m];
						float give = low ? acc[u][k + m] : acc[u][k];
						acc[u][k] = add(keep, subgroupShuffleXor(give, o));
					}
				}
				[[unroll]] for (uint o = LANES / (2 * HB); o > 0; o >>= 1) acc[u][0] = add(acc[u][0], subgroupShuffleXor(acc[u][0], o));
#if DOT
				sum[u] = float(floatBitsToInt(acc[u][0])) * myStep;
#else
				sum[u] = acc[u][0];
#endif
			}
		} else {
			[[unroll]] for (uint u = 0; u < U; u++) {
#if DOT
				[[unroll]] for (uint k = 0; k < HB; k++) lanes[(k * ROWS + slot + u * SLOTS) * LANES + lane] = float(floatBitsToInt(acc[u][k]));
#else
				[[unroll]] for (uint k = 0; k < HB; k++) lanes[(k * ROWS + slot + u * SLOTS) * LANES + lane] = acc[u][k];
#endif
			}
			barrier();
			[[unroll]] for (uint u = 0; u < U; u++) {
				sum[u] = 0.0;
				if (lane < HB) {
					[[unroll]] for (uint j = 0; j < LANES; j++) sum[u] += lanes[(lane * ROWS + slot + u * SLOTS) * LANES + j];
#if DOT
					sum[u] *= myStep;
#endif
				}
			}
			barrier();  // the next group rewrites lanes
		}
		[[unroll]] for (uint u = 0; u < U; u++) {
			uint c = c0 + slot + u * SLOTS;
			if (writer && c < pc.C) {
				float l = sum[u] * rs[u];
				l = LOG_SIZE == 0 ? l : (size[u] == 0 ? NEG : l + log(float(size[u])));
				s[(h0 + mine) * pc.C + c] = l;
				if (LOG_SIZE == 0 || size[u] != 0) {
					kMax = max(kMax, key(l));
					kMin = max(kMin, ~key(l));
				}
			}
		}
		if (more) {
			[[unroll]] for (uint u = 0; u < U; u++) {
				[[unroll]] for (uint i = 0; i < PER; i++) x[u][i] = y[u][i];
				rs[u] = yScale[u];
				size[u] = ySize[u];
			}
		}
	}
	if (writer) {
		atomicMax(keyMax[mine], kMax);
		atomicMax(keyMin[mine], kMin);
	}
	barrier();
	if (tid < heads) {
		atomicMax(ext[h0 + tid].x, keyMax[tid]);
		atomicMax(ext[h0 + tid].y, keyMin[tid]);
	}
}
