#version 450
// LuKA's clustered attention, second stage: which summaries query head
// h = gl_WorkGroupID.x refines, and the raw tokens' cover masses.
//
// With log Z_h = m + log z from mz[h] and the cover logits row[h] that the
// first stage wrote (summaries at nodes [0, S), raw tokens after):
//   - pc.rule 0 refines the pc.K summaries of greatest logit, ties to the
//     lower node (every summary when pc.K ≥ S), by an exact radix select
//     over the logits' order-preserving bits, 8 bits a pass;
//   - pc.rule 1 refines those of cover mass exp(row − log Z) above ε, that
//     is of logit above log Z + pc.logEps (float32).
// It writes the refine mask (bit j of mask[h]), the refined summaries in
// ascending order, list[h][0 .. count[h]) (at most pc.maxList; count[h]
// is capped there), and, when pc.accumulate is set, adds every raw token's
// cover mass exp(row − log Z) to ring[h][slot & pc.ringMask], the weights
// of the attention-weighted compressor.
#extension GL_EXT_control_flow_attributes : enable

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 256;     // threads, a power of two, at least 256
layout(constant_id = 1) const uint HELD = 8192;  // logits held in shared memory (more are read from row)

layout(std430, binding = 0) readonly buffer Rows { float row[]; };      // [Hq][R]
layout(std430, binding = 1) readonly buffer MZ { vec2 mz[]; };          // [Hq]
layout(std430, binding = 2) buffer Ring { float ring[]; };              // [Hq][ringMask + 1]
layout(std430, binding = 3) writeonly buffer Mask { uint mask[]; };     // [Hq][maskWords]
layout(std430, binding = 4) writeonly buffer List { uint list[]; };     // [Hq][maxList]
layout(std430, binding = 5) writeonly buffer Count { uint count[]; };   // [Hq]

layout(push_constant) uniform Push {
	uint S;          // summaries
	uint nodes;      // S + raw tokens
	uint tail;       // slot of the first raw token
	uint R;          // row stride per query head
	uint rule;       // 0: top K; 1: mass above exp(logEps)
	uint K;          // rule 0's count
	float logEps;    // rule 1's log threshold
	uint ringMask;   // ring slots − 1 (a power of two less one)
	uint accumulate; // 1: add the raw tokens' masses to the ring
	uint maskWords;  // words per query head of the mask
	uint maxList;    // list stride per query head
} pc;

const uint COPIES = 8;  // histograms, so that threads counting one bin collide less
shared uint keys[HELD];
shared uint hist[COPIES * 256];
shared uint bins[256];       // a pass's counts per bin
shared uint binGroups[16];   // their sums, 16 bins a group
shared uint groupSums[WG / 16];  // exclusiveSum's, 16 threads a group
shared uint sums[WG];
shared uint digit, remaining;

// ordered maps a float to a uint of the same order.
uint ordered(float f) {
	uint b = floatBitsToUint(f);
	return (b & 0x80000000u) != 0u ? ~b : b | 0x80000000u;
}

