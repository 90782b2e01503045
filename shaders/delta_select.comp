#version 450
// DELTA's page pick at a Δ-layer (the DELTA paper, Algorithm 2): of C pages with
// scores S_u ≥ 0, the last `recent` pages and, of the pages before them,
// the budget − recent of the greatest scores, ties to the lower page; all
// C when C ≤ budget. It writes the picked pages' first slots u·P in
// ascending order, min(C, budget) of them, for every KV head g:
// starts[g][i] (the page index the layers after it attend). One
// workgroup: an exact radix select of the threshold over the scores' bits
// (non-negative floats order as their bits), 11 bits a pass; then each
// thread takes a contiguous span of pages, counts its picks, and writes
// them after the picks of the spans before it. Up to HELD scores are read
// once into shared memory (coalesced), more from the buffer each pass.

#extension GL_EXT_control_flow_attributes : enable

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 256;     // threads, a power of two from 256 to 2048
layout(constant_id = 1) const uint HELD = 8192;  // scores held in shared memory

layout(std430, binding = 0) readonly buffer Scores { uint score[]; };  // [C] float bits
layout(std430, binding = 1) writeonly buffer Starts { uint starts[]; };  // [heads][min(C, budget)]

layout(push_constant) uniform Push {
	uint C;
	uint budget;
	uint recent;
	uint heads;     // KV heads
	uint pageSize;  // P
} pc;

const uint NB = 2048;  // bins of a radix pass: 11 bits
shared uint hist[NB];
shared uint groupSums[WG / 16];  // exclusiveSum's, 16 threads a group
shared uint prefix;  // the threshold's bits found so far
shared uint want;    // how many of the pages matching prefix are still to pick
shared uint sums[WG];
// The held scores, a word of padding after every 32, so that threads
// reading contiguous spans of 32 hit distinct banks.
shared uint held[HELD + HELD / 32];

// scoreOf returns page u's score bits.
uint scoreOf(uint u) { return pc.C <= HELD ? held[u + u / 32] : score[u]; }

// exclusiveSum returns the sum of v over the threads below this one, and
// in total the sum over all threads: sums of 16 threads a group, then each
// thread adds the groups and the threads of its group below it.
uint exclusiveSum(uint v, out uint total) {
	uint tid = gl_LocalInvocationID.x;
	sums[tid] = v;
	barrier();
	if (tid < WG / 16) {
		uint c = 0;
		for (uint i = 0; i < 16; i++) c += sums[tid * 16 + i];
		groupSums[tid] = c;
	}
	barrier();
	uint before = 0;
	total = 0;
	for (uint g = 0; g < WG / 16; g++) {
		if (g < tid / 16) before += groupSums[g];
		total += groupSums[g];
	}
	for (uint i = tid / 16 * 16; i < tid; i++) before += sums[i];
	barrier();  // sums and groupSums are written again by the next call
	return before;
}

void main() {
	uint tid = gl_LocalInvocationID.x;
	uint C = pc.C;
	bool all = C <= pc.budget;
	uint older = all ? C : C - pc.recent;  // pages before the recent ones
	uint m = all ? 0 : pc.budget - pc.recent;  // of them, to pick by score
	uint tau = 0xffffffffu;
	uint needEq = 0;
	if (C <= HELD) {
		// All loads in flight at once, then the stores.
		uint v[(HELD + WG - 1) / WG];
		[[unroll]] for (uint k = 0; k < (HELD + WG - 1) / WG; k++) {
			uint u = tid + k * WG;
			v[k] = u < C ? score[u] : 0u;
		}
		[[unroll]] for (uint k = 0; k < (HELD + WG - 1) / WG; k++) {
			uint u = tid + k * WG;
			if (u < C) held[u + u / 32] = v[k];
		}
		barrier();
	}
	if (!all && m > 0) {
		if (tid == 0) {
			prefix = 0;
			want = m;
		}
		// Radix select of the m-th greatest score among pages [0, older):
		// each pass counts the next 11 bits (10 in the last) of the
		// candidates into NB bins; each thread owns NB / WG consecutive
		// bins, and the one holding the bin where the count from the top
		// reaches want takes it.
		for (uint pass = 0; pass < 3; pass++) {
			uint width = pass == 2 ? 10u : 11u;
			uint shift = 21u - 11u * pass;  // 21, 10, 0
			for (uint i = tid; i < NB; i += WG) hist[i] = 0;
			barrier();
			uint mask = pass == 0 ? 0u : (0xffffffffu << (shift + width));
			uint p = prefix;
			uint w = want;
			for (uint u = tid; u < older; u += WG) {
				uint s = scoreOf(u);
				if ((s & mask) == (p & mask)) atomicAdd(hist[(s >> shift) & ((1u << width) - 1u)], 1);
			}
			barrier();
			const uint PB = NB / WG;
			uint own = 0;
			for (uint i = 0; i < PB; i++) own += hist[tid * PB + i];
			uint total;
			uint below = exclusiveSum(own, total);
			uint running = total - below - own;  // the bins above this thread's
			for (int i = int(PB) - 1; i >= 0; i--) {
				uint b = tid * PB + uint(i);
				uint c = hist[b];
				if (running < w && running + c >= w) {
					prefix = p | (b << shift);
					want = w - running;
				}
				running += c;
			}
			barrier();
		}
		tau = prefix;
		needEq = want;  // equal pages to take, lowest first
	}
	// Each thread's contiguous span of pages: its pages equal to the
	// threshold numbered across threads, then its picks.
	uint span = (C + WG - 1) / WG;
	uint lo = min(tid * span, C), hi = min(lo + span, C);
	uint eq = 0;
	for (uint u = lo; u < min(hi, older); u++) eq += uint(!all && scoreOf(u) == tau);
	uint total;
	uint seen = exclusiveSum(eq, total);
	uint mine = 0;
	for (uint u = lo; u < hi; u++) {
		bool take = all || u >= older;
		if (!take) {
			uint s = scoreOf(u);
			take = s > tau && tau != 0xffffffffu;
			if (s == tau) take = seen++ < needEq;
		}
		mine += uint(take);
	}
	uint at = exclusiveSum(mine, total);
	uint K = min(C, pc.budget);
	seen -= eq;  // back to this span's first equal page
	for (uint u = lo; u < hi; u++) {
		bool take = all || u >= older;
		if (!take) {
			uint s = scoreOf(u);
			take = s > tau && tau != 0xffffffffu;
			if (s == tau) take = seen++ < needEq;
		}
		if (take) {
			for (uint g = 0; g < pc.heads; g++) starts[g * K + at] = u * pc.pageSize;
			at++;
		}
	}
}
