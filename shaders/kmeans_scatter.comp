#version 450
// Lists each cluster's members: token t of head g goes to a free slot of
// its cluster's range in members (in no particular order; kmeans_sort
// orders each range). Skipped for the tokens of a span whose assignment
// changed nothing (changed[iter][g][t / S] == 0).

layout(local_size_x = 256) in;

layout(std430, binding = 0) readonly buffer Assign { uint assign[]; };  // [heads][n]
layout(std430, binding = 1) buffer Cursor { uint cursor[]; };           // [heads][C]
layout(std430, binding = 2) writeonly buffer Members { uint members[]; }; // [heads][n]
layout(std430, binding = 3) readonly buffer Changed { uint changed[]; };  // [iterations][heads][spans]

layout(push_constant) uniform Push {
	uint n;
	uint first;  // token id of row 0
	uint C;
	uint iter;
	uint S;      // tokens per span
} pc;

void main() {
	uint t = gl_GlobalInvocationID.x;
	uint g = gl_WorkGroupID.y;
	uint spans = (pc.n + pc.S - 1) / pc.S;
	if (t >= pc.n || changed[(pc.iter * gl_NumWorkGroups.y + g) * spans + t / pc.S] == 0) return;
	uint c = assign[g * pc.n + t];
	uint slot = atomicAdd(cursor[g * pc.C + c], 1);
	members[g * pc.n + slot] = pc.first + t;
}
