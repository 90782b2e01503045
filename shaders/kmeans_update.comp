#version 450
// K-means update step: centroid c of head g becomes the mean of its
// members' keys, summed in member order; a cluster without members keeps
// its centroid. Also writes |c|². One workgroup of D/2 threads (one per
// pair of dimensions, a multiple of 4) per cluster.

layout(local_size_x_id = 1) in;
layout(constant_id = 0) const uint D = 128;
layout(constant_id = 1) const uint WG = 64;  // D / 2

layout(std430, binding = 0) readonly buffer Keys { uint k[]; };         // fp16 pairs, [heads][headStride]
layout(std430, binding = 1) readonly buffer Starts { uint starts[]; };  // [heads][C]
layout(std430, binding = 2) readonly buffer Counts { uint counts[]; };  // [heads][C]
layout(std430, binding = 3) readonly buffer Members { uint members[]; }; // [heads][n] token ids
layout(std430, binding = 4) buffer Centroids { float cent[]; };         // [heads][C][D]
layout(std430, binding = 5) buffer Norms { float cnorm[]; };            // [heads][C]

layout(push_constant) uniform Push {
	uint n;
	uint headStride;  // uint words between KV heads in Keys
	uint C;
} pc;

shared float part[D / 2];

void main() {
	uint w = gl_LocalInvocationID.x;  // dimensions 2w, 2w+1
	uint c = gl_WorkGroupID.x;
	uint g = gl_WorkGroupID.y;
	uint count = counts[g * pc.C + c];
	uint base = (g * pc.C + c) * D;
	vec2 x;
	if (count == 0) {
		x = vec2(cent[base + 2 * w], cent[base + 2 * w + 1]);
	} else {
		uint lo = g * pc.n + starts[g * pc.C + c];
		vec2 sum = vec2(0.0);
		for (uint i = lo; i < lo + count; i++) {
			sum += unpackHalf2x16(k[g * pc.headStride + members[i] * (D / 2) + w]);
		}
		x = sum / float(count);
		cent[base + 2 * w] = x.x;
		cent[base + 2 * w + 1] = x.y;
	}
	part[w] = dot(x, x);
	barrier();
	if (w == 0) {
		float s = 0.0;
		for (uint i = 0; i < D / 2; i++) s += part[i];
		cnorm[g * pc.C + c] = s;
	}
}
