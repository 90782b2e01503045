#version 450
// Tactic's selection for query head h = gl_WorkGroupID.y after
// centroid_score (LOG_SIZE = 0), in one dispatch: order, sampling, fit and
// cut. Every workgroup of the head (W = gl_NumWorkGroups.x of them) first
// ranks all the head's clusters by
//   bin(s) = min(NB − 1, ⌊(m − s)·u⌋),
// m and m0 the head's best and worst scores (the extremes centroid_score
// folded; the last workgroup resets them to 0 for the next step) and
// u = 2^(log2 NB − e) for m − m0 = f·2^e, f in [0.5, 1) (u = 1 if m = m0):
// a power of two, so the bin is exact. It sums the bins' token counts and
// scans them into token offsets start[b] (the order of the head's
// clustered tokens is bin by bin), and finds the plan of Alg. 1: the exact
// bins [0, j0), the fewest that cover at least `need` tokens, and the bins
// r1..r2 and r3..r4 holding the two sampling windows' positions. All
// workgroups compute the same order from the same scores; workgroup w
// writes the bins of clusters c ≡ w (mod W) and samples those of them in
// the exact bins or a window, a team of TEAM threads per cluster, listing
// each one's bin b and sum
//   Σ_{t in c} e(t),  e(t) = exp(scale·q_h·k_t − m),
// as smp[h][w·cap + i] = (c·NB + b, sum bits), i < count_w, cap = ⌈C/W⌉
// (so C·NB < 2^32); a window's clusters beyond the exact bins only where
// c is a multiple of pc.stride (1: all); and its share of the fixed tokens
// (the sinks [0, sinks) and the tail [clusteredEnd, n)) with its count and
// the tokens it sampled in each window as
// fsum[h][w] = (Σ e(t), count_w bits, window 1's bits, window 2's bits).
// The last of the head's workgroups to finish (an arrival counter, reset
// by it; no workgroup waits for another) fits: the listed sums per bin,
// scanned; the fixed total F; the exact sum E = Σ bins < j0; the
// windows' means μ over the tokens they sampled and mean 1/x over their
// token ranges [start[r1], start[r2 + 1]) and [start[r3], start[r4 + 1])
// (positions from 1); the curve y = a/x + b through them in the 1/x
// coordinate (a = 0 and b the pooled mean where a window sampled none); the
// estimated cumulative sum S at every bin boundary j (F + the exact
// prefix for j ≤ j0, F + E + Σ_{x = exact+1}^{start[j]} max(0, a/x + b)
// beyond, in closed form); and the cut, the least j with S(j) ≥ P·S(n)
// (NB at P = 1). The head selects the clusters of bins below the cut.
// plan[h][15] is W.
// TacticBinnedBudgetRef states the same computation in float64.
#extension GL_EXT_control_flow_attributes : enable
#extension GL_KHR_shader_subgroup_basic : enable
#extension GL_KHR_shader_subgroup_shuffle : enable
#extension GL_KHR_shader_subgroup_arithmetic : enable

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 1024;  // threads, a power of two dividing NB
layout(constant_id = 1) const uint D = 128;
// TPR threads share a K row (dividing D/8, and the subgroup size where
// above 1: shuffles); each scores RPT rows at once.
layout(constant_id = 2) const uint TPR = 1;
layout(constant_id = 3) const uint RPT = 1;
// TEAM, a multiple of TPR dividing WG, is the threads per sampled cluster.
layout(constant_id = 4) const uint TEAM = 16;
layout(constant_id = 5) const uint NB = 1024;
layout(constant_id = 6) const int LOG2NB = 10;
// SUBGROUPS = 1 scans and sums with subgroup arithmetic (the host sets it
// only where supported, with subgroups of 4 to WG threads); 0 uses
// shared-memory trees.
layout(constant_id = 7) const uint SUBGROUPS = 0;
// TEAM_SHUFFLE = 1 sums a team's threads with subgroup shuffles, so that
// teams go on without waiting for each other (the host sets it only where
// shuffles work and TEAM divides the subgroup size); 0 meets in shared
// memory, a round of teams at a time.
layout(constant_id = 8) const uint TEAM_SHUFFLE = 0;

