#version 450
#extension GL_KHR_shader_subgroup_basic : enable
#extension GL_KHR_shader_subgroup_arithmetic : enable
// Tactic, distribution fitting (Alg. 1) and budget of one query head per
// workgroup, over the bins of tactic_plan as ordered groups of tokens, from
// the exponentials of tactic_sample: exact sums of the bins [0, j0) and of
// the fixed tokens, the two windows' means μ and mean 1/x, the curve
// y = a/x + b through them in the 1/x coordinate, the estimated
// cumulative sum S at every bin boundary (exact below N', the fitted curve
// above, clamped at 0), and the cut: the least bin boundary j with
// S(j) ≥ P·S(n). The head selects the clusters of bins below the cut.

layout(local_size_x_id = 1) in;
layout(constant_id = 0) const uint NB = 1024;
layout(constant_id = 1) const uint WG = 256;  // threads, a power of two
// SUBGROUPS = 1 scans with subgroup arithmetic (the host sets it only where
// supported, with subgroups of 4 to WG threads); 0 uses a shared tree.
layout(constant_id = 2) const uint SUBGROUPS = 0;

layout(std430, binding = 0) readonly buffer TokStart { uint tokStart[]; };   // [Hq][NB+1]
layout(std430, binding = 1) readonly buffer Plan { uint plan[]; };           // [Hq][16]
layout(std430, binding = 2) readonly buffer Expo { float expo[]; };          // [Hq][clustered]
layout(std430, binding = 3) readonly buffer ExpoFixed { float expoFixed[]; }; // [Hq][fixedStride]
layout(std430, binding = 4) writeonly buffer Cut { uint cut[]; };            // [Hq]

layout(push_constant) uniform Push {
	uint n;  // clustered tokens
	uint fixedCount;
	uint fixedStride;
	float p;
} pc;

shared float pre[NB + 1];   // S at bin boundaries
shared vec4 red[WG];       // scan of (exact segment, fixed, window 1, window 2) sums
shared uint best;
shared vec4 sgSum[SUBGROUPS * (WG / 4 - 1) + 1];  // each subgroup's total

const float GAMMA = 0.5772156649;

// harmonic returns H_x = Σ_{i ≤ x} 1/i.
float harmonic(uint x) {
	if (x == 0) return 0.0;
	if (x < 32) {
		float h = 0.0;
		for (uint i = 1; i <= x; i++) h += 1.0 / float(i);
		return h;
	}
	float f = float(x);
	float f2 = f * f;
	return log(f) + GAMMA + 1.0 / (2.0 * f) - 1.0 / (12.0 * f2) + 1.0 / (120.0 * f2 * f2);
}

// curve returns Σ_{x=lo}^{hi} max(0, a/x + b), in closed form.
float curve(float a, float b, uint lo, uint hi) {
	lo = max(lo, 1u);
	if (lo > hi) return 0.0;
	if (b > 0.0 && a < 0.0) {
		float x0 = -a / b;
		if (x0 >= float(hi)) return 0.0;
		lo = max(lo, uint(floor(x0)) + 1);
	} else if (a <= 0.0 && b <= 0.0) {
		return 0.0;
	} else if (b < 0.0) {
		float x0 = -a / b;
		if (x0 <= float(lo)) return 0.0;
		if (x0 < float(hi)) hi = uint(ceil(x0)) - 1;
	}
	if (lo > hi) return 0.0;
	return max(0.0, a * (harmonic(hi) - harmonic(lo - 1)) + b * float(hi - lo + 1));
}

void main() {
	uint tid = gl_LocalInvocationID.x;
	uint h = gl_WorkGroupID.x;
	uint pl = h * 16;
	uint j0 = plan[pl + 1];
	uint exact = plan[pl + 2];
	bool windows = plan[pl + 3] != 0;
	uint u1 = plan[pl + 6], v1 = plan[pl + 7];
	uint u2 = plan[pl + 10], v2 = plan[pl + 11];
	uint ob = h * (NB + 1);
	uint eb = h * pc.n;

	// Scan slot j sums the exact positions [j·per, (j+1)·per) and a share
	// of the fixed tokens and windows; an inclusive scan over the slots
	// follows, into red. Slots are thread indexes, or with subgroups go
	// subgroup after subgroup, the order their scans follow.
	uint slot = SUBGROUPS != 0 ? gl_SubgroupID * gl_SubgroupSize + gl_SubgroupInvocationID : tid;
	uint per = (exact + WG - 1) / WG;
	vec4 acc = vec4(0.0);
	for (uint x = slot * per; x < min(exact, slot * per + per); x++) acc.x += expo[eb + x];
	for (uint i = tid; i < pc.fixedCount; i += WG) acc.y += expoFixed[h * pc.fixedStride + i];
	if (windows) {
		for (uint x = u1 + tid; x < v1; x += WG) acc.z += expo[eb + x];
		for (uint x = u2 + tid; x < v2; x += WG) acc.w += expo[eb + x];
	}
	if (SUBGROUPS != 0) {
		vec4 incl = subgroupInclusiveAdd(acc);
		vec4 all = subgroupAdd(acc);
		if (subgroupElect()) sgSum[gl_SubgroupID] = all;
		barrier();
		for (uint i = 0; i < gl_SubgroupID; i++) incl += sgSum[i];
		red[slot] = incl;
		barrier();
	} else {
		red[tid] = acc;
		barrier();
		for (uint k = 1; k < WG; k <<= 1) {
			vec4 x = tid >= k ? red[tid - k] : vec4(0.0);
			barrier();
			red[tid] += x;
			barrier();
		}
	}
	float exactTotal = red[WG - 1].x, fixedTotal = red[WG - 1].y, win1 = red[WG - 1].z, win2 = red[WG - 1].w;

	float a = 0.0, bb = 0.0;
	if (windows) {
		float mu1 = win1 / float(v1 - u1), mu2 = win2 / float(v2 - u2);
		float h1 = (harmonic(v1) - harmonic(u1)) / float(v1 - u1);
		float h2 = (harmonic(v2) - harmonic(u2)) / float(v2 - u2);
		if (h1 != h2) {
			a = (mu1 - mu2) / (h1 - h2);
			bb = mu1 - a * h1;
		} else {
			bb = (win1 + win2) / float(v1 - u1 + v2 - u2);
		}
	}

	// S at every bin boundary: the exact prefix sum up to j0 (from the
	// scan, the owning thread's part summed again), the curve beyond.
	if (tid == 0) best = NB;
	for (uint j = tid; j <= NB; j += WG) {
		uint x = tokStart[ob + j];
		if (j > j0) {
			pre[j] = fixedTotal + exactTotal + curve(a, bb, exact + 1, x);
		} else if (x >= exact) {
			pre[j] = fixedTotal + exactTotal;
		} else {
			uint owner = x / per;
			float sum = owner == 0 ? 0.0 : red[owner - 1].x;
			for (uint y = owner * per; y < x; y++) sum += expo[eb + y];
			pre[j] = fixedTotal + sum;
		}
	}
	barrier();
	float total = fixedTotal + exactTotal + curve(a, bb, exact + 1, pc.n);
	if (j0 >= NB) total = pre[NB];
	if (pc.p < 1.0) {
		float target = pc.p * total;
		for (uint j = tid; j <= NB; j += WG) {
			if (pre[j] >= target) atomicMin(best, j);
		}
	}
	barrier();
	if (tid == 0) cut[h] = best;
}
