#version 450
// Lists each cluster's members: token t of head g goes to a free slot of
// its cluster's range in members (in no particular order; kmeans_sort
// orders each range).

layout(local_size_x = 256) in;

layout(std430, binding = 0) readonly buffer Assign { uint assign[]; };  // [heads][n]
layout(std430, binding = 1) buffer Cursor { uint cursor[]; };           // [heads][C]
layout(std430, binding = 2) writeonly buffer Members { uint members[]; }; // [heads][n]

layout(push_constant) uniform Push {
	uint n;
	uint first;  // token id of row 0
	uint C;
} pc;

void main() {
	uint t = gl_GlobalInvocationID.x;
	uint g = gl_WorkGroupID.y;
	if (t >= pc.n) return;
	uint c = assign[g * pc.n + t];
	uint slot = atomicAdd(cursor[g * pc.C + c], 1);
	members[g * pc.n + slot] = pc.first + t;
}