uint key(uint h, uint j) { return pc.S <= HELD ? keys[j] : ordered(row[h * pc.R + j]); }

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
	uint h = gl_WorkGroupID.x;
	vec2 mzh = mz[h];
	float logZ = mzh.x + log(mzh.y);
	if (pc.accumulate != 0) {
		for (uint j = pc.S + tid; j < pc.nodes; j += WG) {
			uint slot = pc.tail + j - pc.S;
			ring[h * (pc.ringMask + 1) + (slot & pc.ringMask)] += exp(row[h * pc.R + j] - logZ);
		}
	}
	if (pc.S <= HELD) {
		// All loads in flight at once, then the stores.
		float v[(HELD + WG - 1) / WG];
		[[unroll]] for (uint k = 0; k < (HELD + WG - 1) / WG; k++) {
			uint j = tid + k * WG;
			v[k] = j < pc.S ? row[h * pc.R + j] : 0.0;
		}
		[[unroll]] for (uint k = 0; k < (HELD + WG - 1) / WG; k++) {
			uint j = tid + k * WG;
			if (j < pc.S) keys[j] = ordered(v[k]);
		}
	}
	barrier();

	// Refined: key > t, and the first `ties` nodes of key == t.
	bool all = pc.rule == 0 && pc.K >= pc.S;
	uint t = 0xffffffffu, ties = 0;
	if (pc.rule == 1) {
		t = ordered(logZ + pc.logEps);
	} else if (!all && pc.K > 0) {
		uint prefix = 0, fixedMask = 0;
		if (tid == 0) remaining = pc.K;
		// Each pass counts the next 8 bits of the candidates (thread t into
		// histogram t mod COPIES), sums the histograms, scans them from the
		// top and takes the bin where the count from the top reaches the
		// keys still wanted.
		for (int shift = 24; shift >= 0; shift -= 8) {
			for (uint b = tid; b < COPIES * 256; b += WG) hist[b] = 0;
			barrier();
			uint copy = (tid % COPIES) * 256;
			for (uint j = tid; j < pc.S; j += WG) {
				uint o = key(h, j);
				if ((o & fixedMask) == prefix) atomicAdd(hist[copy + ((o >> uint(shift)) & 255u)], 1);
			}
			barrier();
			if (tid < 256) {
				uint c = 0;
				for (uint k = 0; k < COPIES; k++) c += hist[k * 256 + tid];
				bins[tid] = c;
			}
			uint w = remaining;
			barrier();
			if (tid < 16) {
				uint c = 0;
				for (uint i = 0; i < 16; i++) c += bins[tid * 16 + i];
				binGroups[tid] = c;
			}
			barrier();
			// The bin where the count from the top first reaches w.
			if (tid < 256) {
				uint incl = 0;  // bins tid .. 255
				for (uint i = tid; i < (tid / 16 + 1) * 16; i++) incl += bins[i];
				for (uint g = tid / 16 + 1; g < 16; g++) incl += binGroups[g];
				uint above = incl - bins[tid];
				if (incl >= w && above < w) {
					digit = tid;
					remaining = w - above;
				}
			}
			barrier();
			prefix |= digit << uint(shift);
			fixedMask |= 255u << uint(shift);
			barrier();
		}
		t = prefix;  // the K-th greatest key
		ties = remaining;
		barrier();
	}

	// Each thread owns whole mask words: nodes [w0·32, w1·32).
	uint per = (pc.maskWords + WG - 1) / WG;
	uint w0 = min(tid * per, pc.maskWords), w1 = min(w0 + per, pc.maskWords);
	uint mineTies = 0;
	if (ties > 0) {
		for (uint j = w0 * 32; j < min(w1 * 32, pc.S); j++) mineTies += uint(key(h, j) == t);
	}
	uint total;
	uint tiesStart = exclusiveSum(mineTies, total);
	// Twice the same decisions: the mask and the count, then the list.
	uint seen = tiesStart, taken = 0;
	for (uint w = w0; w < w1; w++) {
		uint bits = 0;
		for (uint u = 0; u < 32; u++) {
			uint j = w * 32 + u;
			if (j >= pc.S) break;
			uint o = key(h, j);
			bool take = all || o > t;
			if (ties > 0 && o == t) take = seen++ < ties;
			if (take) {
				bits |= 1u << u;
				taken++;
			}
		}
		mask[h * pc.maskWords + w] = bits;
	}
	uint at = exclusiveSum(taken, total);
	seen = tiesStart;
	for (uint j = w0 * 32; j < min(w1 * 32, pc.S) && at < pc.maxList; j++) {
		uint o = key(h, j);
		bool take = all || o > t;
		if (ties > 0 && o == t) take = seen++ < ties;
		if (take) list[h * pc.maxList + at++] = j;
	}
	if (tid == 0) count[h] = min(total, pc.maxList);
}
