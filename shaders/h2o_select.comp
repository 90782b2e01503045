#version 450
// H2O's selection: accumulate the attention paid since the last
// selection, then select the heavy hitters, for query head h =
// gl_WorkGroupID.y.
//
// Accumulate: a workgroup takes WG·PER indexed tokens c and, where the
// token's logit row[h][first + c] is finite (the last step's attention
// wrote it, AttentionRecord, or h2o_score's prompt phase), adds the
// head's softmax weight exp(row[h][first + c] − m) / z ((m, z) = mz[h],
// from the same kernel) to acc[h][c] and sets the row back to −∞, so
// that each logit is added once. With pc.observe set that is all. Otherwise it writes
// rank[h][c] = 2^31 − bits(acc[h][c]) for a candidate (c < S) and 0 for
// the others (the recent part, always taken), and adds its candidates'
// counts by the top 11 bits of their scores' float bits to hist0[h]
// (counted in shared memory first).
//
// Select: the last workgroup of the head to arrive (an arrival counter)
// finds the heavy-th greatest accumulated score v among the
// candidates exactly (a radix select over the float bits, 11 + 11 + 10
// bits: the scores are never negative, so their bits order as they do;
// the first level from hist0, which it resets; the next two over the
// candidates of the first level's bin, gathered into shared memory where
// at most LIST, else over all candidates) and takes every candidate above
// v and, of those equal to v, the lowest ids first, so that exactly heavy
// candidates are taken (none for heavy = 0): where all of v's ties are
// taken (or none for heavy = 0) it writes cut[h] = 2^31 + 1 − bits(v)
// (1 for heavy = 0), so that the tokens ranked below it are those taken;
// else it rewrites the candidates' ranks as 0 for a token taken and 1 for
// the others, with cut[h] = 1, and resets the counter.
#extension GL_EXT_control_flow_attributes : enable
#extension GL_KHR_shader_subgroup_basic : enable
#extension GL_KHR_shader_subgroup_arithmetic : enable

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 1024;  // threads, a power of two, at most 1 024
// SUBGROUPS = 1 scans with subgroup arithmetic (the host sets it only
// where supported, with subgroups of 4 to WG threads); 0 uses a
// shared-memory tree.
layout(constant_id = 1) const uint SUBGROUPS = 0;
layout(constant_id = 2) const uint LIST = 4096;  // candidates gathered in shared memory at most
layout(constant_id = 3) const uint PER = 8;      // tokens a thread accumulates

const uint NBINS = 2048;  // bins of the widest radix level
const uint UN = 16;       // scores a thread loads at once in a pass over the candidates
const uint TOP = 0x80000000u;  // a candidate's rank is TOP − its score's bits
const float NEG = -1.0 / 0.0;

layout(std430, binding = 0) buffer Rows { float row[]; };              // [Hq][R], −∞ where nothing is left to add
layout(std430, binding = 1) readonly buffer MZ { vec2 mz[]; };         // [Hq]
// Written by every workgroup of a head, read by the last: coherent.
layout(std430, binding = 2) coherent buffer Acc { float acc[]; };      // [Hq][C]
layout(std430, binding = 3) writeonly buffer Rank { uint rank[]; };    // [Hq][C]
layout(std430, binding = 4) writeonly buffer Cut { uint cut[]; };      // [Hq]
layout(std430, binding = 5) coherent buffer Arrived { uint arrived[]; }; // [Hq], 0 between steps
layout(std430, binding = 6) coherent buffer Hist0 { uint hist0[]; };   // [Hq][NBINS], 0 between steps

layout(push_constant) uniform Push {
	uint C;          // indexed tokens per KV head
	uint first;      // slot of indexed token 0
	uint R;          // row stride per query head
	uint heavy;      // candidates to take, below S
	uint S;          // candidates: indexed tokens [0, S)
	uint observe;    // 1: accumulate only (every slot of n scored)
} pc;

