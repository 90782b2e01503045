#version 450
// Tactic, centroid scoring: s[h][c] = scale · q_h · centroid_c for every
// query head h and every cluster c of its KV head h / groupSize, the
// centroids rounded to fp16 (two to a word, as the keys).
// A workgroup scores 32 centroids of KV head gl_WorkGroupID.y for up to 8
// query heads of its group (block gl_WorkGroupID.z): 8 lanes share a
// centroid row, lane l reading its 16-byte words l, l+8, ..., so that each
// row is read once, in whole runs, for all the block's heads.
#extension GL_EXT_control_flow_attributes : enable

layout(local_size_x = 256) in;
layout(constant_id = 0) const uint D = 128;

const uint D4 = D / 4;
const uint D8 = D / 8;    // 16-byte words per centroid row
const uint LANES = 8;     // threads per centroid
const uint ROWS = 32;     // centroids per workgroup
const uint HB = 8;        // query heads per block

layout(std430, binding = 0) readonly buffer Queries { vec4 q[]; };       // [Hq][D/4]
layout(std430, binding = 1) readonly buffer Centroids { uvec4 cent[]; }; // [Hkv][C][D/8], fp16
layout(std430, binding = 2) writeonly buffer Scores { float s[]; };      // [Hq][C]

layout(push_constant) uniform Push {
	uint C;
	uint groupSize;
	float scale;
} pc;

shared vec4 qs[HB][D4];
shared float part[HB][ROWS][LANES];

void main() {
	uint tid = gl_LocalInvocationID.x;
	uint g = gl_WorkGroupID.y;
	uint h0 = g * pc.groupSize + gl_WorkGroupID.z * HB;
	uint heads = min(HB, g * pc.groupSize + pc.groupSize - h0);
	// Every load of the centroid row in flight at once, issued before the
	// queries are staged so that both wait together.
	uint r = tid / LANES, lane = tid % LANES;
	uint c = gl_WorkGroupID.x * ROWS + r;
	const uint PER = (D8 + LANES - 1) / LANES;
	uint row = (g * pc.C + min(c, pc.C - 1)) * D8;
	uvec4 x[PER];
	[[unroll]] for (uint i = 0; i < PER; i++) x[i] = lane + i * LANES < D8 ? cent[row + lane + i * LANES] : uvec4(0);
	for (uint i = tid; i < heads * D4; i += 256) qs[i / D4][i % D4] = q[h0 * D4 + i] * pc.scale;
	barrier();
	float acc[HB];
	[[unroll]] for (uint k = 0; k < HB; k++) acc[k] = 0.0;
	if (c < pc.C) {
		[[unroll]] for (uint i = 0; i < PER; i++) {
			uint u = lane + i * LANES;
			if (u < D8) {
				vec4 a = vec4(unpackHalf2x16(x[i].x), unpackHalf2x16(x[i].y));
				vec4 b = vec4(unpackHalf2x16(x[i].z), unpackHalf2x16(x[i].w));
				[[unroll]] for (uint k = 0; k < HB; k++) {
					if (k < heads) acc[k] += dot(a, qs[k][2 * u]) + dot(b, qs[k][2 * u + 1]);
				}
			}
		}
	}
	[[unroll]] for (uint k = 0; k < HB; k++) part[k][r][lane] = acc[k];
	barrier();
	if (c < pc.C && lane < heads) {
		float sum = 0.0;
		[[unroll]] for (uint j = 0; j < LANES; j++) sum += part[lane][r][j];
		s[(h0 + lane) * pc.C + c] = sum;
	}
}
