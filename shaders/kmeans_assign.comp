#version 450
// K-means assignment step. The clustered tokens are cut into spans of S
// tokens (the last one may be shorter); span s's tokens [s·S, s·S+S) have
// clusters [s·CS, s·CS+CS) (fewer in the last span) and no others. For
// every clustered token t of KV head g, in span s:
// a[t] = argmin over c of span s's clusters of (|c|² − 2 k_t·c), ties to
// the lower c, which is the nearest centroid in squared Euclidean distance.
// It also counts each cluster's members (into counts, zeroed by the update
// step before) and how many tokens of each span changed cluster
// (changed[iter][g][s]). A span whose previous step changed nothing has
// converged and is skipped. With S = n and CS = C this is whole-context
// K-means. kmeans_assign_nv is the same step on NVIDIA's cooperative
// matrices.
// A workgroup takes 128 tokens of one span and walks the span's centroids
// in tiles of 128, as a 128×128 matrix product over the dimension in steps
// of BK; each thread holds an 8×8 block in named registers: written out,
// not as arrays, since arrays indexed in loops ended in slow local memory
// on NVIDIA's compiler. The grid is ceil(S/128) workgroups per span along
// x, one row per head along y.

layout(local_size_x = 256) in;
layout(constant_id = 0) const uint D = 128;  // head dimension, a multiple of BK
layout(constant_id = 1) const uint BK = 16;  // dimensions per step: 8 or 16

const uint T = 128;  // tokens, and centroids, per tile

layout(std430, binding = 0) readonly buffer Keys { uint k[]; };         // fp16 pairs, [heads][headStride]
layout(std430, binding = 1) readonly buffer Centroids { float cent[]; }; // [heads][C][D]
layout(std430, binding = 2) readonly buffer Norms { float cnorm[]; };    // [heads][C]
layout(std430, binding = 3) buffer Assign { uint assign[]; };            // [heads][n]
layout(std430, binding = 4) buffer Counts { uint counts[]; };            // [heads][C]
layout(std430, binding = 5) buffer Changed { uint changed[]; };          // [iterations][heads][spans]

layout(push_constant) uniform Push {
	uint n;           // clustered tokens per head
	uint first;       // first clustered token
	uint headStride;  // uint words between KV heads in Keys
	uint C;           // clusters per head
	uint iter;        // this step's row of changed
	uint S;           // tokens per span
	uint CS;          // clusters per span (but the last)
} pc;

// ks[d][i]: dimension d of tokens 4i..4i+3 of the tile; cs likewise for
// centroids. At the end they hold each thread's best distances and indices.
shared vec4 ks[16][T / 4];  // BK <= 16 rows in use while multiplying
shared vec4 cs[16][T / 4];
shared uint moved;  // tokens of this workgroup that changed cluster

// consider keeps (dist, c) if it beats (bd, bi): smaller, or equal and lower.
void consider(float dist, uint c, inout float bd, inout uint bi) {
	if (dist < bd || (dist == bd && c < bi)) {
		bd = dist;
		bi = c;
	}
}