shared uint hist[NBINS];
shared uint sums[WG];     // scanU's slots
shared uint lst[LIST];    // the gathered candidates' keys
shared uint nList, sDigit, sNeed, sTies;
shared bool last;

// slotOf is the thread's place in subgroup order (that of the scans).
uint slotOf() {
	return SUBGROUPS != 0 ? gl_SubgroupID * gl_SubgroupSize + gl_SubgroupInvocationID : gl_LocalInvocationID.x;
}

// scanU returns the exclusive prefix sum of x over the workgroup's slots.
uint scanU(uint x) {
	uint slot = slotOf();
	if (SUBGROUPS != 0) {
		uint incl = subgroupInclusiveAdd(x);
		uint all = subgroupAdd(x);
		if (subgroupElect()) sums[gl_SubgroupID] = all;
		barrier();
		for (uint i = 0; i < gl_SubgroupID; i++) incl += sums[i];
		barrier();
		return incl - x;
	}
	sums[slot] = x;
	barrier();
	for (uint d = 1; d < WG; d <<= 1) {
		uint y = slot >= d ? sums[slot - d] : 0;
		barrier();
		sums[slot] += y;
		barrier();
	}
	uint r = sums[slot] - x;
	barrier();
	return r;
}

// findDigit finds, over hist[0, bins), the greatest digit d with
// Σ_{b ≥ d} hist[b] ≥ need (0 if none) and sets sDigit = d,
// sNeed = need − Σ_{b > d} hist[b] and sTies = hist[d]: each slot sums
// bins/WG bins from the top down, the slots' sums are scanned, and the
// slot whose range holds need walks its bins.
void findDigit(uint bins, uint need) {
	uint per = bins / WG, slot = slotOf();
	uint top = bins - slot * per;  // past this slot's bins
	uint cnt = 0;
	for (uint i = 0; i < per; i++) cnt += hist[top - 1 - i];
	uint ex = scanU(cnt);
	if ((ex < need && need <= ex + cnt) || (slot == WG - 1 && ex + cnt < need)) {
		uint left = need - ex, b = top - 1;
		for (uint i = 1; i < per && hist[b] < left; i++) {
			left -= hist[b];
			b--;
		}
		sDigit = b;
		sNeed = left;
		sTies = hist[b];
	}
	barrier();
}

// loadKeys loads the float bits of the candidate scores at base + x0 +
// u·WG + tid, u < UN, all in flight together (past S: the last one again).
void loadKeys(uint base, uint x0, out uint key[UN]) {
	[[unroll]] for (uint u = 0; u < UN; u++) key[u] = floatBitsToUint(acc[base + min(x0 + u * WG + gl_LocalInvocationID.x, pc.S - 1)]);
}

// clearHist zeroes the shared bins.
void clearHist() {
	for (uint i = gl_LocalInvocationID.x; i < NBINS; i += WG) hist[i] = 0;
	barrier();
}

