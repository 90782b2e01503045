#version 450
// Sorts each cluster's member range ascending, so the lists and every sum
// over them are deterministic. One workgroup per cluster (the grid strides
// over more): a range of at most CAP members is ranked in shared memory,
// member x going to position #{members < x} (token ids are distinct); a
// longer one is insertion-sorted by one invocation.

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 64;
const uint CAP = 1024;

layout(std430, binding = 0) readonly buffer Starts { uint starts[]; };  // [heads][C]
layout(std430, binding = 1) readonly buffer Counts { uint counts[]; };  // [heads][C]
layout(std430, binding = 2) buffer Members { uint members[]; };         // [heads][n]
layout(std430, binding = 3) readonly buffer Changed { uint changed[]; }; // [iterations][heads]

layout(push_constant) uniform Push {
	uint n;
	uint C;
	uint iter;  // skip heads with changed[iter][g] == 0
} pc;

shared uint buf[CAP];

void main() {
	uint tid = gl_LocalInvocationID.x;
	uint g = gl_WorkGroupID.y;
	if (changed[pc.iter * gl_NumWorkGroups.y + g] == 0) return;
	for (uint c = gl_WorkGroupID.x; c < pc.C; c += gl_NumWorkGroups.x) {
		uint lo = g * pc.n + starts[g * pc.C + c];
		uint m = counts[g * pc.C + c];
		if (m <= 1) continue;
		if (m <= CAP) {
			for (uint i = tid; i < m; i += WG) buf[i] = members[lo + i];
			barrier();
			for (uint i = tid; i < m; i += WG) {
				uint x = buf[i];
				uint r = 0;
				for (uint j = 0; j < m; j++) r += buf[j] < x ? 1 : 0;
				members[lo + r] = x;
			}
			barrier();
		} else if (tid == 0) {
			for (uint i = lo + 1; i < lo + m; i++) {
				uint x = members[i];
				uint j = i;
				while (j > lo && members[j - 1] > x) {
					members[j] = members[j - 1];
					j--;
				}
				members[j] = x;
			}
		}
	}
}
