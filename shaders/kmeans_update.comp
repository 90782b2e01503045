#version 450
// K-means update step: centroid c of head g becomes the mean of its
// members' keys, summed in member order; a cluster without members keeps
// its centroid. Also writes |c|², and with HALVES the centroid split into
// two fp16 parts, hi = fp16(x) and lo = fp16(x − hi), for the
// cooperative-matrix assignment. One workgroup of D/2 threads (one per pair
// of dimensions, a multiple of 4) per cluster.
//
// With init set it builds the initial centroids instead: cluster c's one
// member is token members[c] (of head 0's list, the same rows for every
// head). Otherwise the clusters of a span whose assignment changed nothing
// (changed[iter][g][c / CS] == 0) are skipped, and with zero set each
// cluster's count is cleared once read, ready for the next assignment to
// count.

layout(local_size_x_id = 1) in;
layout(constant_id = 0) const uint D = 128;
layout(constant_id = 1) const uint WG = 64;  // D / 2
layout(constant_id = 2) const bool HALVES = false;

layout(std430, binding = 0) readonly buffer Keys { uint k[]; };         // fp16 pairs, [heads][headStride]
layout(std430, binding = 1) readonly buffer Starts { uint starts[]; };  // [heads][C]
layout(std430, binding = 2) buffer Counts { uint counts[]; };           // [heads][C]
layout(std430, binding = 3) readonly buffer Members { uint members[]; }; // [heads][n] token ids
layout(std430, binding = 4) buffer Centroids { float cent[]; };         // [heads][C][D]
layout(std430, binding = 5) buffer Norms { float cnorm[]; };            // [heads][C]
layout(std430, binding = 6) readonly buffer Changed { uint changed[]; }; // [iterations][heads][spans]
layout(std430, binding = 7) writeonly buffer Halves { uint half2[]; };   // [heads][C][D]: D/2 words hi, D/2 words lo

layout(push_constant) uniform Push {
	uint n;
	uint headStride;  // uint words between KV heads in Keys
	uint C;
	uint iter;
	uint init;  // 1: initial centroids from members[0..C)
	uint zero;  // 1: clear counts after use
	uint S;     // tokens per span
	uint CS;    // clusters per span (but the last)
} pc;

shared float part[D / 2];

void main() {
	uint w = gl_LocalInvocationID.x;  // dimensions 2w, 2w+1
	uint c = gl_WorkGroupID.x;
	uint g = gl_WorkGroupID.y;
	uint spans = (pc.n + pc.S - 1) / pc.S;
	if (pc.init == 0 && changed[(pc.iter * gl_NumWorkGroups.y + g) * spans + c / pc.CS] == 0) return;
	uint ci = g * pc.C + c;
	uint count = pc.init != 0 ? 1 : counts[ci];
	uint base = ci * D;
	vec2 x;
	if (count == 0) {
		x = vec2(cent[base + 2 * w], cent[base + 2 * w + 1]);
	} else {
		uint lo = pc.init != 0 ? c : g * pc.n + starts[ci];
		uint kb = g * pc.headStride + w;
		vec2 sum = vec2(0.0);
		uint i = lo;
		// Four member rows in flight at a time; still summed in order.
		for (; i + 4 <= lo + count; i += 4) {
			uint m0 = members[i], m1 = members[i + 1], m2 = members[i + 2], m3 = members[i + 3];
			uint w0 = k[kb + m0 * (D / 2)], w1 = k[kb + m1 * (D / 2)], w2 = k[kb + m2 * (D / 2)], w3 = k[kb + m3 * (D / 2)];
			sum += unpackHalf2x16(w0);
			sum += unpackHalf2x16(w1);
			sum += unpackHalf2x16(w2);
			sum += unpackHalf2x16(w3);
		}
		for (; i < lo + count; i++) sum += unpackHalf2x16(k[kb + members[i] * (D / 2)]);
		x = sum / float(count);
		cent[base + 2 * w] = x.x;
		cent[base + 2 * w + 1] = x.y;
		if (HALVES) {
			uint hi = packHalf2x16(x);
			half2[base + w] = hi;
			half2[base + D / 2 + w] = packHalf2x16(x - unpackHalf2x16(hi));
		}
	}
	part[w] = dot(x, x);
	barrier();
	if (w == 0) {
		float s = 0.0;
		for (uint i = 0; i < D / 2; i++) s += part[i];
		cnorm[ci] = s;
		if (pc.zero != 0) counts[ci] = 0;
	}
}
