#version 450
// Tactic, token lists for gathered attention, in three passes (push
// constant pass) over KV head g = gl_WorkGroupID.y:
//  0: the fixed tokens, [0, sinks) then [clusteredEnd, n), open the list
//     and count = sinks + n - clusteredEnd;
//  1: every cluster c that some query head h of the group selects (its bin
//     below the head's cut) appends its members (the union over GQA);
//  2: chunks[g] = ceil(count[g] / chunk), for the merge.
// The order of the clusters in a list depends on scheduling; attention
// does not depend on it.

layout(local_size_x = 64) in;

layout(std430, binding = 0) readonly buffer BinOf { uint binOf[]; };     // [Hq][C]
layout(std430, binding = 1) readonly buffer Cut { uint cut[]; };         // [Hq]
layout(std430, binding = 2) readonly buffer Starts { uint starts[]; };    // [Hkv][C]
layout(std430, binding = 3) readonly buffer Counts { uint sizes[]; };     // [Hkv][C]
layout(std430, binding = 4) readonly buffer Members { uint members[]; };  // [Hkv][clustered]
layout(std430, binding = 5) buffer Tokens { uint tok[]; };                // [Hkv][stride]
layout(std430, binding = 6) buffer TokenCounts { uint count[]; };         // [Hkv]
layout(std430, binding = 7) writeonly buffer Chunks { uint chunks[]; };   // [Hkv]

layout(push_constant) uniform Push {
	uint pass;
	uint C;
	uint groupSize;
	uint sinks;
	uint clusteredEnd;  // first token after the clustered ones
	uint n;             // tokens stored
	uint stride;        // list entries per KV head
	uint chunk;         // tokens per chunk of the attention
	uint clustered;     // clustered tokens per head (members stride)
} pc;

void main() {
	uint g = gl_WorkGroupID.y;
	uint i = gl_GlobalInvocationID.x;
	if (pc.pass == 0) {
		uint fixedCount = pc.sinks + pc.n - pc.clusteredEnd;
		if (i < fixedCount) tok[g * pc.stride + i] = i < pc.sinks ? i : pc.clusteredEnd + (i - pc.sinks);
		if (i == 0) count[g] = fixedCount;
	} else if (pc.pass == 1) {
		if (i >= pc.C) return;
		bool take = false;
		for (uint h = g * pc.groupSize; h < (g + 1) * pc.groupSize; h++) take = take || binOf[h * pc.C + i] < cut[h];
		uint size = sizes[g * pc.C + i];
		if (!take || size == 0) return;
		uint at = atomicAdd(count[g], size);
		uint from = g * pc.clustered + starts[g * pc.C + i];
		for (uint j = 0; j < size; j++) tok[g * pc.stride + at + j] = members[from + j];
	} else if (i == 0) {
		chunks[g] = (count[g] + pc.chunk - 1) / pc.chunk;
	}
}