void main() {
	uint tid = gl_LocalInvocationID.x;
	uint h = gl_WorkGroupID.y;
	uint base = h * pc.C;
	bool rank0 = pc.observe == 0 && pc.heavy > 0;  // this step ranks by the scores
	if (rank0) clearHist();

	// Accumulate, and count the candidates by their first digit, PER
	// tokens a thread (WG apart) with their loads in flight together.
	vec2 s = mz[h];
	float a[PER], l[PER];
	[[unroll]] for (uint i = 0; i < PER; i++) {
		uint c = min((gl_WorkGroupID.x * PER + i) * WG + tid, pc.C - 1);
		a[i] = acc[base + c];
		l[i] = row[h * pc.R + pc.first + c];
	}
	[[unroll]] for (uint i = 0; i < PER; i++) {
		uint c = (gl_WorkGroupID.x * PER + i) * WG + tid;
		if (c < pc.C) {
			if (l[i] != NEG) {
				a[i] += exp(l[i] - s.x) / s.y;
				acc[base + c] = a[i];
				row[h * pc.R + pc.first + c] = NEG;
			}
			if (pc.observe == 0) rank[base + c] = c < pc.S ? TOP - floatBitsToUint(a[i]) : 0;
			if (rank0 && c < pc.S) atomicAdd(hist[floatBitsToUint(a[i]) >> 21], 1);
		}
	}
	if (pc.observe != 0) return;
	if (rank0) {
		barrier();
		for (uint i = tid; i < NBINS; i += WG) {
			if (hist[i] != 0) atomicAdd(hist0[h * NBINS + i], hist[i]);
		}
	}

	// The last workgroup of the head to arrive selects.
	memoryBarrierBuffer();
	barrier();
	if (tid == 0) {
		last = atomicAdd(arrived[h], 1) == gl_NumWorkGroups.x - 1;
		if (last) arrived[h] = 0;
	}
	barrier();
	if (!last) return;
	memoryBarrierBuffer();


	// v = prefix, the heavy-th greatest key, ties of which `need` are
	// taken.
	uint prefix = 0, need = 0, ties = 0;
	if (pc.heavy > 0) {
		for (uint i = tid; i < NBINS; i += WG) {
			hist[i] = hist0[h * NBINS + i];
			hist0[h * NBINS + i] = 0;
		}
		barrier();
		findDigit(NBINS, pc.heavy);
		prefix = sDigit << 21;
		need = sNeed;
		uint mask = 0xffe00000u;
		bool gathered = sTies <= LIST;
		if (gathered) {
			// The first digit's candidates into lst.
			if (tid == 0) nList = 0;
			barrier();
			for (uint x0 = 0; x0 < pc.S; x0 += WG * UN) {
				uint key[UN];
				loadKeys(base, x0, key);
				[[unroll]] for (uint u = 0; u < UN; u++) {
					if (x0 + u * WG + tid < pc.S && (key[u] & mask) == prefix) lst[atomicAdd(nList, 1)] = key[u];
				}
			}
			barrier();
		}
		uint count = nList;
		[[unroll]] for (uint level = 1; level < 3; level++) {
			uint shift = level == 1 ? 10 : 0, bins = level == 1 ? 2048 : 1024;
			clearHist();
			if (gathered) {
				for (uint i = tid; i < count; i += WG) {
					uint key = lst[i];
					if ((key & mask) == prefix) atomicAdd(hist[(key >> shift) & (bins - 1)], 1);
				}
			} else {
				for (uint x0 = 0; x0 < pc.S; x0 += WG * UN) {
					uint key[UN];
					loadKeys(base, x0, key);
					[[unroll]] for (uint u = 0; u < UN; u++) {
						if (x0 + u * WG + tid < pc.S && (key[u] & mask) == prefix) atomicAdd(hist[(key[u] >> shift) & (bins - 1)], 1);
					}
				}
			}
			barrier();
			findDigit(bins, need);
			prefix |= sDigit << shift;
			need = sNeed;
			ties = sTies;
			mask |= (bins - 1) << shift;
		}
	}

	if (ties == need) {
		// Every tie taken (or none, heavy = 0): the scores of v and
		// above, ranked below TOP + 1 − v.
		if (tid == 0) cut[h] = pc.heavy > 0 ? TOP + 1 - prefix : 1;
		return;
	}
	// Ties at v: the lowest ids first (each slot a run of candidates).
	if (tid == 0) cut[h] = 1;
	uint per = (pc.S + WG - 1) / WG, slot = slotOf();
	uint from = min(pc.S, slot * per), to = min(pc.S, from + per);
	uint eq = 0;
	for (uint x = from; x < to; x++) {
		if (floatBitsToUint(acc[base + x]) == prefix) eq++;
	}
	uint before = scanU(eq);
	for (uint x = from; x < to; x++) {
		uint key = floatBitsToUint(acc[base + x]);
		bool take = key > prefix || (key == prefix && before < need);
		if (key == prefix) before++;
		rank[base + x] = take ? 0 : 1;
	}
}
