#version 450
// How the keys of a layer stored in cluster order spread about their
// clusters' means (Tactic's moment estimate, sparse.TacticFit.Moments), in
// two phases of one kernel (push constant phase).
//
// Phase 0: a workgroup takes ROWS clusters of KV head gl_WorkGroupID.y, DV
// threads a cluster, each holding 8 dimensions of every member row
// k_t = k[g][first + starts[g][c] + j], j < s_c = sizes[g][c]. It writes
//   spread[g][c] = (1/(s_c·D)) Σ_t ‖k_t − μ_c‖²   (0 for an empty cluster)
// with μ_c the members' mean (float32, a first pass over the rows), and
// per dimension i the sum over its clusters Σ_c Σ_t (k_ti − μ_ci)² to
// part[g][gl_WorkGroupID.x][i].
// Phase 1: one workgroup per KV head sums the parts of its pw workgroups
// into v_i = (1/n) Σ part[g][·][i], n the clustered tokens, and writes
//   weight[g][i] = v_i / v̄,  v̄ = (1/D) Σ_i v_i   (1 where v̄ = 0).
// sparse.ClusterIndex.SetSpreadsRef states the same in float64.
#extension GL_EXT_control_flow_attributes : enable

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 128;  // threads, a multiple of D / 8 and at least D
layout(constant_id = 1) const uint D = 128;   // head dimension, a multiple of 8

const uint DV = D / 8;         // uvec4 per row
const uint ROWS = WG / DV;     // clusters per workgroup

layout(std430, binding = 0) readonly buffer Keys { uvec4 k[]; };         // [heads][headStride]
layout(std430, binding = 1) readonly buffer Starts { uint starts[]; };   // [heads][C]
layout(std430, binding = 2) readonly buffer Sizes { uint sizes[]; };     // [heads][C]
layout(std430, binding = 3) buffer Spreads { float spread[]; };          // [heads][C]
layout(std430, binding = 4) buffer Parts { float part[]; };              // [heads][pw][D]
layout(std430, binding = 5) writeonly buffer Weights { float weight[]; }; // [heads][D]

layout(push_constant) uniform Push {
	uint C;
	uint headStride;  // uvec4 words between consecutive KV heads
	uint first;       // slot of the first clustered token
	uint phase;
	uint pw;          // phase 0's workgroups per head
	uint n;           // clustered tokens per head
} pc;

shared float dev[WG][8];   // phase 0: a thread's squared deviations per dimension
shared float total[WG];    // phase 1: the threads' parts of Σ v_i

void main() {
	uint tid = gl_LocalInvocationID.x;
	uint g = gl_WorkGroupID.y;
	if (pc.phase == 1) {
		float v = 0.0;
		if (tid < D) {
			for (uint w = 0; w < pc.pw; w++) v += part[(g * pc.pw + w) * D + tid];
			v /= float(max(pc.n, 1u));
		}
		total[tid] = v;
		barrier();
		for (uint s = WG / 2; s > 0; s >>= 1) {
			if (tid < s) total[tid] += total[tid + s];
			barrier();
		}
		float mean = total[0] / float(D);
		if (tid < D) weight[g * D + tid] = mean > 0.0 ? v / mean : 1.0;
		return;
	}
	uint c = gl_WorkGroupID.x * ROWS + tid / DV;
	uint j = tid % DV;
	uint size = c < pc.C ? sizes[g * pc.C + c] : 0;
	uint row = g * pc.headStride + (pc.first + (c < pc.C ? starts[g * pc.C + c] : 0)) * DV + j;
	float mu[8], sq[8];
	[[unroll]] for (uint i = 0; i < 8; i++) {
		mu[i] = 0.0;
		sq[i] = 0.0;
	}
	for (uint r = 0; r < size; r++) {
		uvec4 w = k[row + r * DV];
		vec2 x[4] = vec2[4](unpackHalf2x16(w.x), unpackHalf2x16(w.y), unpackHalf2x16(w.z), unpackHalf2x16(w.w));
		[[unroll]] for (uint i = 0; i < 4; i++) {
			mu[2 * i] += x[i].x;
			mu[2 * i + 1] += x[i].y;
		}
	}
	float inv = size == 0 ? 0.0 : 1.0 / float(size);
	[[unroll]] for (uint i = 0; i < 8; i++) mu[i] *= inv;
	for (uint r = 0; r < size; r++) {
		uvec4 w = k[row + r * DV];
		vec2 x[4] = vec2[4](unpackHalf2x16(w.x), unpackHalf2x16(w.y), unpackHalf2x16(w.z), unpackHalf2x16(w.w));
		[[unroll]] for (uint i = 0; i < 4; i++) {
			float a = x[i].x - mu[2 * i], b = x[i].y - mu[2 * i + 1];
			sq[2 * i] += a * a;
			sq[2 * i + 1] += b * b;
		}
	}
	[[unroll]] for (uint i = 0; i < 8; i++) dev[tid][i] = sq[i];
	barrier();
	// The cluster's spread: its DV threads' sums, by the first of them.
	if (j == 0 && c < pc.C) {
		float s = 0.0;
		for (uint t = tid; t < tid + DV; t++) {
			[[unroll]] for (uint i = 0; i < 8; i++) s += dev[t][i];
		}
		spread[g * pc.C + c] = size == 0 ? 0.0 : s * inv / float(D);
	}
	// The workgroup's part of each dimension: thread i < D sums dimension i
	// over the ROWS clusters.
	if (tid < D) {
		float s = 0.0;
		for (uint r = 0; r < ROWS; r++) s += dev[r * DV + tid / 8][tid % 8];
		part[(g * pc.pw + gl_WorkGroupID.x) * D + tid] = s;
	}
}