const uint DV = D / 8;           // uvec4 per fp16 K row
const uint WPT = DV / TPR;       // words per thread per row
const uint SLOTS = TEAM / TPR;   // rows a team scores side by side
const uint PASS = SLOTS * RPT;   // rows a team scores at once
const uint TEAMS = WG / TEAM;
const uint BATCH = 8;            // clusters a thread loads at once
const uint PER = NB / WG;        // bins per thread in the scans
// A segment of a workgroup's share of the clusters: LIST of them, SEGS
// rounds of a cluster a thread; its sampled ones are listed (at most LIST),
// then sampled by all the teams at once (the host's selectSegment).
layout(constant_id = 9) const uint SEGS = 2;
const uint LIST = SEGS * WG;
// MOMENTS = 1 (TacticFit.Moments) samples no cluster: the plan's exact
// part is every bin (the host sets need = n), and each workgroup w sums
// over the clusters c of its share, by bin b, their moment estimates
//   ê_c = s_c·exp(min(l_c + ½·σ²_c·Σ_i (scale·q_i)²·w_i − m, CAP))
// in place of sums over their members (s_c its size, l_c its score, σ²_c
// and w the index's spreads and the KV head's dimension weights), writing
// every bin's sum to binSum[h][w][b] and no list; the last workgroup adds
// the W sums of each bin. With one workgroup a head (W = 1) it fits at
// once from its own sums and fixed tokens' sum, in registers: nothing is
// read back and no arrival is counted.
layout(constant_id = 10) const uint MOMENTS = 0;
const float CAP = 60.0;   // sparse.MomentExpCap

layout(std430, binding = 0) readonly buffer Queries { vec4 q[]; };      // [Hq][D/4]
layout(std430, binding = 1) readonly buffer Keys { uvec4 k[]; };        // [Hkv][headStride]
layout(std430, binding = 2) readonly buffer Scores { float s[]; };      // [Hq][C]
layout(std430, binding = 3) readonly buffer Starts { uint starts[]; };  // [Hkv][C] member offsets
layout(std430, binding = 4) readonly buffer Sizes { uint sizes[]; };    // [Hkv][C]
layout(std430, binding = 5) writeonly buffer BinOf { uint binOf[]; };   // [Hq][C]
// Written by every workgroup of a head, read by the last: coherent.
layout(std430, binding = 6) coherent buffer Sampled { uvec2 smp[]; };   // [Hq][C + maxW]
layout(std430, binding = 7) coherent buffer FixedSum { vec4 fsum[]; };   // [Hq][maxW]
layout(std430, binding = 8) writeonly buffer Plan { uint plan[]; };      // [Hq][16]
layout(std430, binding = 9) writeonly buffer Cut { uint cut[]; };        // [Hq]
layout(std430, binding = 10) coherent buffer Extremes { uvec2 ext[]; };  // [Hq], 0 between steps
layout(std430, binding = 11) coherent buffer Arrived { uint arrived[]; }; // [Hq], 0 between steps
// MOMENTS = 1 only.
layout(std430, binding = 12) readonly buffer Spreads { float spread[]; };   // [Hkv][C]
layout(std430, binding = 13) readonly buffer DimWeights { vec4 dw[]; };    // [Hkv][D/4]
layout(std430, binding = 14) coherent buffer BinSums { float binSum[]; };  // [Hq][W][NB]

layout(push_constant) uniform Push {
	uint C;
	uint groupSize;
	uint headStride;    // uvec4 words between KV heads in Keys
	uint n;             // clustered tokens per head
	uint need;          // tokens the exact part covers at least
	uint lo1, hi1, lo2, hi2;  // window positions (1-based, inclusive)
	uint sinks;         // slot of the first clustered token
	uint clusteredEnd;
	uint tokens;        // tokens stored
	uint maxW;          // fsum's stride
	float scale;
	float p;            // target mass
	uint stride;        // a window samples clusters c ≡ 0 (mod stride)
} pc;

