#version 450
// LuKA's clustered attention, last stage: the output of every query head,
// the cover's nodes weighted by their cover masses, refined summaries'
// masses spread over their children (mass-preserving refinement).
//
// For query head h of KV head g (log Z_h = m + log z from mz[h]), the
// output is
//   o_h = Σ_{node j not refined} exp(row[h][j] − log Z_h) · v_j
//       + Σ_{summary c refined} exp(row[h][c] − log Z_h) · Σ_u β_u · v_{cP+u},
// where v_j is summary j's value (j < S) or raw slot tail + j − S's, and
// β = softmax over u < P of scale · q_h · k_{cP+u}: a refined summary's
// mass goes to its P children in proportion to their local softmax.
//
// Workgroups x < pc.chunks take CH nodes each for the GROUP heads of KV
// head gl_WorkGroupID.y (ROWS nodes at once, HALF lanes a node, two
// dimensions a lane); workgroup pc.chunks + i takes head i / pc.maxList's
// refined summary number i % pc.maxList (nothing past count[h]). Each
// writes its partial sums; the last workgroup of the KV head to arrive (an
// arrival counter; none waits for another) adds them up, in a fixed order,
// into out[h], and resets the counter.
#extension GL_EXT_control_flow_attributes : enable

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 256;   // threads: a multiple of D / 2, at least P
layout(constant_id = 1) const uint D = 128;    // head dimension, a multiple of 8
layout(constant_id = 2) const uint GROUP = 4;  // query heads per KV head, 1 to 8
layout(constant_id = 3) const uint CH = 128;   // nodes a chunk workgroup takes
layout(constant_id = 4) const uint P = 16;     // tokens a summary stands for, at most 64 and WG

const uint D4 = D / 4;
const uint DV = D / 8;        // uvec4 per fp16 key row
const uint HALF = D / 2;      // lanes of a node: fp16 pairs
const uint ROWS = WG / HALF;  // nodes at once
const float NEG = -1.0 / 0.0;

layout(std430, binding = 0) readonly buffer Queries { vec4 q[]; };       // [Hq][D/4]
layout(std430, binding = 1) readonly buffer Keys { uvec4 k[]; };         // the layer's, [Hkv][headStride]
layout(std430, binding = 2) readonly buffer Values { uint v[]; };        // the layer's, [Hkv][vStride]
layout(std430, binding = 3) readonly buffer SumValues { uint sv[]; };    // [Hkv][sumStride]
layout(std430, binding = 4) readonly buffer Rows { float row[]; };       // [Hq][R]
layout(std430, binding = 5) readonly buffer MZ { vec2 mz[]; };           // [Hq]
layout(std430, binding = 6) readonly buffer Mask { uint mask[]; };       // [Hq][maskWords]
layout(std430, binding = 7) readonly buffer List { uint list[]; };       // [Hq][maxList]
layout(std430, binding = 8) readonly buffer Count { uint count[]; };     // [Hq]
// Written by every workgroup of a KV head, read by the last: coherent.
layout(std430, binding = 9) coherent buffer Part { vec2 part[]; };       // [Hq][items][HALF]
layout(std430, binding = 10) coherent buffer Arrived { uint arrived[]; }; // [Hkv], 0 between steps
layout(std430, binding = 11) writeonly buffer Out { vec2 o[]; };         // [Hq][HALF]

layout(push_constant) uniform Push {
	uint S;           // summaries
	uint nodes;       // S + raw tokens
	uint tail;        // slot of the first raw token, S·P
	float scale;      // multiplies q·k
	uint headStride;  // uvec4 words between the layer's KV heads (keys)
	uint vStride;     // uint words between the layer's KV heads (values)
	uint sumStride;   // uint words between the summaries' KV heads
	uint R;           // row stride per query head
	uint maskWords;   // mask words per query head
	uint maxList;     // list stride per query head
	uint chunks;      // chunk workgroups
	uint items;       // partials per query head: chunks + maxList
} pc;

shared vec4 qs[D4];
shared float lg[P];
shared vec2 red[GROUP][WG];
shared bool last;

