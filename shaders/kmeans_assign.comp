#version 450
// K-means assignment step. For every clustered token t of KV head g:
// a[t] = argmin_c (|c|² − 2 k_t·c), ties to the lower c, which is the
// nearest centroid in squared Euclidean distance. It also counts each
// cluster's members and how many tokens changed cluster.
// A workgroup takes 128 tokens and walks all centroids in tiles of 128, as
// a 128×128 matrix product over the dimension in steps of BK, each thread
// holding an 8×8 block.
#extension GL_EXT_control_flow_attributes : enable

layout(local_size_x = 256) in;
layout(constant_id = 0) const uint D = 128;  // head dimension, a multiple of BK
layout(constant_id = 1) const uint BK = 16;  // dimensions per step: 8 or 16

const uint T = 128;  // tokens, and centroids, per tile

layout(std430, binding = 0) readonly buffer Keys { uint k[]; };         // fp16 pairs, [heads][headStride]
layout(std430, binding = 1) readonly buffer Centroids { float cent[]; }; // [heads][C][D]
layout(std430, binding = 2) readonly buffer Norms { float cnorm[]; };    // [heads][C]
layout(std430, binding = 3) buffer Assign { uint assign[]; };            // [heads][n]
layout(std430, binding = 4) buffer Counts { uint counts[]; };            // [heads][C]
layout(std430, binding = 5) buffer Changed { uint changed[]; };          // [heads]

layout(push_constant) uniform Push {
	uint n;           // clustered tokens per head
	uint first;       // first clustered token
	uint headStride;  // uint words between KV heads in Keys
	uint C;           // clusters per head
} pc;

// ks[d][i]: dimension d of tokens 4i..4i+3 of the tile; cs likewise for
// centroids. At the end they hold each thread's best distances and indices.
shared vec4 ks[16][T / 4];  // BK <= 16 rows in use while multiplying
shared vec4 cs[16][T / 4];

void main() {
	uint tid = gl_LocalInvocationID.x;
	uint g = gl_WorkGroupID.y;
	uint t0 = gl_WorkGroupID.x * T;
	uint tx = tid % 16;  // centroids 4tx..4tx+3 and 64+4tx..64+4tx+3 of a tile
	uint ty = tid / 16;  // tokens 4ty..4ty+3 and 64+4ty..64+4ty+3
	const float INF = 1.0 / 0.0;
	float bd[8];
	uint bi[8];
	[[unroll]] for (uint i = 0; i < 8; i++) {
		bd[i] = INF;
		bi[i] = 0;
	}
	uint keyBase = g * pc.headStride + pc.first * (D / 2);

	for (uint c0 = 0; c0 < pc.C; c0 += T) {
		vec4 acc[16];  // acc[2i + h][j]: token row i (of 8), centroid 4h + j
		[[unroll]] for (uint i = 0; i < 16; i++) acc[i] = vec4(0.0);
		for (uint d0 = 0; d0 < D; d0 += BK) {
			for (uint e = tid; e < T * (BK / 2); e += 256) {
				uint tok = e / (BK / 2);
				uint w = e % (BK / 2);
				vec2 x = vec2(0.0);
				if (t0 + tok < pc.n) x = unpackHalf2x16(k[keyBase + (t0 + tok) * (D / 2) + d0 / 2 + w]);
				ks[2 * w][tok / 4][tok % 4] = x.x;
				ks[2 * w + 1][tok / 4][tok % 4] = x.y;
			}
			for (uint e = tid; e < T * BK; e += 256) {
				uint cc = e / BK;
				uint d = e % BK;
				float x = 0.0;
				if (c0 + cc < pc.C) x = cent[(g * pc.C + c0 + cc) * D + d0 + d];
				cs[d][cc / 4][cc % 4] = x;
			}
			barrier();
			[[unroll]] for (uint d = 0; d < BK; d++) {
				vec4 a0 = ks[d][ty];
				vec4 a1 = ks[d][16 + ty];
				vec4 b0 = cs[d][tx];
				vec4 b1 = cs[d][16 + tx];
				[[unroll]] for (uint i = 0; i < 4; i++) {
					acc[2 * i] += a0[i] * b0;
					acc[2 * i + 1] += a0[i] * b1;
					acc[8 + 2 * i] += a1[i] * b0;
					acc[8 + 2 * i + 1] += a1[i] * b1;
				}
			}
			barrier();
		}
		[[unroll]] for (uint h = 0; h < 2; h++) {
			[[unroll]] for (uint j = 0; j < 4; j++) {
				uint c = c0 + 64 * h + 4 * tx + j;
				if (c < pc.C) {
					float cn = cnorm[g * pc.C + c];
					[[unroll]] for (uint i = 0; i < 8; i++) {
						float dist = cn - 2.0 * acc[2 * i + h][j];
						if (dist < bd[i] || (dist == bd[i] && c < bi[i])) {
							bd[i] = dist;
							bi[i] = c;
						}
					}
				}
			}
		}
	}

	// Per token, the best of the 16 threads that saw its centroids: token
	// row i of thread (ty, tx) is slot [tx][token] of ks (distances) and cs
	// (indices, as float bits).
	[[unroll]] for (uint i = 0; i < 8; i++) {
		uint tok = (i < 4 ? 0 : 64) + 4 * ty + i % 4;
		ks[tx][tok / 4][tok % 4] = bd[i];
		cs[tx][tok / 4][tok % 4] = uintBitsToFloat(bi[i]);
	}
	barrier();
	if (tid < T && t0 + tid < pc.n) {
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
		if (assign[t] != c) atomicAdd(changed[g], 1);
		assign[t] = c;
		atomicAdd(counts[g * pc.C + c], 1);
	}
}
