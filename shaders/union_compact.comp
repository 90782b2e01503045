#version 450
// The GQA union of one KV head as a compact list, one workgroup per KV
// head g: cluster c of g is taken when rank[h][c] < cut[h] for some query
// head h of g. In ascending cluster order, the taken clusters' first slots
// (first + starts[g][c]: the layer is in cluster order) and the union's
// tokens before each (an exclusive prefix sum of their sizes) are written
// to list[g][0 .. taken), and total[g] = (taken, tokens). Attention over
// the union then splits its tokens evenly between workgroups.
// Each thread owns a run of ceil(C / WG) consecutive clusters: it counts
// its taken clusters and tokens, one workgroup scan gives every run its
// offsets, and the run is written out.
layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 256;  // threads, a power of two

layout(std430, binding = 0) restrict readonly buffer Rank { uint rank[]; };     // [Hq][C]
layout(std430, binding = 1) restrict readonly buffer Cut { uint cut[]; };       // [Hq]
layout(std430, binding = 2) restrict readonly buffer Starts { uint starts[]; }; // [Hkv][C]
layout(std430, binding = 3) restrict readonly buffer Sizes { uint sizes[]; };   // [Hkv][C]
layout(std430, binding = 4) restrict writeonly buffer List { uvec2 list[]; };   // [Hkv][C]: (first slot, tokens before)
layout(std430, binding = 5) restrict writeonly buffer Total { uvec2 total[]; }; // [Hkv]: (clusters, tokens)

layout(push_constant) uniform Push {
	uint C;          // clusters per KV head
	uint groupSize;  // query heads per KV head
	uint first;      // slot of the first clustered token
};

shared uvec2 part[WG];

// taken reports whether a query head of KV head g takes cluster c.
bool taken(uint g, uint c) {
	bool t = false;
	for (uint h = g * groupSize; h < (g + 1) * groupSize; h++) t = t || rank[h * C + c] < cut[h];
	return t;
}

void main() {
	uint tid = gl_LocalInvocationID.x;
	uint g = gl_WorkGroupID.x;
	uint per = (C + WG - 1) / WG;
	uint c0 = min(C, tid * per), c1 = min(C, c0 + per);
	uvec2 mine = uvec2(0);
	for (uint c = c0; c < c1; c++) {
		if (taken(g, c)) mine += uvec2(1, sizes[g * C + c]);
	}
	// Inclusive scan of the runs' counts (Hillis–Steele over the workgroup).
	part[tid] = mine;
	barrier();
	for (uint k = 1; k < WG; k <<= 1) {
		uvec2 x = tid >= k ? part[tid - k] : uvec2(0);
		barrier();
		part[tid] += x;
		barrier();
	}
	uvec2 at = part[tid] - mine;  // exclusive: clusters and tokens before this run
	for (uint c = c0; c < c1; c++) {
		if (taken(g, c)) {
			uint size = sizes[g * C + c];
			list[g * C + at.x] = uvec2(first + starts[g * C + c], at.y);
			at += uvec2(1, size);
		}
	}
	if (tid == WG - 1) total[g] = part[WG - 1];
}
