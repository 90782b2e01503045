#version 450
// K-means assignment step on NVIDIA's cooperative matrices (tensor cores):
// the same result as kmeans_assign, a[t] = argmin_c (|c|² − 2 k_t·c) over
// the centroids of the token's span with ties to the lower c, counts and
// changed likewise, a converged span skipped. The dot products k_t·c are
// 16×16×16 fp16 matrix products accumulated in fp32: the keys are fp16
// already, and each centroid comes as two fp16 parts, hi + lo
// (kmeans_update's Halves), whose products are both accumulated, so that
// the sum is as accurate as an fp32 one.
//
// A workgroup has SG subgroups of 32 invocations; each subgroup owns 32
// tokens, whose keys it holds as 2×(D/16) A fragments for the whole run.
// The workgroup walks the centroids in tiles of TN = 32, staged in shared
// memory as fp16; each subgroup multiplies its tokens by the tile (2×2
// accumulators), stores each 16×16 result in its scratch and takes the
// per-token minimum from there. A workgroup's tokens lie in one span: the
// grid is ceil(S/WG) workgroups per span along x, one row per head along
// y. Needs D a multiple of 16, at most 128, a subgroup size of 32, and at
// least 16 tokens in all (a span may have fewer).

#extension GL_NV_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_EXT_shader_16bit_storage : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#extension GL_EXT_control_flow_attributes : require

layout(local_size_x_id = 1) in;
layout(constant_id = 0) const uint D = 128;   // head dimension
layout(constant_id = 1) const uint WG = 256;  // invocations: SG subgroups of 32

const uint SG = WG / 32;
const uint KS = D / 16;      // fragments along the dimension
const uint TN = 32;          // centroids per tile
const uint RS = 2 * D + 8;   // halves per staged centroid row: hi, lo, padding

layout(std430, binding = 0) readonly buffer Keys { float16_t kh[]; };     // [heads][2·headStride]
layout(std430, binding = 1) readonly buffer Halves { uvec4 cenh[]; };     // [heads][C][D/4]: hi then lo
layout(std430, binding = 2) readonly buffer Norms { float cnorm[]; };     // [heads][C]
layout(std430, binding = 3) buffer Assign { uint assign[]; };             // [heads][n]
layout(std430, binding = 4) buffer Counts { uint counts[]; };             // [heads][C]
layout(std430, binding = 5) buffer Changed { uint changed[]; };           // [iterations][heads][spans]

layout(push_constant) uniform Push {
	uint n;           // clustered tokens per head
	uint first;       // first clustered token
	uint headStride;  // uint words between KV heads in Keys
	uint C;           // clusters per head
	uint iter;        // this step's row of changed
	uint S;           // tokens per span
	uint CS;          // clusters per span (but the last)
} pc;

shared float16_t cs[TN * RS];
shared float cn[TN];
shared float scratch[SG][256];
shared uint moved;

#define FRAG fcoopmatNV<16, gl_ScopeSubgroup, 16, 16>
#define ACC fcoopmatNV<32, gl_ScopeSubgroup, 16, 16>

void consider(float dist, uint c, inout float bd, inout uint bi) {
	if (dist < bd || (dist == bd && c < bi)) {
		bd = dist;
		bi = c;
	}
}

const uint PRE = (TN * (D / 4) + WG - 1) / WG;  // uvec4 of a tile per invocation

// fetch loads invocation tid's part of the tile of centroids from c0: the
// uvec4 e = tid + i·WG is uvec4 e % (D/4) of centroid c0 + e / (D/4) (zero
// from cEnd on), and for tid < TN the norm of centroid c0 + tid.
void fetch(uint c0, uint cEnd, uint tid, uint g, inout uvec4 pre[PRE], inout float preNorm) {
	[[unroll]] for (uint i = 0; i < PRE; i++) {
		uint e = tid + i * WG;
		uint cc = e / (D / 4);
		pre[i] = uvec4(0);
		if (e < TN * (D / 4) && c0 + cc < cEnd) pre[i] = cenh[(g * pc.C + c0 + cc) * (D / 4) + e % (D / 4)];
	}
	if (tid < TN) preNorm = c0 + tid < cEnd ? cnorm[g * pc.C + c0 + tid] : 0.0;
}

