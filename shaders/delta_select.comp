#version 450
// DELTA's page pick at a Δ-layer (seed 002, Algorithm 2): of C pages with
// scores S_u ≥ 0, the last `recent` pages and, of the pages before them,
// the budget − recent of the greatest scores, ties to the lower page; all
// C when C ≤ budget. It writes, for every query head h, rank[h][u] = 0 for
// a picked page and 1 for the others, and cut[h] = 1, the selection the
// shared attention kernel reads over a page index. One workgroup: an exact
// radix select of the threshold over the scores' bits (non-negative floats
// order as their bits), 8 bits a pass, then the pages above it and the
// lowest-numbered ones equal to it.

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 256;  // threads, a power of two, at least 256

layout(std430, binding = 0) readonly buffer Scores { uint score[]; };  // [C] float bits
layout(std430, binding = 1) writeonly buffer Rank { uint rank[]; };    // [Hq][C]
layout(std430, binding = 2) writeonly buffer Cut { uint cut[]; };      // [Hq]

layout(push_constant) uniform Push {
	uint C;
	uint budget;
	uint recent;
	uint heads;
} pc;

shared uint hist[256];
shared uint prefix;  // the threshold's bits found so far
shared uint want;    // how many of the pages matching prefix are still to pick
shared uint eq[WG];  // per thread: pages equal to the threshold in its span

bool picked(uint u, uint tau, uint older, uint firstEq, inout uint seenEq, uint needEq) {
	if (u >= older) return true;  // recent
	uint s = score[u];
	if (s > tau) return true;
	if (s == tau) {
		bool take = firstEq + seenEq < needEq;
		seenEq++;
		return take;
	}
	return false;
}

void main() {
	uint tid = gl_LocalInvocationID.x;
	uint C = pc.C;
	bool all = C <= pc.budget;
	uint older = all ? C : C - pc.recent;  // pages before the recent ones
	uint m = all ? 0 : pc.budget - pc.recent;  // of them, to pick by score
	uint tau = 0;
	uint needEq = 0;
	if (!all) {
		if (tid == 0) {
			prefix = 0;
			want = m;
		}
		// Radix select of the m-th greatest score among pages [0, older).
		for (int shift = 24; shift >= 0; shift -= 8) {
			hist[tid % 256] = 0;
			barrier();
			uint mask = shift == 24 ? 0u : (0xffffffffu << uint(shift + 8));
			uint p = prefix;
			for (uint u = tid; u < older; u += WG) {
				uint s = score[u];
				if ((s & mask) == (p & mask)) atomicAdd(hist[(s >> uint(shift)) & 255u], 1);
			}
			barrier();
			if (tid == 0) {
				uint left = want;
				uint b = 255;
				for (;; b--) {
					if (hist[b] >= left || b == 0) break;
					left -= hist[b];
				}
				prefix = p | (b << uint(shift));
				want = left;
			}
			barrier();
		}
		tau = prefix;
		needEq = want;  // equal pages to take, lowest first
	}
	// Each thread's span of pages, in order: count the equal ones, then
	// number them across threads.
	uint span = (older + WG - 1) / WG;
	uint lo = min(tid * span, older), hi = min(lo + span, older);
	uint n = 0;
	if (!all) {
		for (uint u = lo; u < hi; u++) n += score[u] == tau ? 1u : 0u;
	}
	eq[tid] = n;
	barrier();
	uint firstEq = 0;
	for (uint i = 0; i < tid; i++) firstEq += eq[i];
	uint seen = 0;
	for (uint u = lo; u < hi; u++) {
		uint r = all || picked(u, tau, older, firstEq, seen, needEq) ? 0u : 1u;
		for (uint h = 0; h < pc.heads; h++) rank[h * C + u] = r;
	}
	for (uint u = older + tid; u < C; u += WG) {
		for (uint h = 0; h < pc.heads; h++) rank[h * C + u] = 0;
	}
	for (uint h = tid; h < pc.heads; h += WG) cut[h] = 1;
}
