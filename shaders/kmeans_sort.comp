#version 450
// Sorts each cluster's member range ascending (insertion sort, one thread
// per cluster), so the lists and every sum over them are deterministic.

layout(local_size_x = 64) in;

layout(std430, binding = 0) readonly buffer Starts { uint starts[]; };  // [heads][C]
layout(std430, binding = 1) readonly buffer Counts { uint counts[]; };  // [heads][C]
layout(std430, binding = 2) buffer Members { uint members[]; };         // [heads][n]

layout(push_constant) uniform Push {
	uint n;
	uint C;
} pc;

void main() {
	uint c = gl_GlobalInvocationID.x;
	uint g = gl_WorkGroupID.y;
	if (c >= pc.C) return;
	uint lo = g * pc.n + starts[g * pc.C + c];
	uint hi = lo + counts[g * pc.C + c];
	for (uint i = lo + 1; i < hi; i++) {
		uint x = members[i];
		uint j = i;
		while (j > lo && members[j - 1] > x) {
			members[j] = members[j - 1];
			j--;
		}
		members[j] = x;
	}
}