shared vec4 qs[D / 4];
shared uint start[NB + 1];   // bins' token counts, then their token offsets
// The fit: the bins' sums, then S at the boundaries, as float bits (the
// sums are added with compare-and-swap).
shared uint pre[NB + 1];
shared uint lst[WG];         // scanU's slots
// The sampled clusters of a segment of this workgroup's share, c·NB + b.
shared uint seg[LIST];
shared uint nList;
shared uint found[5];
shared uint winCount[2];     // tokens sampled in each window
shared vec4 part[WG];        // team sums; scanV's slots or subgroup totals
shared bool last;

// unkey inverts centroid_score's key.
float unkey(uint x) {
	return uintBitsToFloat((x & 0x80000000u) != 0 ? x & 0x7fffffffu : ~x);
}

uint binOfScore(float m, float u, float x) {
	return min(NB - 1, uint(floor((m - x) * u)));
}

// loadBatch loads the scores (of head row sb) and sizes (of KV head g) of
// clusters c0, c0 + WG, ..., BATCH of them, all in flight together; past
// the last cluster it loads the last one again.
void loadBatch(uint c0, uint sb, uint g, out float sv[BATCH], out uint zv[BATCH]) {
	[[unroll]] for (uint i = 0; i < BATCH; i++) {
		uint cl = min(c0 + i * WG, pc.C - 1);
		sv[i] = s[sb + cl];
		zv[i] = sizes[g * pc.C + cl];
	}
}

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
		if (subgroupElect()) lst[gl_SubgroupID] = all;
		barrier();
		for (uint i = 0; i < gl_SubgroupID; i++) incl += lst[i];
		barrier();
		return incl - x;
	}
	lst[slot] = x;
	barrier();
	for (uint d = 1; d < WG; d <<= 1) {
		uint y = slot >= d ? lst[slot - d] : 0;
		barrier();
		lst[slot] += y;
		barrier();
	}
	uint r = lst[slot] - x;
	barrier();
	return r;
}

// scanV returns the inclusive prefix sum of x over the workgroup's slots,
// and in total the sum over all of them.
vec4 scanV(vec4 x, out vec4 total) {
	uint slot = slotOf();
	if (SUBGROUPS != 0) {
		vec4 incl = subgroupInclusiveAdd(x);
		vec4 all = subgroupAdd(x);
		if (subgroupElect()) part[gl_SubgroupID] = all;
		barrier();
		total = vec4(0.0);
		for (uint i = 0; i < gl_NumSubgroups; i++) {
			if (i < gl_SubgroupID) incl += part[i];
			total += part[i];
		}
		barrier();
		return incl;
	}
	part[slot] = x;
	barrier();
	for (uint d = 1; d < WG; d <<= 1) {
		vec4 y = slot >= d ? part[slot - d] : vec4(0.0);
		barrier();
		part[slot] += y;
		barrier();
	}
	vec4 r = part[slot];
	total = part[WG - 1];
	barrier();
	return r;
}

// scoreRows returns in ev[r] e(tok[r]) for the RPT rows of KV head g, on
// every one of the TPR threads sharing the rows (sub is the thread's part).
void scoreRows(uint g, uint tok[RPT], uint sub, float m, out float ev[RPT]) {
	uvec4 w[RPT * WPT];
	[[unroll]] for (uint r = 0; r < RPT; r++) {
		uint row = g * pc.headStride + tok[r] * DV;
		[[unroll]] for (uint j = 0; j < WPT; j++) w[r * WPT + j] = k[row + j * TPR + sub];
	}
	float acc[RPT];
	[[unroll]] for (uint r = 0; r < RPT; r++) acc[r] = 0.0;
	[[unroll]] for (uint j = 0; j < WPT; j++) {
		uint u = j * TPR + sub;
		vec4 qa = qs[2 * u], qb = qs[2 * u + 1];
		[[unroll]] for (uint r = 0; r < RPT; r++) {
			uvec4 x = w[r * WPT + j];
			acc[r] += dot(vec4(unpackHalf2x16(x.x), unpackHalf2x16(x.y)), qa) + dot(vec4(unpackHalf2x16(x.z), unpackHalf2x16(x.w)), qb);
		}
	}
	if (TPR > 1) {
		[[unroll]] for (uint o = TPR / 2; o > 0; o >>= 1) {
			[[unroll]] for (uint r = 0; r < RPT; r++) acc[r] += subgroupShuffleXor(acc[r], o);
		}
	}
	[[unroll]] for (uint r = 0; r < RPT; r++) ev[r] = exp(acc[r] - m);
}

