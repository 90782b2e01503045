#version 450
// Double-P's two top-p cuts (the Double-P paper, sections 4.2-4.3), one workgroup per query
// head h = gl_WorkGroupID.x, after centroid_score (LOG_SIZE = 1). It ranks the head's
// clusters by bin(l) = min(NB − 1, ⌊(m − l)·u⌋), m and m0 the best and
// worst finite logits (from the extremes centroid_score folded, which it
// resets to 0 for the next step) and u = 2^(log2 NB − e) for m − m0 =
// f·2^e, f in [0.5, 1) (NB for an empty cluster, past every cut). It sums
// each bin's estimated mass in fixed point, with integer atomics only:
// each term exp(l − m_b), m_b = m − b/u the bin's top (so the term is in
// (0, 1]), times pc.quant, truncated; the bin's mass is that sum / quant ·
// exp(−b/u). A scan of the bins gives keep, the fewest leading bins
// holding at least p1 of the mass, and exact ≤ keep, the fewest holding at
// least p2 of the kept mass. It writes each cluster's bin (the rank the
// attention compares with the cuts) and both cuts.
#extension GL_EXT_control_flow_attributes : enable

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 256;   // threads, a power of two dividing NB
layout(constant_id = 1) const uint NB = 1024;  // bins
layout(constant_id = 2) const int LOG2NB = 10;

const uint PER = NB / WG;  // bins a thread scans
const uint BATCH = 8;      // logits a thread loads at once
const float NEG = -1.0 / 0.0;

layout(std430, binding = 0) readonly buffer Logits { float s[]; };      // [Hq][C]
layout(std430, binding = 1) writeonly buffer BinOf { uint binOf[]; };    // [Hq][C]
layout(std430, binding = 2) writeonly buffer Exact { uint exactCut[]; }; // [Hq]
layout(std430, binding = 3) writeonly buffer Keep { uint keepCut[]; };   // [Hq]
layout(std430, binding = 4) buffer Extremes { uvec2 ext[]; };            // [Hq]

layout(push_constant) uniform Push {
	uint C;
	float p1, p2;
	float quant;  // fixed-point scale of a term, C · quant ≤ 2^31
} pc;

shared uint bins[NB];   // the bins' fixed-point masses
shared float part[WG];  // scan of the bins' masses
shared uint found[2];
shared float kept;

// unkey inverts centroid_score's key.
float unkey(uint k) {
	return uintBitsToFloat((k & 0x80000000u) != 0 ? k & 0x7fffffffu : ~k);
}

// binMass returns the estimated mass of bin b, its fixed-point sum x,
// relative to m.
float binMass(uint x, uint b, float u) {
	return float(x) / pc.quant * exp(-float(b) / u);
}

void main() {
	uint tid = gl_LocalInvocationID.x;
	uint h = gl_WorkGroupID.x;
	uint sb = h * pc.C;
	uvec2 e = ext[h];
	float m = unkey(e.x), m0 = unkey(~e.y);
	float u = 1.0;
	if (m - m0 > 0.0) {
		int ex;
		frexp(m - m0, ex);
		u = ldexp(1.0, LOG2NB - ex);
	}
	for (uint i = tid; i < NB; i += WG) bins[i] = 0;
	if (tid < 2) found[tid] = NB;
	barrier();
	if (tid == 0) ext[h] = uvec2(0);  // read by every thread above

	// BATCH logits loaded at once, all in flight together. A thread adds up
	// its run of clusters in one bin before one atomic.
	uint runBin = NB, runSum = 0;
	for (uint c0 = tid; c0 < pc.C; c0 += WG * BATCH) {
		float lv[BATCH];
		[[unroll]] for (uint i = 0; i < BATCH; i++) lv[i] = s[sb + min(c0 + i * WG, pc.C - 1)];
		[[unroll]] for (uint i = 0; i < BATCH; i++) {
			uint cl = c0 + i * WG;
			if (cl >= pc.C) break;
			uint b = NB;
			if (lv[i] != NEG) {
				b = min(NB - 1, uint(floor((m - lv[i]) * u)));
				if (b != runBin) {
					if (runSum != 0) atomicAdd(bins[runBin], runSum);
					runBin = b;
					runSum = 0;
				}
				runSum += uint(min(exp(lv[i] - (m - float(b) / u)), 1.0) * pc.quant);
			}
			binOf[sb + cl] = b;
		}
	}
	if (runSum != 0) atomicAdd(bins[runBin], runSum);
	barrier();

	// Inclusive scan of the bins' masses: thread tid sums bins
	// [tid·PER, (tid+1)·PER).
	float mine = 0.0;
	for (uint i = 0; i < PER; i++) mine += binMass(bins[tid * PER + i], tid * PER + i, u);
	part[tid] = mine;
	barrier();
	for (uint k = 1; k < WG; k <<= 1) {
		float y = tid >= k ? part[tid - k] : 0.0;
		barrier();
		part[tid] += y;
		barrier();
	}
	float total = part[WG - 1];
	float before = part[tid] - mine;
	// keep: the first bin where the running mass reaches p1 of the total.
	float run = before;
	for (uint i = 0; i < PER; i++) {
		uint b = tid * PER + i;
		run += binMass(bins[b], b, u);
		if (run >= pc.p1 * total) {
			atomicMin(found[0], b);
			break;
		}
	}
	barrier();
	uint keep = found[0] == NB ? NB : found[0] + 1;
	// The kept mass: the running mass through bin keep − 1.
	run = before;
	for (uint i = 0; i < PER; i++) {
		uint b = tid * PER + i;
		run += binMass(bins[b], b, u);
		if (b + 1 == keep) kept = run;
	}
	barrier();
	float target = pc.p2 * kept;
	run = before;
	for (uint i = 0; i < PER; i++) {
		uint b = tid * PER + i;
		run += binMass(bins[b], b, u);
		if (run >= target) {
			atomicMin(found[1], b);
			break;
		}
	}
	barrier();
	if (tid == 0) {
		uint exact = found[1] == NB ? keep : min(found[1] + 1, keep);
		exactCut[h] = total > 0.0 ? exact : 0;
		keepCut[h] = total > 0.0 ? keep : 0;
	}
}
