#version 450
// Matrix product with the second factor transposed, in float32:
// y[r][o] = sum_i x[r][i] * w[o][i] for r < rows, o < cols, with x
// [rows][inner], w [cols][inner] and y [rows][cols] row-major (a linear
// layer, y = x wᵀ). A workgroup of T × T threads computes a T × T block of
// y, thread (tx, ty) the element (row ty, column tx) of it; the block's
// rows of x and columns of w pass through shared memory T values of the
// inner dimension at a time, summed in that order.

layout(local_size_x_id = 0, local_size_y_id = 0) in;
layout(constant_id = 0) const uint T = 16;

layout(std430, binding = 0) readonly buffer X { float x[]; };
layout(std430, binding = 1) readonly buffer W { float w[]; };
layout(std430, binding = 2) writeonly buffer Y { float y[]; };

layout(push_constant) uniform Push {
	uint rows, inner, cols;
} pc;

shared float xs[T][T + 1];
shared float ws[T][T + 1];

void main() {
	uint tx = gl_LocalInvocationID.x, ty = gl_LocalInvocationID.y;
	uint r = gl_WorkGroupID.y * T + ty;
	uint o = gl_WorkGroupID.x * T + tx;
	uint wo = gl_WorkGroupID.x * T + ty;  // the column of w this thread loads
	float acc = 0.0;
	for (uint k0 = 0; k0 < pc.inner; k0 += T) {
		uint k = k0 + tx;
		xs[ty][tx] = r < pc.rows && k < pc.inner ? x[r * pc.inner + k] : 0.0;
		ws[ty][tx] = wo < pc.cols && k < pc.inner ? w[wo * pc.inner + k] : 0.0;
		barrier();
		for (uint kk = 0; kk < T; kk++) acc += xs[ty][kk] * ws[tx][kk];
		barrier();
	}
	if (r < pc.rows && o < pc.cols) y[r * pc.cols + o] = acc;
}