// sampleCluster returns this thread's part of Σ_{t in c} e(t) over the
// members of cluster c of KV head g (0 but on the threads with sub = 0):
// the layer holds clusters in cluster order (kvcache Layer.Reorder), so the
// members are the slots from sinks + the cluster's start; the team scores
// PASS of them at once.
float sampleCluster(uint g, uint c, uint tslot, uint sub, float m, out uint size) {
	uint from = pc.sinks + starts[g * pc.C + c];
	size = sizes[g * pc.C + c];
	float acc = 0.0;
	for (uint y0 = 0; y0 < size; y0 += PASS) {
		uint tok[RPT];
		[[unroll]] for (uint r = 0; r < RPT; r++) tok[r] = from + min(y0 + r * SLOTS + tslot, size - 1);
		float ev[RPT];
		scoreRows(g, tok, sub, m, ev);
		[[unroll]] for (uint r = 0; r < RPT; r++) {
			if (sub == 0 && y0 + r * SLOTS + tslot < size) acc += ev[r];
		}
	}
	return acc;
}

// sampled reports whether cluster c of bin b is sampled: all of an exact
// bin's (b < j0), and those of a window's bins, r1..r2 and r3..r4, with c a
// multiple of the stride.
bool sampled(uint c, uint b, uint j0, bool windows, uint r1, uint r2, uint r3, uint r4) {
	return b < j0 || (windows && ((b >= r1 && b <= r2) || (b >= r3 && b <= r4)) && c % pc.stride == 0);
}

// countWindows adds the size of a sampled cluster of bin b to the
// windows' sampled tokens.
void countWindows(uint b, uint size, bool windows, uint r1, uint r2, uint r3, uint r4) {
	if (windows && b >= r1 && b <= r2) atomicAdd(winCount[0], size);
	if (windows && b >= r3 && b <= r4) atomicAdd(winCount[1], size);
}

// preAt returns pre[i] as a float.
float preAt(uint i) { return uintBitsToFloat(pre[i]); }

// addBin adds x to the bin sum pre[b] (compare-and-swap of its bits).
void addBin(uint b, float x) {
	uint old = pre[b];
	while (true) {
		uint seen = atomicCompSwap(pre[b], old, floatBitsToUint(uintBitsToFloat(old) + x));
		if (seen == old) break;
		old = seen;
	}
}

const float NEG = -1.0 / 0.0;

// keyOf is centroid_score's key: unkey(keyOf(x)) = x, and keys order as
// the floats do.
uint keyOf(float x) {
	uint b = floatBitsToUint(x);
	return (b & 0x80000000u) == 0 ? b | 0x80000000u : ~b;
}