void main() {
	uint tid = gl_LocalInvocationID.x;
	uint g = gl_WorkGroupID.y;
	uint heads = gl_NumWorkGroups.y;
	uint spans = (pc.n + pc.S - 1) / pc.S;
	uint perSpan = (pc.S + T - 1) / T;  // workgroups per span
	uint s = gl_WorkGroupID.x / perSpan;
	uint t0 = s * pc.S + (gl_WorkGroupID.x % perSpan) * T;
	uint tEnd = min(s * pc.S + pc.S, pc.n);  // this span's tokens end here
	uint cBegin = s * pc.CS;                 // and its clusters span [cBegin, cEnd)
	uint cEnd = min(cBegin + pc.CS, pc.C);
	if (t0 >= tEnd || (pc.iter > 0 && changed[((pc.iter - 1) * heads + g) * spans + s] == 0)) return;
	if (tid == 0) moved = 0;
	uint tx = tid % 16;  // centroids 4tx..4tx+3 and 64+4tx..64+4tx+3 of a tile
	uint ty = tid / 16;  // tokens 4ty..4ty+3 and 64+4ty..64+4ty+3
	const float INF = 1.0 / 0.0;
	float bd0 = INF;
	uint bi0 = 0;
	float bd1 = INF;
	uint bi1 = 0;
	float bd2 = INF;
	uint bi2 = 0;
	float bd3 = INF;
	uint bi3 = 0;
	float bd4 = INF;
	uint bi4 = 0;
	float bd5 = INF;
	uint bi5 = 0;
	float bd6 = INF;
	uint bi6 = 0;
	float bd7 = INF;
	uint bi7 = 0;
	uint keyBase = g * pc.headStride + pc.first * (D / 2);

	for (uint c0 = cBegin; c0 < cEnd; c0 += T) {
		vec4 acc00 = vec4(0.0);
		vec4 acc01 = vec4(0.0);
		vec4 acc10 = vec4(0.0);
		vec4 acc11 = vec4(0.0);
		vec4 acc20 = vec4(0.0);
		vec4 acc21 = vec4(0.0);
		vec4 acc30 = vec4(0.0);
		vec4 acc31 = vec4(0.0);
		vec4 acc40 = vec4(0.0);
		vec4 acc41 = vec4(0.0);
		vec4 acc50 = vec4(0.0);
		vec4 acc51 = vec4(0.0);
		vec4 acc60 = vec4(0.0);
		vec4 acc61 = vec4(0.0);
		vec4 acc70 = vec4(0.0);
		vec4 acc71 = vec4(0.0);
		for (uint d0 = 0; d0 < D; d0 += BK) {
			for (uint e = tid; e < T * (BK / 2); e += 256) {
				uint tok = e / (BK / 2);
				uint w = e % (BK / 2);
				vec2 x = vec2(0.0);
				if (t0 + tok < tEnd) x = unpackHalf2x16(k[keyBase + (t0 + tok) * (D / 2) + d0 / 2 + w]);
				ks[2 * w][tok / 4][tok % 4] = x.x;
				ks[2 * w + 1][tok / 4][tok % 4] = x.y;
			}
			for (uint e = tid; e < T * BK; e += 256) {
				uint cc = e / BK;
				uint d = e % BK;
				float x = 0.0;
				if (c0 + cc < cEnd) x = cent[(g * pc.C + c0 + cc) * D + d0 + d];
				cs[d][cc / 4][cc % 4] = x;
			}
			barrier();
			for (uint d = 0; d < BK; d++) {
				vec4 a0 = ks[d][ty];
				vec4 a1 = ks[d][16 + ty];
				vec4 b0 = cs[d][tx];
				vec4 b1 = cs[d][16 + tx];
				acc00 += a0.x * b0;
				acc01 += a0.x * b1;
				acc10 += a0.y * b0;
				acc11 += a0.y * b1;
				acc20 += a0.z * b0;
				acc21 += a0.z * b1;
				acc30 += a0.w * b0;
				acc31 += a0.w * b1;
				acc40 += a1.x * b0;
				acc41 += a1.x * b1;
				acc50 += a1.y * b0;
				acc51 += a1.y * b1;
				acc60 += a1.z * b0;
				acc61 += a1.z * b1;
				acc70 += a1.w * b0;
				acc71 += a1.w * b1;
			}
			barrier();
		}
		{
			uint c = c0 + 0 + 4 * tx + 0;
			if (c < cEnd) {
				float cn = cnorm[g * pc.C + c];
				consider(cn - 2.0 * acc00.x, c, bd0, bi0);
				consider(cn - 2.0 * acc10.x, c, bd1, bi1);
				consider(cn - 2.0 * acc20.x, c, bd2, bi2);
				consider(cn - 2.0 * acc30.x, c, bd3, bi3);
				consider(cn - 2.0 * acc40.x, c, bd4, bi4);
				consider(cn - 2.0 * acc50.x, c, bd5, bi5);
				consider(cn - 2.0 * acc60.x, c, bd6, bi6);
				consider(cn - 2.0 * acc70.x, c, bd7, bi7);
			}
		}
		{
			uint c = c0 + 0 + 4 * tx + 1;
			if (c < cEnd) {
				float cn = cnorm[g * pc.C + c];
				consider(cn - 2.0 * acc00.y, c, bd0, bi0);
				consider(cn - 2.0 * acc10.y, c, bd1, bi1);
				consider(cn - 2.0 * acc20.y, c, bd2, bi2);
				consider(cn - 2.0 * acc30.y, c, bd3, bi3);
				consider(cn - 2.0 * acc40.y, c, bd4, bi4);
				consider(cn - 2.0 * acc50.y, c, bd5, bi5);
				consider(cn - 2.0 * acc60.y, c, bd6, bi6);
				consider(cn - 2.0 * acc70.y, c, bd7, bi7);
			}
		}
		{
			uint c = c0 + 0 + 4 * tx + 2;
			if (c < cEnd) {
				float cn = cnorm[g * pc.C + c];
				consider(cn - 2.0 * acc00.z, c, bd0, bi0);
				consider(cn - 2.0 * acc10.z, c, bd1, bi1);
				consider(cn - 2.0 * acc20.z, c, bd2, bi2);
				consider(cn - 2.0 * acc30.z, c, bd3, bi3);
				consider(cn - 2.0 * acc40.z, c, bd4, bi4);
				consider(cn - 2.0 * acc50.z, c, bd5, bi5);
				consider(cn - 2.0 * acc60.z, c, bd6, bi6);
				consider(cn - 2.0 * acc70.z, c, bd7, bi7);
			}
		}
		{
			uint c = c0 + 0 + 4 * tx + 3;
			if (c < cEnd) {
				float cn = cnorm[g * pc.C + c];
				consider(cn - 2.0 * acc00.w, c, bd0, bi0);
				consider(cn - 2.0 * acc10.w, c, bd1, bi1);
				consider(cn - 2.0 * acc20.w, c, bd2, bi2);
				consider(cn - 2.0 * acc30.w, c, bd3, bi3);
				consider(cn - 2.0 * acc40.w, c, bd4, bi4);
				consider(cn - 2.0 * acc50.w, c, bd5, bi5);
				consider(cn - 2.0 * acc60.w, c, bd6, bi6);
				consider(cn - 2.0 * acc70.w, c, bd7, bi7);
			}
		}
		{
			uint c = c0 + 64 + 4 * tx + 0;
			if (c < cEnd) {
				float cn = cnorm[g * pc.C + c];
				consider(cn - 2.0 * acc01.x, c, bd0, bi0);
				consider(cn - 2.0 * acc11.x, c, bd1, bi1);
				consider(cn - 2.0 * acc21.x, c, bd2, bi2);
				consider(cn - 2.0 * acc31.x, c, bd3, bi3);
				consider(cn - 2.0 * acc41.x, c, bd4, bi4);
				consider(cn - 2.0 * acc51.x, c, bd5, bi5);
				consider(cn - 2.0 * acc61.x, c, bd6, bi6);
				consider(cn - 2.0 * acc71.x, c, bd7, bi7);
			}
		}
		{
			uint c = c0 + 64 + 4 * tx + 1;
			if (c < cEnd) {
				float cn = cnorm[g * pc.C + c];
				consider(cn - 2.0 * acc01.y, c, bd0, bi0);
				consider(cn - 2.0 * acc11.y, c, bd1, bi1);
				consider(cn - 2.0 * acc21.y, c, bd2, bi2);
				consider(cn - 2.0 * acc31.y, c, bd3, bi3);
				consider(cn - 2.0 * acc41.y, c, bd4, bi4);
				consider(cn - 2.0 * acc51.y, c, bd5, bi5);
				consider(cn - 2.0 * acc61.y, c, bd6, bi6);
				consider(cn - 2.0 * acc71.y, c, bd7, bi7);
			}
		}
		{
			uint c = c0 + 64 + 4 * tx + 2;
			if (c < cEnd) {
				float cn = cnorm[g * pc.C + c];
				consider(cn - 2.0 * acc01.z, c, bd0, bi0);
				consider(cn - 2.0 * acc11.z, c, bd1, bi1);
				consider(cn - 2.0 * acc21.z, c, bd2, bi2);
				consider(cn - 2.0 * acc31.z, c, bd3, bi3);
				consider(cn - 2.0 * acc41.z, c, bd4, bi4);
				consider(cn - 2.0 * acc51.z, c, bd5, bi5);
				consider(cn - 2.0 * acc61.z, c, bd6, bi6);
				consider(cn - 2.0 * acc71.z, c, bd7, bi7);
			}
		}
		{
			uint c = c0 + 64 + 4 * tx + 3;
			if (c < cEnd) {
				float cn = cnorm[g * pc.C + c];
				consider(cn - 2.0 * acc01.w, c, bd0, bi0);
				consider(cn - 2.0 * acc11.w, c, bd1, bi1);
				consider(cn - 2.0 * acc21.w, c, bd2, bi2);
				consider(cn - 2.0 * acc31.w, c, bd3, bi3);
				consider(cn - 2.0 * acc41.w, c, bd4, bi4);
				consider(cn - 2.0 * acc51.w, c, bd5, bi5);
				consider(cn - 2.0 * acc61.w, c, bd6, bi6);
				consider(cn - 2.0 * acc71.w, c, bd7, bi7);
			}
		}
	}

	// Per token, the best of the 16 threads that saw its centroids.
	ks[tx][0 + ty][0] = bd0;
	cs[tx][0 + ty][0] = uintBitsToFloat(bi0);
	ks[tx][0 + ty][1] = bd1;
	cs[tx][0 + ty][1] = uintBitsToFloat(bi1);
	ks[tx][0 + ty][2] = bd2;
	cs[tx][0 + ty][2] = uintBitsToFloat(bi2);
	ks[tx][0 + ty][3] = bd3;
	cs[tx][0 + ty][3] = uintBitsToFloat(bi3);
	ks[tx][16 + ty][0] = bd4;
	cs[tx][16 + ty][0] = uintBitsToFloat(bi4);
	ks[tx][16 + ty][1] = bd5;
	cs[tx][16 + ty][1] = uintBitsToFloat(bi5);
	ks[tx][16 + ty][2] = bd6;
	cs[tx][16 + ty][2] = uintBitsToFloat(bi6);
	ks[tx][16 + ty][3] = bd7;
	cs[tx][16 + ty][3] = uintBitsToFloat(bi7);
	barrier();
	if (tid < T && t0 + tid < tEnd) {
		float d = INF;
		uint c = 0xffffffffu;
		for (uint x = 0; x < 16; x++) {
			float dx = ks[x][tid / 4][tid % 4];
			uint cx = floatBitsToUint(cs[x][tid / 4][tid % 4]);
			if (dx < d || (dx == d && cx < c)) {
				d = dx;
				c = cx;
			}
		}
		uint t = g * pc.n + t0 + tid;
		if (assign[t] != c) atomicAdd(moved, 1);
		assign[t] = c;
		atomicAdd(counts[g * pc.C + c], 1);
	}
	barrier();
	if (tid == 0 && moved > 0) atomicAdd(changed[(pc.iter * heads + g) * spans + s], moved);
}