void main() {
	uint tid = gl_LocalInvocationID.x;
	uint sg = tid / 32;
	uint lane = tid % 32;
	uint g = gl_WorkGroupID.y;
	uint heads = gl_NumWorkGroups.y;
	uint spans = (pc.n + pc.S - 1) / pc.S;
	uint perSpan = (pc.S + WG - 1) / WG;  // workgroups per span
	uint s = gl_WorkGroupID.x / perSpan;
	uint t0 = s * pc.S + (gl_WorkGroupID.x % perSpan) * WG;
	uint tEnd = min(s * pc.S + pc.S, pc.n);  // this span's tokens end here
	uint cBegin = s * pc.CS;                 // and its clusters span [cBegin, cEnd)
	uint cEnd = min(cBegin + pc.CS, pc.C);
	if (t0 >= tEnd || (pc.iter > 0 && changed[((pc.iter - 1) * heads + g) * spans + s] == 0)) return;
	if (tid == 0) moved = 0;

	// This subgroup's tokens: two blocks of 16 rows. A block that would run
	// past the span's end is moved back to end there (n ≥ 16; in a span of
	// fewer than 16 tokens it starts in the span before); its rows before
	// the nominal start belong to another block and are not written.
	uint nominal0 = t0 + sg * 32;
	uint last = max(tEnd, 16) - 16;
	uint r0 = min(nominal0, last);
	uint r1 = min(nominal0 + 16, last);
	uint keyBase = g * pc.headStride * 2 + pc.first * D;
	FRAG a0[KS];
	FRAG a1[KS];
	[[unroll]] for (uint s = 0; s < KS; s++) {
		coopMatLoadNV(a0[s], kh, keyBase + r0 * D + s * 16, D, false);
		coopMatLoadNV(a1[s], kh, keyBase + r1 * D + s * 16, D, false);
	}

	const float INF = 1.0 / 0.0;
	// This lane's best for token row lane%16 of each block, over the
	// centroids of the first (bd0, bd1) and second (bd0b, bd1b) tile half.
	float bd0 = INF, bd1 = INF, bd0b = INF, bd1b = INF;
	uint bi0 = 0, bi1 = 0, bi0b = 0, bi1b = 0;
	uint row = lane % 16;
	uint col0 = (lane / 16) * 8;  // this lane's 8 of the 16 columns
	uint rot = (row / 2) % 8;     // read them from column col0 + rot on: no bank conflicts

	// The next tile waits in registers while this one is multiplied.
	uvec4 pre[PRE];
	float preNorm = 0.0;
	fetch(cBegin, cEnd, tid, g, pre, preNorm);
	for (uint c0 = cBegin; c0 < cEnd; c0 += TN) {
		barrier();
		[[unroll]] for (uint i = 0; i < PRE; i++) {
			uint e = tid + i * WG;
			if (e < TN * (D / 4)) {
				uint o = (e / (D / 4)) * RS + 8 * (e % (D / 4));  // halves 8q..8q+7 of row cc
				uvec4 v = pre[i];
				f16vec2 h;
				h = unpackFloat2x16(v.x);
				cs[o + 0] = h.x;
				cs[o + 1] = h.y;
				h = unpackFloat2x16(v.y);
				cs[o + 2] = h.x;
				cs[o + 3] = h.y;
				h = unpackFloat2x16(v.z);
				cs[o + 4] = h.x;
				cs[o + 5] = h.y;
				h = unpackFloat2x16(v.w);
				cs[o + 6] = h.x;
				cs[o + 7] = h.y;
			}
		}
		if (tid < TN) cn[tid] = preNorm;
		barrier();
		if (c0 + TN < cEnd) fetch(c0 + TN, cEnd, tid, g, pre, preNorm);

		ACC acc00 = ACC(0.0);
		ACC acc01 = ACC(0.0);
		ACC acc10 = ACC(0.0);
		ACC acc11 = ACC(0.0);
		[[unroll]] for (uint s = 0; s < KS; s++) {
			FRAG bh0, bl0, bh1, bl1;
			// B is dimension × centroid: column j is centroid row j of cs.
			coopMatLoadNV(bh0, cs, s * 16, RS, true);
			coopMatLoadNV(bl0, cs, D + s * 16, RS, true);
			coopMatLoadNV(bh1, cs, 16 * RS + s * 16, RS, true);
			coopMatLoadNV(bl1, cs, 16 * RS + D + s * 16, RS, true);
			acc00 = coopMatMulAddNV(a0[s], bh0, acc00);
			acc01 = coopMatMulAddNV(a0[s], bh1, acc01);
			acc10 = coopMatMulAddNV(a1[s], bh0, acc10);
			acc11 = coopMatMulAddNV(a1[s], bh1, acc11);
			acc00 = coopMatMulAddNV(a0[s], bl0, acc00);
			acc01 = coopMatMulAddNV(a0[s], bl1, acc01);
			acc10 = coopMatMulAddNV(a1[s], bl0, acc10);
			acc11 = coopMatMulAddNV(a1[s], bl1, acc11);
		}

		// Each 16×16 product (tokens × centroids) goes through scratch; a
		// lane takes the best of its 8 columns in a tree, then merges it
		// into its running best for that product's place.
		[[unroll]] for (uint f = 0; f < 4; f++) {
			uint j = f % 2;  // centroid half of the tile
			if (f == 0) coopMatStoreNV(acc00, scratch[sg], 0, 16, false);
			if (f == 1) coopMatStoreNV(acc01, scratch[sg], 0, 16, false);
			if (f == 2) coopMatStoreNV(acc10, scratch[sg], 0, 16, false);
			if (f == 3) coopMatStoreNV(acc11, scratch[sg], 0, 16, false);
			subgroupMemoryBarrierShared();
			subgroupBarrier();
			float d[8];
			uint ix[8];
			[[unroll]] for (uint x = 0; x < 8; x++) {
				uint col = col0 + (x + rot) % 8;
				uint cc = j * 16 + col;
				ix[x] = c0 + cc;
				d[x] = c0 + cc < cEnd ? cn[cc] - 2.0 * scratch[sg][row * 16 + col] : INF;
			}
			subgroupMemoryBarrierShared();
			subgroupBarrier();
			[[unroll]] for (uint w = 1; w < 8; w *= 2) {
				[[unroll]] for (uint x = 0; x < 8; x += 2 * w) consider(d[x + w], ix[x + w], d[x], ix[x]);
			}
			if (f == 0) consider(d[0], ix[0], bd0, bi0);
			if (f == 1) consider(d[0], ix[0], bd0b, bi0b);
			if (f == 2) consider(d[0], ix[0], bd1, bi1);
			if (f == 3) consider(d[0], ix[0], bd1b, bi1b);
		}
	}
	consider(bd0b, bi0b, bd0, bi0);
	consider(bd1b, bi1b, bd1, bi1);

	// Lanes l and l+16 saw the two halves of the same token's columns.
	float od0 = subgroupShuffleXor(bd0, 16);
	uint oi0 = subgroupShuffleXor(bi0, 16);
	float od1 = subgroupShuffleXor(bd1, 16);
	uint oi1 = subgroupShuffleXor(bi1, 16);
	consider(od0, oi0, bd0, bi0);
	consider(od1, oi1, bd1, bi1);
	// Lanes 0..15 write block 0's row, lanes 16..31 block 1's.
	uint r = lane < 16 ? r0 + row : r1 + row;
	uint nominal = lane < 16 ? nominal0 : nominal0 + 16;
	uint c = lane < 16 ? bi0 : bi1;
	if (r >= nominal && r < tEnd) {
		uint t = g * pc.n + r;
		if (assign[t] != c) atomicAdd(moved, 1);
		assign[t] = c;
		atomicAdd(counts[g * pc.C + c], 1);
	}
	barrier();
	if (tid == 0 && moved > 0) atomicAdd(changed[(pc.iter * heads + g) * spans + s], moved);
}
