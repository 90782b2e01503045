#version 450
// Cluster order for one KV head's clustered range: slot first + r of the
// head's keys and values receives the row of token members[r] (r < count),
// read from a copy of the range (src row t − first), and positions records
// that token. Each thread moves one uvec4 (8 fp16 values) of a row.
layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint D = 128; // head dimension, multiple of 8

const uint D8 = D / 8;

layout(std430, binding = 0) restrict readonly buffer SrcK { uvec4 srcK[]; };   // [count][D/8]
layout(std430, binding = 1) restrict readonly buffer SrcV { uvec4 srcV[]; };   // [count][D/8]
layout(std430, binding = 2) restrict writeonly buffer DstK { uvec4 dstK[]; };  // the head's rows
layout(std430, binding = 3) restrict writeonly buffer DstV { uvec4 dstV[]; };
layout(std430, binding = 4) restrict readonly buffer Members { uint members[]; }; // [heads][count]
layout(std430, binding = 5) restrict writeonly buffer Positions { uint pos[]; };   // the head's slots

layout(push_constant) uniform Push {
	uint first;    // first slot of the range
	uint count;    // rows in the range
	uint rowSkip;  // uvec4s of the K/V bindings before the head's slot 0
	uint memSkip;  // members before the head's
	uint posSkip;  // words of the positions binding before the head's slot 0
};

void main() {
	uint i = gl_GlobalInvocationID.x;
	if (i >= count * D8) return;
	uint r = i / D8, part = i % D8;
	uint t = members[memSkip + r];
	uint from = (t - first) * D8 + part;
	uint to = rowSkip + (first + r) * D8 + part;
	dstK[to] = srcK[from];
	dstV[to] = srcV[from];
	if (part == 0) pos[posSkip + first + r] = t;
}
