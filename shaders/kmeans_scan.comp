#version 450
// Exclusive prefix sum of the cluster sizes of one span of one KV head per
// workgroup (grid: spans × heads). Span s's tokens are members
// [s·S, s·S + its tokens) of the head, so its clusters' members start
// there: starts[c] = s·S + Σ counts of the span's clusters before c; the
// scatter cursors start there too. With one span (S = n, CS = C) this is
// the prefix sum over all of the head's clusters. Skipped, like the rest of
// the step, for a span whose assignment changed nothing
// (changed[iter][g][s] == 0).

layout(local_size_x = 256) in;

layout(std430, binding = 0) readonly buffer Counts { uint counts[]; };  // [heads][C]
layout(std430, binding = 1) writeonly buffer Starts { uint starts[]; }; // [heads][C]
layout(std430, binding = 2) writeonly buffer Cursor { uint cursor[]; }; // [heads][C]
layout(std430, binding = 3) readonly buffer Changed { uint changed[]; }; // [iterations][heads][spans]

layout(push_constant) uniform Push {
	uint C;
	uint iter;
	uint S;   // tokens per span
	uint CS;  // clusters per span (but the last)
} pc;

shared uint part[256];

void main() {
	uint tid = gl_LocalInvocationID.x;
	uint s = gl_WorkGroupID.x;
	uint g = gl_WorkGroupID.y;
	uint spans = gl_NumWorkGroups.x;
	if (changed[(pc.iter * gl_NumWorkGroups.y + g) * spans + s] == 0) return;
	uint base = g * pc.C + s * pc.CS;
	uint m = min(pc.CS, pc.C - s * pc.CS);  // this span's clusters
	uint per = (m + 255) / 256;  // each thread sums a run of clusters
	uint lo = min(tid * per, m);
	uint hi = min(lo + per, m);
	uint sum = 0;
	for (uint c = lo; c < hi; c++) sum += counts[base + c];
	part[tid] = sum;
	barrier();
	// Inclusive scan of the 256 run totals (Hillis–Steele).
	for (uint d = 1; d < 256; d <<= 1) {
		uint x = tid >= d ? part[tid - d] : 0;
		barrier();
		part[tid] += x;
		barrier();
	}
	uint run = s * pc.S + (tid == 0 ? 0 : part[tid - 1]);
	for (uint c = lo; c < hi; c++) {
		starts[base + c] = run;
		cursor[base + c] = run;
		run += counts[base + c];
	}
}