void main() {
	uint tid = gl_LocalInvocationID.x;
	uint g = gl_WorkGroupID.y;
	uint x = gl_WorkGroupID.x;
	uint lane = tid % HALF, r = tid / HALF;
	if (x < pc.chunks) {
		float logZ[GROUP];
		vec2 acc[GROUP];
		[[unroll]] for (uint a = 0; a < GROUP; a++) {
			vec2 t = mz[g * GROUP + a];
			logZ[a] = t.x + log(t.y);
			acc[a] = vec2(0.0);
		}
		uint end = min((x + 1) * CH, pc.nodes);
		for (uint j = x * CH + r; j < end; j += ROWS) {
			bool summary = j < pc.S;
			uint w = summary ? sv[g * pc.sumStride + j * HALF + lane] : v[g * pc.vStride + (pc.tail + j - pc.S) * HALF + lane];
			vec2 val = unpackHalf2x16(w);
			[[unroll]] for (uint a = 0; a < GROUP; a++) {
				uint h = g * GROUP + a;
				bool refined = summary && ((mask[h * pc.maskWords + j / 32] >> (j % 32)) & 1u) != 0u;
				if (!refined) acc[a] += exp(row[h * pc.R + j] - logZ[a]) * val;
			}
		}
		[[unroll]] for (uint a = 0; a < GROUP; a++) red[a][tid] = acc[a];
		barrier();
		if (r == 0) {
			[[unroll]] for (uint a = 0; a < GROUP; a++) {
				vec2 s = vec2(0.0);
				for (uint u = 0; u < ROWS; u++) s += red[a][u * HALF + lane];
				part[((g * GROUP + a) * pc.items + x) * HALF + lane] = s;
			}
		}
	} else {
		uint i = x - pc.chunks;
		uint a = i / pc.maxList, rr = i % pc.maxList;
		uint h = g * GROUP + a;
		if (a < GROUP && rr < count[h]) {
			uint c = list[h * pc.maxList + rr];
			for (uint u = tid; u < D4; u += WG) qs[u] = q[h * D4 + u] * pc.scale;
			barrier();
			if (tid < P) {
				uint base = g * pc.headStride + (c * P + tid) * DV;
				float l = 0.0;
				for (uint e = 0; e < DV; e++) {
					uvec4 kw = k[base + e];
					l += dot(vec4(unpackHalf2x16(kw.x), unpackHalf2x16(kw.y)), qs[2 * e]) +
					     dot(vec4(unpackHalf2x16(kw.z), unpackHalf2x16(kw.w)), qs[2 * e + 1]);
				}
				lg[tid] = l;
			}
			barrier();
			float m = NEG;
			for (uint u = 0; u < P; u++) m = max(m, lg[u]);
			float z = 0.0;
			for (uint u = 0; u < P; u++) z += exp(lg[u] - m);
			vec2 t = mz[h];
			float mass = exp(row[h * pc.R + c] - (t.x + log(t.y)));
			vec2 s = vec2(0.0);
			for (uint u = r; u < P; u += ROWS) s += exp(lg[u] - m) * unpackHalf2x16(v[g * pc.vStride + (c * P + u) * HALF + lane]);
			red[0][tid] = s * (mass / z);
			barrier();
			if (r == 0) {
				vec2 sum = vec2(0.0);
				for (uint u = 0; u < ROWS; u++) sum += red[0][u * HALF + lane];
				part[(h * pc.items + pc.chunks + rr) * HALF + lane] = sum;
			}
		}
	}

	memoryBarrierBuffer();
	barrier();
	if (tid == 0) {
		last = atomicAdd(arrived[g], 1) == gl_NumWorkGroups.x - 1;
		if (last) arrived[g] = 0;
	}
	barrier();
	if (!last) return;
	memoryBarrierBuffer();
	for (uint e = tid; e < GROUP * HALF; e += WG) {
		uint h = g * GROUP + e / HALF, l = e % HALF;
		vec2 s = vec2(0.0);
		for (uint y = 0; y < pc.chunks; y++) s += part[(h * pc.items + y) * HALF + l];
		uint n = count[h];
		for (uint y = 0; y < n; y++) s += part[(h * pc.items + pc.chunks + y) * HALF + l];
		o[h * HALF + l] = s;
	}
}
