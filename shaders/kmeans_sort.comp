#version 450
// Sorts each cluster's member range ascending, so the lists and every sum
// over them are deterministic. One workgroup per cluster (the grid strides
// over more). A range of at most CAP members is ranked in shared memory,
// member x going to position #{members < x} (token ids are distinct). A
// longer one is listed afresh in token order from the assignment: the
// workgroup walks the tokens of the cluster's span (cluster c belongs to
// span c / CS, tokens [s·S, s·S+S)), 4·WG at a time, and each token of
// the cluster goes to the next free place of the range (a prefix count
// over the workgroup), whatever order the scatter left there. Clusters of
// a span whose assignment changed nothing are skipped.
//
// No invocation loops more than about (CAP/WG)·CAP times for a ranked range
// or S/(4·WG)·(1 + log2 WG) times for a long one. Some drivers end an
// invocation's loops, without an error, after a fixed number of iterations
// in all (Mesa's llvmpipe behind lavapipe: 65535), which a long range
// sorted by one invocation (O(count²) steps) went beyond.

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 64;  // a power of two, at most CAP
const uint CAP = 1024;

layout(std430, binding = 0) readonly buffer Starts { uint starts[]; };  // [heads][C]
layout(std430, binding = 1) readonly buffer Counts { uint counts[]; };  // [heads][C]
layout(std430, binding = 2) buffer Members { uint members[]; };         // [heads][n]
layout(std430, binding = 3) readonly buffer Changed { uint changed[]; }; // [iterations][heads][spans]
layout(std430, binding = 4) readonly buffer Assign { uint assign[]; };   // [heads][n]

layout(push_constant) uniform Push {
	uint n;
	uint C;
	uint iter;   // skip spans with changed[iter][g][s] == 0
	uint first;  // token id of row 0
	uint S;      // tokens per span
	uint CS;     // clusters per span (but the last)
} pc;

shared uint buf[CAP];

void main() {
	uint tid = gl_LocalInvocationID.x;
	uint g = gl_WorkGroupID.y;
	uint spans = (pc.n + pc.S - 1) / pc.S;
	for (uint c = gl_WorkGroupID.x; c < pc.C; c += gl_NumWorkGroups.x) {
		uint s = c / pc.CS;
		if (changed[(pc.iter * gl_NumWorkGroups.y + g) * spans + s] == 0) continue;
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
			continue;
		}
		// Invocation tid takes tokens t, t+1, t+2, t+3 of each pass; buf[0..WG)
		// holds the passes' prefix counts.
		uint row = g * pc.n;
		uint end = min(s * pc.S + pc.S, pc.n);  // the span's tokens end here
		uint done = 0;  // members listed by earlier passes
		for (uint t0 = s * pc.S; t0 < end; t0 += 4 * WG) {
			uint t = t0 + 4 * tid;
			bool f0 = t < end && assign[row + t] == c;
			bool f1 = t + 1 < end && assign[row + t + 1] == c;
			bool f2 = t + 2 < end && assign[row + t + 2] == c;
			bool f3 = t + 3 < end && assign[row + t + 3] == c;
			uint mine = uint(f0) + uint(f1) + uint(f2) + uint(f3);
			buf[tid] = mine;
			barrier();
			// Inclusive scan of the WG counts (Hillis–Steele).
			for (uint s = 1; s < WG; s <<= 1) {
				uint y = tid >= s ? buf[tid - s] : 0;
				barrier();
				buf[tid] += y;
				barrier();
			}
			uint at = lo + done + buf[tid] - mine;
			uint id = pc.first + t;
			if (f0) members[at++] = id;
			if (f1) members[at++] = id + 1;
			if (f2) members[at++] = id + 2;
			if (f3) members[at] = id + 3;
			done += buf[WG - 1];
			barrier();  // every total read before the next pass writes buf
		}
	}
}