// momentBatch loads the clusters i0, i0 + WG, … (BATCH of them, the last
// again past the share) of workgroup w's share of head row sb (KV head g)
// and returns each one's size zz, bin bb and exponent
// le = min(l_c + ½·σ²_c·shift − m, CAP) (MOMENTS).
void momentBatch(uint i0, uint share, uint w, uint W, uint sb, uint g, float m, float u, float shift,
		out float le[BATCH], out uint zz[BATCH], out uint bb[BATCH]) {
	float sc[BATCH], sp[BATCH];
	[[unroll]] for (uint j = 0; j < BATCH; j++) {
		uint cl = w + min(i0 + j * WG, share - 1) * W;
		sc[j] = s[sb + cl];
		zz[j] = sizes[g * pc.C + cl];
		sp[j] = spread[g * pc.C + cl];
	}
	[[unroll]] for (uint j = 0; j < BATCH; j++) {
		bb[j] = binOfScore(m, u, sc[j]);
		le[j] = min(sc[j] + 0.5 * sp[j] * shift - m, CAP);
	}
}

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
	uint w = gl_WorkGroupID.x, W = gl_NumWorkGroups.x;
	uint h = gl_WorkGroupID.y;
	uint g = h / pc.groupSize;
	uint sb = h * pc.C;
	// The first clusters' loads before anything else, in flight with the
	// extremes' and the query's.
	float sv[BATCH];
	uint zv[BATCH];
	if (MOMENTS == 0) loadBatch(tid, sb, g, sv, zv);
	for (uint i = tid; i < D / 4; i += WG) qs[i] = q[h * (D / 4) + i] * pc.scale;
	uvec2 e = ext[h];
	float m = unkey(e.x), m0 = unkey(~e.y);
	float u = 1.0;
	if (m - m0 > 0.0) {
		int ex;
		frexp(m - m0, ex);
		u = ldexp(1.0, LOG2NB - ex);
	}
	for (uint i = tid; i <= NB; i += WG) start[i] = 0;
	if (tid < 5) found[tid] = tid == 0 ? NB : NB - 1;
	if (tid < 2) winCount[tid] = 0;
	barrier();

	// With MOMENTS the bins' token counts are not needed: every bin is the
	// exact part, and each workgroup bins only its share below.
	uint slot = slotOf();
	if (MOMENTS == 0) {
		// The bins' token counts, BATCH clusters a thread with their loads in
		// flight together; this workgroup's share of the bins written.
		for (uint c0 = tid; c0 < pc.C; c0 += WG * BATCH) {
			if (c0 != tid) loadBatch(c0, sb, g, sv, zv);
			[[unroll]] for (uint i = 0; i < BATCH; i++) {
				uint cl = c0 + i * WG;
				if (cl < pc.C) {
					uint b = binOfScore(m, u, sv[i]);
					if (cl % W == w) binOf[sb + cl] = b;
					atomicAdd(start[b], zv[i]);
				}
			}
		}
		barrier();

		// Exclusive scan of the counts in place, PER bins a slot.
		uint sum = 0;
		for (uint i = 0; i < PER; i++) sum += start[slot * PER + i];
		uint run = scanU(sum);
		for (uint i = 0; i < PER; i++) {
			uint b = slot * PER + i;
			uint x = start[b];
			start[b] = run;
			run += x;
		}
		if (slot == WG - 1) start[NB] = run;
		barrier();

		// j0: the least boundary with start >= need (NB if none); the window
		// ends: the least bin j with start[j+1] >= x (NB − 1 if none). The
		// offsets ascend, so each is the one place where its test turns true.
		for (uint b = tid; b <= NB; b += WG) {
			uint x = start[b], prev = b > 0 ? start[b - 1] : 0;
			if (x >= pc.need && (b == 0 || prev < pc.need)) found[0] = b;
			if (b < NB) {
				uint next = start[b + 1];
				if (next >= pc.lo1 && (b == 0 || x < pc.lo1)) found[1] = b;
				if (next >= pc.hi1 && (b == 0 || x < pc.hi1)) found[2] = b;
				if (next >= pc.lo2 && (b == 0 || x < pc.lo2)) found[3] = b;
				if (next >= pc.hi2 && (b == 0 || x < pc.hi2)) found[4] = b;
			}
		}
		barrier();
	}
	uint j0 = MOMENTS != 0 ? NB : found[0];
	uint exact = MOMENTS != 0 ? pc.n : start[j0];
	bool windows = exact < pc.n;
	uint r1 = found[1], r2 = found[2], r3 = found[3], r4 = found[4];

	// This workgroup's share of the clusters, w, w + W, ..., a segment of
	// LIST at a time: the sampled ones listed, SEGS rounds of a cluster a
	// thread, then sampled, a team per cluster.
	uint team = tid / TEAM, tslot = (tid % TEAM) / TPR, sub = tid % TPR;
	uint share = w < pc.C ? (pc.C - w + W - 1) / W : 0;
	uint hb = h * (pc.C + pc.maxW);  // this head's lists
	uint cap = (pc.C + W - 1) / W;   // entries a workgroup's list may take
	uint mine = hb + w * cap;        // this workgroup's list
	uint listed = 0;                 // entries in it so far
	float own[PER];                  // MOMENTS: the sums of bins tid + j·WG
	[[unroll]] for (uint j = 0; j < PER; j++) own[j] = 0.0;
	if (MOMENTS != 0) {
		float shift = 0.0;
		for (uint i = 0; i < D / 4; i++) {
			vec4 x = qs[i];
			shift += dot(x * x, dw[g * (D / 4) + i]);
		}
		for (uint i = tid; i < NB; i += WG) {
			pre[i] = 0;
			start[i] = 0;
		}
		if (tid == 0) nList = 0;  // the key of the share's greatest exponent
		barrier();
		// The share's greatest exponent M, BATCH clusters a thread at once.
		float top = NEG;
		for (uint i0 = tid; i0 < share; i0 += WG * BATCH) {
			float le[BATCH];
			uint zz[BATCH], bb[BATCH];
			momentBatch(i0, share, w, W, sb, g, m, u, shift, le, zz, bb);
			[[unroll]] for (uint j = 0; j < BATCH; j++) {
				if (i0 + j * WG < share && zz[j] > 0) top = max(top, le[j]);
			}
		}
		if (SUBGROUPS != 0) top = subgroupMax(top);
		if (top > NEG && (SUBGROUPS == 0 || subgroupElect())) atomicMax(nList, keyOf(top));
		barrier();
		float big = nList == 0 ? 0.0 : unkey(nList);
		// Each estimate s_c·exp(l_c − M), at most s_c, in fixed point of 40
		// fractional bits added to its bin without rounding: the low 32 bits
		// to pre, the rest with the carry to start (integer atomics, so that
		// the sums neither wait on each other nor depend on their order).
		for (uint i0 = tid; i0 < share; i0 += WG * BATCH) {
			float le[BATCH];
			uint zz[BATCH], bb[BATCH];
			momentBatch(i0, share, w, W, sb, g, m, u, shift, le, zz, bb);
			[[unroll]] for (uint j = 0; j < BATCH; j++) {
				if (i0 + j * WG >= share) continue;
				binOf[sb + w + (i0 + j * WG) * W] = bb[j];
				if (zz[j] == 0) continue;
				float x = float(zz[j]) * exp(le[j] - big) * 256.0;
				uint hi = uint(floor(x));
				uint lo = uint((x - float(hi)) * 4294967296.0);
				if (atomicAdd(pre[bb[j]], lo) > 0xFFFFFFFFu - lo) hi++;
				if (hi != 0) atomicAdd(start[bb[j]], hi);
			}
		}
		barrier();
		float unit = exp(big);
		[[unroll]] for (uint j = 0; j < PER; j++) {
			uint i = tid + j * WG;
			own[j] = (float(start[i]) * (1.0 / 256.0) + float(pre[i]) * (1.0 / 1099511627776.0)) * unit;
			binSum[(h * W + w) * NB + i] = own[j];
		}
	}
	for (uint i0 = 0; MOMENTS == 0 && i0 < share; i0 += LIST) {
		if (tid == 0) nList = 0;
		barrier();
		[[dont_unroll]] for (uint i = i0 + tid; i < min(share, i0 + LIST); i += WG) {
			uint cl = w + i * W;
			uint b = binOfScore(m, u, s[sb + cl]);
			if (sampled(cl, b, j0, windows, r1, r2, r3, r4)) seg[atomicAdd(nList, 1)] = cl * NB + b;
		}
		barrier();
		uint count = nList;
		if (TEAM_SHUFFLE != 0) {
			// Teams go on independently; a team's threads sum by shuffles.
			for (uint i = team; i < count; i += TEAMS) {
				uint e = seg[i], size;
				float acc = sampleCluster(g, e / NB, tslot, sub, m, size);
				[[unroll]] for (uint o = TEAM / 2; o >= TPR; o >>= 1) acc += subgroupShuffleXor(acc, o);
				if (tid % TEAM == 0) {
					smp[mine + listed + i] = uvec2(e, floatBitsToUint(acc));
					countWindows(e % NB, size, windows, r1, r2, r3, r4);
				}
			}
		} else {
			// Rounds of TEAMS clusters; a team's threads meet in part.
			for (uint t0 = 0; t0 < count; t0 += TEAMS) {
				uint i = t0 + team, size = 0;
				uint e = i < count ? seg[i] : 0;
				float acc = i < count ? sampleCluster(g, e / NB, tslot, sub, m, size) : 0.0;
				part[tid].x = acc;
				barrier();
				if (i < count && tid % TEAM == 0) {
					float t = 0.0;
					for (uint j = 0; j < TEAM; j += TPR) t += part[tid + j].x;
					smp[mine + listed + i] = uvec2(e, floatBitsToUint(t));
					countWindows(e % NB, size, windows, r1, r2, r3, r4);
				}
				barrier();
			}
		}
		listed += count;
		barrier();  // the next segment rewrites the list
	}

	// This workgroup's share of the fixed tokens, (WG / TPR)·RPT rows a pass.
	uint fixedCount = pc.sinks + pc.tokens - pc.clusteredEnd;
	const uint LINES = WG / TPR;
	float facc = 0.0;
	for (uint f0 = w * LINES * RPT; f0 < fixedCount; f0 += W * LINES * RPT) {
		uint tok[RPT];
		[[unroll]] for (uint r = 0; r < RPT; r++) {
			uint f = min(f0 + r * LINES + tid / TPR, fixedCount - 1);
			tok[r] = f < pc.sinks ? f : pc.clusteredEnd + (f - pc.sinks);
		}
		float ev[RPT];
		scoreRows(g, tok, sub, m, ev);
		[[unroll]] for (uint r = 0; r < RPT; r++) {
			if (sub == 0 && f0 + r * LINES + tid / TPR < fixedCount) facc += ev[r];
		}
	}
	vec4 tot;
	scanV(vec4(facc, 0.0, 0.0, 0.0), tot);
	if (tid == 0) fsum[h * pc.maxW + w] = vec4(tot.x, uintBitsToFloat(listed), uintBitsToFloat(winCount[0]), uintBitsToFloat(winCount[1]));

	// The last of the head's workgroups to arrive fits (the only one at
	// once, without counting, where W = 1).
	if (W > 1) memoryBarrierBuffer();
	barrier();
	if (tid == 0) {
		last = W == 1 || atomicAdd(arrived[h], 1) == W - 1;
		if (last && W > 1) arrived[h] = 0;
	}
	barrier();
	if (!last) return;
	if (W > 1) memoryBarrierBuffer();

	// The listed sums per bin: R threads take each workgroup's list, after
	// its fixed sum and count; the fixed sums go to the scan below.
	for (uint i = tid; i <= NB; i += WG) pre[i] = 0;
	if (tid < 2) winCount[tid] = 0;
	barrier();
	uint R = max(1u, WG / W);
	float fixedPart = 0.0;
	for (uint r = tid / R; r < W; r += WG / R) {
		// One workgroup (W = 1) with the moment estimate wrote its own: the
		// fixed sum, no list and no window.
		vec4 f = MOMENTS != 0 && W == 1 ? vec4(tot.x, 0.0, 0.0, 0.0) : fsum[h * pc.maxW + r];
		if (tid % R == 0) {
			fixedPart += f.x;
			atomicAdd(winCount[0], floatBitsToUint(f.z));
			atomicAdd(winCount[1], floatBitsToUint(f.w));
		}
		uint count = floatBitsToUint(f.y);
		for (uint i = tid % R; MOMENTS == 0 && i < count; i += R) {
			uvec2 e = smp[hb + r * cap + i];
			addBin(e.x % NB, uintBitsToFloat(e.y));
		}
	}
	if (MOMENTS != 0 && W == 1) {
		[[unroll]] for (uint j = 0; j < PER; j++) pre[tid + j * WG] = floatBitsToUint(own[j]);
	} else if (MOMENTS != 0) {
		// Each bin's sums of the W workgroups, BATCH loads at once.
		for (uint b = tid; b < NB; b += WG) {
			float x = 0.0;
			for (uint r0 = 0; r0 < W; r0 += BATCH) {
				float v[BATCH];
				[[unroll]] for (uint j = 0; j < BATCH; j++) v[j] = binSum[(h * W + min(r0 + j, W - 1)) * NB + b];
				[[unroll]] for (uint j = 0; j < BATCH; j++) {
					if (r0 + j < W) x += v[j];
				}
			}
			pre[b] = floatBitsToUint(x);
		}
	}
	barrier();

	// One scan: the bins' exact prefix (x), the fixed partials (y) and the
	// windows' bins (z, w), PER bins a slot.
	vec4 acc = vec4(0.0);
	for (uint i = 0; i < PER; i++) {
		uint b = slot * PER + i;
		float x = preAt(b);
		acc.x += x;
		if (windows && b >= r1 && b <= r2) acc.z += x;
		if (windows && b >= r3 && b <= r4) acc.w += x;
	}
	acc.y = fixedPart;
	vec4 incl = scanV(acc, tot);
	float before = incl.x - acc.x;
	barrier();
	for (uint i = 0; i < PER; i++) {
		uint b = slot * PER + i;
		float x = preAt(b);
		pre[b] = floatBitsToUint(before);  // the exact prefix at boundary b (used up to j0)
		before += x;
	}
	barrier();
	float exactTotal = j0 >= NB ? tot.x : preAt(j0), fixedTotal = tot.y, win1 = tot.z, win2 = tot.w;
	uint u1 = start[r1], v1 = start[r2 + 1], u2 = start[r3], v2 = start[r4 + 1];
	barrier();  // every thread has read pre[j0]

	float a = 0.0, bb = 0.0;
	uint s1 = winCount[0], s2 = winCount[1];  // tokens the windows sampled
	if (windows) {
		float h1 = (harmonic(v1) - harmonic(u1)) / float(v1 - u1);
		float h2 = (harmonic(v2) - harmonic(u2)) / float(v2 - u2);
		if (h1 != h2 && s1 > 0 && s2 > 0) {
			float mu1 = win1 / float(s1), mu2 = win2 / float(s2);
			a = (mu1 - mu2) / (h1 - h2);
			bb = mu1 - a * h1;
		} else if (s1 + s2 > 0) {
			bb = (win1 + win2) / float(s1 + s2);
		}
	}

	// S at every bin boundary: the exact prefix up to j0, the curve beyond.
	for (uint j = tid; j <= NB; j += WG) {
		float x;
		if (j > j0) x = fixedTotal + exactTotal + curve(a, bb, exact + 1, start[j]);
		else if (j == NB) x = fixedTotal + exactTotal;
		else x = preAt(j) + fixedTotal;
		pre[j] = floatBitsToUint(x);
	}
	if (tid == 0) found[0] = NB;
	barrier();
	float total = j0 >= NB ? preAt(NB) : fixedTotal + exactTotal + curve(a, bb, exact + 1, pc.n);
	if (pc.p < 1.0) {
		float target = pc.p * total;
		uint least = NB;
		for (uint j = tid; j <= NB; j += WG) {
			if (preAt(j) >= target) least = min(least, j);
		}
		if (SUBGROUPS != 0) least = subgroupMin(least);
		if (least < NB && (SUBGROUPS == 0 || subgroupElect())) atomicMin(found[0], least);
	}
	barrier();
	if (tid == 0) {
		cut[h] = found[0];
		uint p = h * 16;
		plan[p + 0] = floatBitsToUint(m);
		plan[p + 1] = j0;
		plan[p + 2] = exact;
		plan[p + 3] = windows ? 1 : 0;
		plan[p + 4] = r1;
		plan[p + 5] = r2;
		plan[p + 6] = u1;
		plan[p + 7] = v1;
		plan[p + 8] = r3;
		plan[p + 9] = r4;
		plan[p + 10] = u2;
		plan[p + 11] = v2;
		plan[p + 12] = floatBitsToUint(u);
		plan[p + 13] = floatBitsToUint(fixedTotal);
		plan[p + 14] = floatBitsToUint(total);
		plan[p + 15] = W;
		ext[h] = uvec2(0);
	}
}
