#version 450
// K-means assignment step. For every clustered token t of KV head g:
// a[t] = argmin_c (|c|² − 2 k_t·c), ties to the lower c, which is the
// nearest centroid in squared Euclidean distance. It also counts each
// cluster's members and how many tokens changed cluster.
// A workgroup takes 64 tokens and walks all centroids in tiles of 64, as a
// 64×64 matrix product over the dimension in steps of BK, each thread
// holding a 4×4 block.
#extension GL_EXT_control_flow_attributes : enable

layout(local_size_x = 256) in;
layout(constant_id = 0) const uint D = 128;  // head dimension, a multiple of BK
layout(constant_id = 1) const uint BK = 16;  // dimensions per step: 8 or 16

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

shared vec4 ks[BK][16];  // ks[d][i][j]: dimension d of token 4i+j of the tile
shared vec4 cs[BK][16];  // cs[d][i][j]: dimension d of centroid 4i+j
shared float bestD[64][16];
shared uint bestI[64][16];

void main() {
	uint tid = gl_LocalInvocationID.x;
	uint g = gl_WorkGroupID.y;
	uint t0 = gl_WorkGroupID.x * 64;
	uint tx = tid % 16;  // centroids 4tx .. 4tx+3 of a tile
	uint ty = tid / 16;  // tokens 4ty .. 4ty+3
	const float INF = 1.0 / 0.0;
	float bd[4];
	uint bi[4];
	[[unroll]] for (uint i = 0; i < 4; i++) {
		bd[i] = INF;
		bi[i] = 0;
	}
	uint keyBase = g * pc.headStride + pc.first * (D / 2);

	for (uint c0 = 0; c0 < pc.C; c0 += 64) {
		vec4 acc[4];
		[[unroll]] for (uint i = 0; i < 4; i++) acc[i] = vec4(0.0);
		for (uint d0 = 0; d0 < D; d0 += BK) {
			// Key tile: 64 tokens × BK dimensions, BK/2 words per token.
			for (uint e = tid; e < 64 * (BK / 2); e += 256) {
				uint tok = e / (BK / 2);
				uint w = e % (BK / 2);
				vec2 x = vec2(0.0);
				if (t0 + tok < pc.n) x = unpackHalf2x16(k[keyBase + (t0 + tok) * (D / 2) + d0 / 2 + w]);
				ks[2 * w][tok / 4][tok % 4] = x.x;
				ks[2 * w + 1][tok / 4][tok % 4] = x.y;
			}
			// Centroid tile: 64 centroids × BK dimensions.
			for (uint e = tid; e < 64 * BK; e += 256) {
				uint cc = e / BK;
				uint d = e % BK;
				float x = 0.0;
				if (c0 + cc < pc.C) x = cent[(g * pc.C + c0 + cc) * D + d0 + d];
				cs[d][cc / 4][cc % 4] = x;
			}
			barrier();
			[[unroll]] for (uint d = 0; d < BK; d++) {
				vec4 a = ks[d][ty];
				vec4 b = cs[d][tx];
				acc[0] += a.x * b;
				acc[1] += a.y * b;
				acc[2] += a.z * b;
				acc[3] += a.w * b;
			}
			barrier();
		}
		[[unroll]] for (uint j = 0; j < 4; j++) {
			uint c = c0 + 4 * tx + j;
			if (c < pc.C) {
				float cn = cnorm[g * pc.C + c];
				[[unroll]] for (uint i = 0; i < 4; i++) {
					float dist = cn - 2.0 * acc[i][j];
					if (dist < bd[i]) {
						bd[i] = dist;
						bi[i] = c;
					}
				}
			}
		}
	}

	[[unroll]] for (uint i = 0; i < 4; i++) {
		bestD[4 * ty + i][tx] = bd[i];
		bestI[4 * ty + i][tx] = bi[i];
	}
	barrier();
	if (tid < 64 && t0 + tid < pc.n) {
		float d = bestD[tid][0];
		uint c = bestI[tid][0];
		for (uint x = 1; x < 16; x++) {
			float dx = bestD[tid][x];
			uint cx = bestI[tid][x];
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
