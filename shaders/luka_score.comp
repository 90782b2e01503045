#version 450
// LuKA's clustered attention, first stage: the logits of the cover and
// its normaliser.
//
// The cover of KV head g is its S summaries (node j < S, key sumK[g][j])
// then its raw tokens from slot tail = S·P on (node S + i is slot tail + i),
// pc.nodes nodes in all. A workgroup takes SPAN consecutive nodes for the
// GROUP query heads of KV head gl_WorkGroupID.y, writes
// row[h][j] = scale · q_h · k_j (+ pc.bias for a summary), LANES lanes
// sharing a node, and its heads' partial (max, Σ exp(l − max)). The last workgroup of the KV head to
// arrive (an arrival counter; no workgroup waits for another) merges them
// into mz[h] = (m, z), the cover's normaliser Z_h = z·exp(m), and resets
// the counter.
#extension GL_EXT_control_flow_attributes : enable

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 256;    // threads, a power of two, at least 32
layout(constant_id = 1) const uint D = 128;     // head dimension, a multiple of 8
layout(constant_id = 2) const uint GROUP = 4;   // query heads per KV head, 1 to 8
layout(constant_id = 3) const uint SPAN = 512;  // nodes a workgroup takes, a multiple of WG / LANES

const uint D4 = D / 4;
const uint DV = D / 8;         // uvec4 per fp16 key row
const uint LANES = 8;          // threads per node
const uint ROWS = WG / LANES;  // nodes scored at once
const float NEG = -1.0 / 0.0;

layout(std430, binding = 0) readonly buffer Queries { vec4 q[]; };      // [Hq][D/4]
layout(std430, binding = 1) readonly buffer Keys { uvec4 k[]; };        // the layer's, [Hkv][headStride]
layout(std430, binding = 2) readonly buffer SumKeys { uvec4 sk[]; };    // [Hkv][sumStride]
layout(std430, binding = 3) writeonly buffer Rows { float row[]; };     // [Hq][R]
layout(std430, binding = 4) coherent buffer Part { vec2 part[]; };      // [Hq][W]
layout(std430, binding = 5) writeonly buffer MZ { vec2 mz[]; };         // [Hq]
layout(std430, binding = 6) coherent buffer Arrived { uint arrived[]; }; // [Hkv], 0 between steps

layout(push_constant) uniform Push {
	uint S;           // summaries per KV head
	uint nodes;       // S + raw tokens
	uint tail;        // slot of the first raw token, S·P
	float scale;      // multiplies q·k
	uint headStride;  // uvec4 words between the layer's KV heads
	uint sumStride;   // uvec4 words between the summaries' KV heads
	uint R;           // row stride per query head
	uint W;           // partial stride per query head: the most workgroups in x
	float bias;       // added to the summaries' logits
} pc;

shared vec4 qs[GROUP][D4];
shared float scratch[GROUP * WG];
shared float lg[GROUP][ROWS];
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
	uint h0 = g * GROUP;
	for (uint i = tid; i < GROUP * D4; i += WG) qs[i / D4][i % D4] = q[h0 * D4 + i] * pc.scale;
	barrier();

	// The span's nodes, ROWS at a time; thread j < GROUP folds head j's
	// logits into (m, z).
	uint s0 = gl_WorkGroupID.x * SPAN;
	uint lane = tid % LANES;
	vec2 mine = vec2(NEG, 0.0);
	for (uint p0 = 0; p0 < SPAN; p0 += ROWS) {
		uint j = s0 + p0 + tid / LANES;
		float acc[GROUP];
		[[unroll]] for (uint a = 0; a < GROUP; a++) acc[a] = 0.0;
		if (j < pc.nodes) {
			uvec4 w[(DV + LANES - 1) / LANES];
			[[unroll]] for (uint u = 0; u < (DV + LANES - 1) / LANES; u++) {
				uint x = lane + u * LANES;
				if (x >= DV) w[u] = uvec4(0);
				else if (j < pc.S) w[u] = sk[g * pc.sumStride + j * DV + x];
				else w[u] = k[g * pc.headStride + (pc.tail + j - pc.S) * DV + x];
			}
			[[unroll]] for (uint u = 0; u < (DV + LANES - 1) / LANES; u++) {
				uint x = lane + u * LANES;
				if (x < DV) {
					vec4 a = vec4(unpackHalf2x16(w[u].x), unpackHalf2x16(w[u].y));
					vec4 b = vec4(unpackHalf2x16(w[u].z), unpackHalf2x16(w[u].w));
					[[unroll]] for (uint hh = 0; hh < GROUP; hh++) acc[hh] += dot(a, qs[hh][2 * x]) + dot(b, qs[hh][2 * x + 1]);
				}
			}
		}
		[[unroll]] for (uint a = 0; a < GROUP; a++) scratch[a * WG + tid] = acc[a];
		barrier();
		if (lane < GROUP) {
			float l = NEG;
			if (j < pc.nodes) {
				l = j < pc.S ? pc.bias : 0.0;
				uint at = lane * WG + (tid / LANES) * LANES;
				[[unroll]] for (uint u = 0; u < LANES; u++) l += scratch[at + u];
				row[(h0 + lane) * pc.R + j] = l;
			}
			lg[lane][tid / LANES] = l;
		}
		barrier();
		if (tid < GROUP) {
			float m = NEG;
			for (uint u = 0; u < ROWS; u++) m = max(m, lg[tid][u]);
			float z = 0.0;
			if (m != NEG) {
				for (uint u = 0; u < ROWS; u++) z += exp(lg[tid][u] - m);
			}
			mine = merge(mine, vec2(m, z));
		}
	}
	if (tid < GROUP) part[(h0 + tid) * pc.W + gl_WorkGroupID.x] = mine;

	// The last workgroup of the KV head to arrive finishes its heads.
	memoryBarrierBuffer();
	barrier();
	if (tid == 0) {
		last = atomicAdd(arrived[g], 1) == gl_NumWorkGroups.x - 1;
		if (last) arrived[g] = 0;
	}
	barrier();
	if (!last) return;
	memoryBarrierBuffer();
	for (uint hl = 0; hl < GROUP; hl++) {
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
