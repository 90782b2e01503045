#version 450
// H2O's prompt phase (H2OSelector.Observe): the logits of a dense softmax
// over every slot and its normalisers, for h2o_select to accumulate. (A
// decode step's logits and normalisers come from its attention instead,
// AttentionRecord.)
//
// A workgroup takes SPAN consecutive slots below pc.n of KV head
// gl_WorkGroupID.y for the up to HB query heads of block gl_WorkGroupID.z.
// It writes row[h][t] = scale · q_h · k_t for each of its slots and its
// heads' partial (max, Σ exp(l − max)) over them, scoring ROWS slots at a
// time, LANES lanes sharing a slot. The last workgroup of the block to
// arrive (an arrival counter; no workgroup waits for another) merges the
// partials into mz[h] = (m, z), the max and the normaliser, and resets
// the counter.
#extension GL_EXT_control_flow_attributes : enable

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 256;  // threads, a power of two, at least 8
layout(constant_id = 1) const uint D = 128;   // head dimension, a multiple of 8
layout(constant_id = 2) const uint HB = 4;    // query heads per block, 1 to 8
layout(constant_id = 3) const uint SPAN = 512;  // slots a workgroup takes, a multiple of WG

const uint D4 = D / 4;
const uint DV = D / 8;         // uvec4 per fp16 key row
const uint LANES = 8;          // threads per slot
const uint ROWS = WG / LANES;  // slots scored at once
const float NEG = -1.0 / 0.0;

layout(std430, binding = 0) readonly buffer Queries { vec4 q[]; };     // [Hq][D/4]
layout(std430, binding = 1) readonly buffer Keys { uvec4 k[]; };       // [Hkv][headStride]
layout(std430, binding = 2) writeonly buffer Rows { float row[]; };    // [Hq][R]
// Written by every workgroup of a block, read by the last: coherent.
layout(std430, binding = 3) coherent buffer Part { vec2 part[]; };     // [Hq][W]
layout(std430, binding = 4) writeonly buffer MZ { vec2 mz[]; };        // [Hq]
layout(std430, binding = 5) coherent buffer Arrived { uint arrived[]; }; // [blocks], 0 between dispatches

layout(push_constant) uniform Push {
	uint groupSize;   // query heads per KV head
	float scale;      // multiplies q·k
	uint headStride;  // uvec4 words between consecutive KV heads
	uint n;           // slots stored (the grid covers them)
	uint R;           // row stride per query head: the layer's capacity
	uint W;           // partial stride per query head: the most workgroups in x
} pc;

shared vec4 qs[HB][D4];
shared float scratch[HB * WG];
shared float lg[HB][ROWS];
shared vec2 red[WG];
shared bool last;

// merge combines two (max, Σ exp(l − max)) pairs.
vec2 merge(vec2 a, vec2 b) {
	float m = max(a.x, b.x);
	if (m == NEG) return vec2(NEG, 0.0);
	return vec2(m, a.y * exp(a.x - m) + b.y * exp(b.x - m));
}

void main() {
	uint tid = gl_LocalInvocationID.x;
	uint g = gl_WorkGroupID.y;
	uint block = g * gl_NumWorkGroups.z + gl_WorkGroupID.z;
	uint h0 = g * pc.groupSize + gl_WorkGroupID.z * HB;
	uint heads = min(HB, g * pc.groupSize + pc.groupSize - h0);
	for (uint i = tid; i < heads * D4; i += WG) qs[i / D4][i % D4] = q[h0 * D4 + i] * pc.scale;
	barrier();
	uint s0 = gl_WorkGroupID.x * SPAN;
	uint count = min(SPAN, pc.n - min(pc.n, s0));

	// The span's slots, ROWS at a time; thread j < heads folds head j's
	// logits into (m, z).
	uint lane = tid % LANES;
	vec2 mine = vec2(NEG, 0.0);
	for (uint p0 = 0; p0 < count; p0 += ROWS) {
		uint i = p0 + tid / LANES;
		uint r = s0 + min(i, count - 1);
		float acc[HB];
		[[unroll]] for (uint j = 0; j < HB; j++) acc[j] = 0.0;
		if (i < count) {
			uint base = g * pc.headStride + r * DV;
			uvec4 w[(DV + LANES - 1) / LANES];
			[[unroll]] for (uint u = 0; u < (DV + LANES - 1) / LANES; u++) w[u] = lane + u * LANES < DV ? k[base + lane + u * LANES] : uvec4(0);
			[[unroll]] for (uint u = 0; u < (DV + LANES - 1) / LANES; u++) {
				uint x = lane + u * LANES;
				if (x < DV) {
					vec4 a = vec4(unpackHalf2x16(w[u].x), unpackHalf2x16(w[u].y));
					vec4 b = vec4(unpackHalf2x16(w[u].z), unpackHalf2x16(w[u].w));
					[[unroll]] for (uint j = 0; j < HB; j++) {
						if (j < heads) acc[j] += dot(a, qs[j][2 * x]) + dot(b, qs[j][2 * x + 1]);
					}
				}
			}
		}
		[[unroll]] for (uint j = 0; j < HB; j++) scratch[j * WG + tid] = acc[j];
		barrier();
		if (lane < heads) {
			float l = NEG;
			if (i < count) {
				l = 0.0;
				uint at = lane * WG + (tid / LANES) * LANES;
				[[unroll]] for (uint j = 0; j < LANES; j++) l += scratch[at + j];
				row[(h0 + lane) * pc.R + r] = l;
			}
			lg[lane][tid / LANES] = l;
		}
		barrier();
		if (tid < heads) {
			float m = NEG;
			for (uint j = 0; j < ROWS; j++) m = max(m, lg[tid][j]);
			float z = 0.0;
			if (m != NEG) {
				for (uint j = 0; j < ROWS; j++) z += exp(lg[tid][j] - m);
			}
			mine = merge(mine, vec2(m, z));
		}
	}
	if (tid < heads) part[(h0 + tid) * pc.W + gl_WorkGroupID.x] = mine;

	// The last workgroup of the block to arrive merges the partials.
	memoryBarrierBuffer();
	barrier();
	if (tid == 0) {
		last = atomicAdd(arrived[block], 1) == gl_NumWorkGroups.x - 1;
		if (last) arrived[block] = 0;
	}
	barrier();
	if (!last) return;
	memoryBarrierBuffer();
	for (uint hl = 0; hl < heads; hl++) {
		uint h = h0 + hl;
		vec2 all = vec2(NEG, 0.0);
		for (uint x = tid; x < gl_NumWorkGroups.x; x += WG) all = merge(all, part[h * pc.W + x]);
		red[tid] = all;
		barrier();
		for (uint s = WG / 2; s > 0; s >>= 1) {
			if (tid < s) red[tid] = merge(red[tid], red[tid + s]);
			barrier();
		}
		if (tid == 0) mz[h] = red[0];
		barrier();
	}
}
