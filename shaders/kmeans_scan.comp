#version 450
// Exclusive prefix sum of the cluster sizes of one KV head per workgroup:
// starts[c] = Σ_{c' < c} counts[c']; the scatter cursors start there too.
// Skipped, like the rest of the step, for a head whose assignment changed
// nothing (changed[iter][g] == 0).

layout(local_size_x = 256) in;

layout(std430, binding = 0) readonly buffer Counts { uint counts[]; };  // [heads][C]
layout(std430, binding = 1) writeonly buffer Starts { uint starts[]; }; // [heads][C]
layout(std430, binding = 2) writeonly buffer Cursor { uint cursor[]; }; // [heads][C]
layout(std430, binding = 3) readonly buffer Changed { uint changed[]; }; // [iterations][heads]

layout(push_constant) uniform Push {
	uint C;
	uint iter;
} pc;

shared uint part[256];

void main() {
	uint tid = gl_LocalInvocationID.x;
	if (changed[pc.iter * gl_NumWorkGroups.x + gl_WorkGroupID.x] == 0) return;
	uint base = gl_WorkGroupID.x * pc.C;
	uint per = (pc.C + 255) / 256;  // each thread sums a run of clusters
	uint lo = min(tid * per, pc.C);
	uint hi = min(lo + per, pc.C);
	uint sum = 0;
	for (uint c = lo; c < hi; c++) sum += counts[base + c];
	part[tid] = sum;
	barrier();
	// Inclusive scan of the 256 run totals (Hillis–Steele).
	for (uint s = 1; s < 256; s <<= 1) {
		uint x = tid >= s ? part[tid - s] : 0;
		barrier();
		part[tid] += x;
		barrier();
	}
	uint run = tid == 0 ? 0 : part[tid - 1];
	for (uint c = lo; c < hi; c++) {
		starts[base + c] = run;
		cursor[base + c] = run;
		run += counts[base + c];
	}
}
