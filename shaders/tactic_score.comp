#version 450
// Tactic, centroid scoring: s[h][c] = scale · q_h · centroid_c for every
// query head h and every cluster c of its KV head h / groupSize.
// A workgroup scores 32 centroids of KV head gl_WorkGroupID.y for up to 8
// query heads of its group (block gl_WorkGroupID.z): 8 lanes share a
// centroid row, lane l reading its vec4s l, l+8, ..., so that each row is
// read once, in whole 128-byte runs, for all the block's heads.
#extension GL_EXT_control_flow_attributes : enable

layout(local_size_x = 256) in;
layout(constant_id = 0) const uint D = 128;

const uint D4 = D / 4;
const uint LANES = 8;     // threads per centroid
const uint ROWS = 32;     // centroids per workgroup
const uint HB = 8;        // query heads per block

layout(std430, binding = 0) readonly buffer Queries { vec4 q[]; };       // [Hq][D/4]
layout(std430, binding = 1) readonly buffer Centroids { vec4 cent[]; };  // [Hkv][C][D/4]
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
	for (uint i = tid; i < heads * D4; i += 256) qs[i / D4][i % D4] = q[h0 * D4 + i] * pc.scale;
	barrier();
	uint r = tid / LANES, lane = tid % LANES;
	uint c = gl_WorkGroupID.x * ROWS + r;
	float acc[HB];
	[[unroll]] for (uint k = 0; k < HB; k++) acc[k] = 0.0;
	if (c < pc.C) {
		// Every load of the row in flight at once.
		const uint PER = (D4 + LANES - 1) / LANES;
		uint row = (g * pc.C + c) * D4;
		vec4 x[PER];
		[[unroll]] for (uint i = 0; i < PER; i++) x[i] = lane + i * LANES < D4 ? cent[row + lane + i * LANES] : vec4(0.0);
		[[unroll]] for (uint i = 0; i < PER; i++) {
			if (lane + i * LANES < D4) {
				[[unroll]] for (uint k = 0; k < HB; k++) {
					if (k < heads) acc[k] += dot(x[i], qs[k][lane + i * LANES]);
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
