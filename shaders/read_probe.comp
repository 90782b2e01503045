#version 450
// Read-bandwidth probe: every thread XORs the uvec4 words i = gid, gid +
// stride, ... below n and stores the folded result, so that every word is
// read once and nothing can be optimised away.

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 256;

layout(std430, binding = 0) readonly buffer Src { uvec4 src[]; };
layout(std430, binding = 1) writeonly buffer Dst { uint dst[]; };

layout(push_constant) uniform Push {
	uint n;
} pc;

void main() {
	uint gid = gl_GlobalInvocationID.x;
	uint stride = gl_NumWorkGroups.x * WG;
	uvec4 acc = uvec4(0);
	for (uint i = gid; i < pc.n; i += stride) acc ^= src[i];
	dst[gid] = acc.x ^ acc.y ^ acc.z ^ acc.w;
}
