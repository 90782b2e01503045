#version 450
// Tactic, union over GQA: every cluster c of KV head g = gl_WorkGroupID.y
// that some query head h of the group selects (binOf[h][c] < cut[h])
// appends its members to g's token list, which tactic_plan opened with the
// fixed tokens. A workgroup takes CW clusters, reserves room for all their
// members with one atomic, and copies them with its WG threads, one member
// each at a time. The
// order of the clusters in a list depends on scheduling; attention does
// not depend on it.

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 256;  // threads
layout(constant_id = 1) const uint CW = 64;   // clusters per workgroup, a power of two, at most WG

layout(std430, binding = 0) readonly buffer BinOf { uint binOf[]; };     // [Hq][C]
layout(std430, binding = 1) readonly buffer Cut { uint cut[]; };         // [Hq]
layout(std430, binding = 2) readonly buffer Starts { uint starts[]; };    // [Hkv][C]
layout(std430, binding = 3) readonly buffer Counts { uint sizes[]; };     // [Hkv][C]
layout(std430, binding = 4) readonly buffer Members { uint members[]; };  // [Hkv][clustered]
layout(std430, binding = 5) writeonly buffer Tokens { uint tok[]; };      // [Hkv][stride]
layout(std430, binding = 6) buffer TokenCounts { uint count[]; };         // [Hkv]

layout(push_constant) uniform Push {
	uint C;
	uint groupSize;
	uint stride;     // list entries per KV head
	uint clustered;  // clustered tokens per head (members stride)
} pc;

shared uint pre[CW + 1];  // members of the taken clusters before each one
shared uint from[CW];
shared uint base;

void main() {
	uint tid = gl_LocalInvocationID.x;
	uint g = gl_WorkGroupID.y;
	uint c = gl_WorkGroupID.x * CW + tid;
	uint size = 0;
	if (tid < CW && c < pc.C) {
		bool take = false;
		for (uint h = g * pc.groupSize; h < (g + 1) * pc.groupSize; h++) take = take || binOf[h * pc.C + c] < cut[h];
		if (take) size = sizes[g * pc.C + c];
		from[tid] = g * pc.clustered + starts[g * pc.C + c];
	}
	if (tid < CW) pre[tid + 1] = size;
	if (tid == 0) pre[0] = 0;
	barrier();
	for (uint k = 1; k < CW; k <<= 1) {
		uint x = tid < CW && tid >= k ? pre[tid + 1 - k] : 0;
		barrier();
		if (tid < CW) pre[tid + 1] += x;
		barrier();
	}
	uint total = pre[CW];
	if (tid == 0 && total > 0) base = atomicAdd(count[g], total);
	barrier();
	if (total == 0) return;
	uint at = g * pc.stride + base;
	for (uint y = tid; y < total; y += WG) {
		// The cluster s whose members hold y: pre[s] <= y < pre[s + 1].
		uint lo = 0, hi = CW - 1;
		while (lo < hi) {
			uint mid = (lo + hi + 1) / 2;
			if (pre[mid] <= y) lo = mid; else hi = mid - 1;
		}
		tok[at + y] = members[from[lo] + y - pre[lo]];
	}
}
