#version 450
// Split-K decode attention in one dispatch. One workgroup takes one chunk of
// tokens of one KV head for GROUP of its query heads and writes, per query
// head, the chunk's max m, sum l = sum_t exp(s_t - m) and unnormalised
// output o = sum_t exp(s_t - m) v_t, where s_t = scale q·k_t (a chunk that
// attends nothing writes m = −∞, l = 0 and no o). It walks the chunk in
// tiles of up to TILE tokens with an online softmax.
// Every workgroup then arrives at its head block's counter; the last of the
// block's chunks to arrive (all of the block's chunks, or with token lists
// those below the list's length: the others exit at once) merges them,
// writing per query head
// out = sum_c exp(m_c - M) o_c / sum_c exp(m_c - M) l_c with M = max_c m_c
// over the chunks with m_c > −∞, and resets the counter to 0. No workgroup
// waits for another.
// K and V rows are fp16, packed two per 32-bit word.
#extension GL_EXT_control_flow_attributes : enable
#extension GL_KHR_shader_subgroup_basic : enable
#extension GL_KHR_shader_subgroup_shuffle : enable
#extension GL_KHR_shader_subgroup_arithmetic : enable

layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 256;      // threads, a power of two
layout(constant_id = 1) const uint D = 128;       // head dimension, multiple of 8
layout(constant_id = 2) const uint GROUP = 4;     // query heads per workgroup, <= 8
layout(constant_id = 3) const uint TILE = 512;     // tokens per tile
// TPR threads share a K row in the score pass and sum their partial dot
// products with subgroup shuffles; the host sets TPR = 1 (no shuffles)
// unless the subgroup size is a multiple of TPR and shuffles are supported.
layout(constant_id = 4) const uint TPR = 1;
// SUBGROUP_REDUCE = 1 reduces max and sum with subgroup arithmetic (the
// host sets it only where supported); 0 uses a shared-memory tree.
layout(constant_id = 5) const uint SUBGROUP_REDUCE = 0;
// UNROLL value rows are loaded together by each thread before use.
layout(constant_id = 6) const uint UNROLL = 4;
// Shared floats for scores (at least GROUP * TILE, and at least 8 * WG
// since the final lane sums reuse them) and for reductions (at least
// GROUP * WG with the tree, GROUP * number of subgroups with subgroups).
layout(constant_id = 7) const uint SCORE_SLOTS = 4096;
layout(constant_id = 8) const uint REDUCE_SLOTS = 1024;
// GATHER = 1 attends, for KV head g, the tokens tok[g*listStride + i],
// i < tokCount[g], instead of tokens 0 .. n-1 (n is then listStride).
// GATHER = 2 attends, for KV head g, the members of the clusters some query
// head of g takes and the fixed tokens outside the clusters (see Rank).
layout(constant_id = 9) const uint GATHER = 0;
// RPT rows are scored by each thread (rows WG/TPR apart), so every q value
// read from shared memory serves RPT K words.
layout(constant_id = 10) const uint RPT = 1;
// GATHER = 2: clusters scanned at once (a power of two, at most WG).
layout(constant_id = 11) const uint WINDOW = 64;
// APPROX = 1 (with GATHER = 2, UNIT = 0) adds Double-P's pseudo-tokens
// (the Double-P paper, Eq. 8-9): a run lists each of its clusters c of KV
// head g that no head of g takes (rank[h'][c] >= cut[h'] for all) and
// that some head h of its block keeps (rank[h][c] < keep[h]) and that
// has members as one row
// of its tiles, of logit logit[h][c] for the heads that keep it (−∞ for
// the others) and value means[g][c] (fp16), beside its members' rows.
layout(constant_id = 12) const uint APPROX = 0;
// LOGITS = 1 (with GATHER = 0 or 2) also writes every logit it computes,
// scale · q_h · k_t, to rows[(seq · qHeads + h) · rowStride + t] for slot
// t (DELTA's token scores and H2O's accumulation read them instead of the
// keys; entries of slots it does not attend are left as they were), and
// with GATHER = 2 the merge writes each query head's softmax normaliser,
// norms[seq · qHeads + h] = (M, L): the max of its logits and
// Σ exp(logit − M) over every token it attended.
layout(constant_id = 13) const uint LOGITS = 0;
// UNIT > 0 (with GATHER = 2, the host sets it where every cluster c is the
// one token first + c: an index of pages of one token) takes a window's
// clusters as taken or not from their ranks alone, without sizes, starts
// or a search for a member's cluster: each of CW threads decides UNIT
// consecutive clusters of the run, so a window spans CW · UNIT clusters;
// a run then takes blocks of UNIT consecutive clusters (unitCluster).
layout(constant_id = 14) const uint UNIT = 0;

const uint DV = D / 8;  // uvec4 words per row
const uint ACC = GROUP * 2;  // vec4 of output a thread accumulates
const uint D4 = D / 4;  // vec4 per query row
// A thread's partial sums in the score pass, RPT·GROUP padded to a
// multiple of TPR, and the whole sums each of a row's threads ends with.
const uint SUMS = (RPT * GROUP + TPR - 1) / TPR * TPR;
const uint HELD = SUMS / TPR;

layout(std430, binding = 0) restrict readonly buffer Queries { vec4 q[]; };      // [B][Hq][D/4]
layout(std430, binding = 1) restrict readonly buffer Keys { uvec4 k[]; };        // [heads][headStride]
layout(std430, binding = 2) restrict readonly buffer Values { uvec4 v[]; };      // [heads][headStride]
// The partials are read back by the last workgroup of a head block:
// coherent, so that it sees the other workgroups' writes, not stale lines.
layout(std430, binding = 3) coherent buffer PartialO { float po[]; };  // [B][Hq][maxChunks][D]
layout(std430, binding = 4) coherent buffer PartialML { vec2 pml[]; }; // [B][Hq][maxChunks]
layout(std430, binding = 5) restrict readonly buffer Tokens { uint tok[]; };       // [heads][listStride], GATHER only
layout(std430, binding = 6) restrict readonly buffer TokenCounts { uint tokCount[]; }; // [heads], GATHER only
// GATHER = 2: clusters c of KV head g, taken when rank[h][c] < cut[h] for
// some query head h of g, and the fixed tokens.
layout(std430, binding = 7) restrict readonly buffer Rank { uint rank[]; };       // [Hq][C]
layout(std430, binding = 8) restrict readonly buffer Cut { uint cut[]; };         // [Hq]
layout(std430, binding = 9) restrict readonly buffer Starts { uint starts[]; };   // [heads][C] member offsets
layout(std430, binding = 10) restrict readonly buffer Sizes { uint sizes[]; };    // [heads][C]
layout(std430, binding = 11) restrict readonly buffer Members { uint members[]; }; // [heads][clustered], unused: clusters are runs of slots
// Per head block (seq, h0 / GROUP): the workgroups that have written their
// partials, and (GATHER = 2) the rows their runs attended (members of
// taken clusters and pseudo-tokens, not fixed tokens); both 0
// between dispatches (the last to arrive resets them).
layout(std430, binding = 12) coherent buffer Arrivals { uint arrivals[]; };  // [B][Hq/GROUP][2]
layout(std430, binding = 13) restrict writeonly buffer Out { vec4 o[]; };      // [B][Hq][D/4]
// APPROX = 1 only.
layout(std430, binding = 14) restrict readonly buffer Logits { float logit[]; };  // [Hq][C]
layout(std430, binding = 15) restrict readonly buffer Keep { uint keep[]; };      // [Hq]
layout(std430, binding = 16) restrict readonly buffer Means { uvec2 means[]; };   // [heads][C][D/4] fp16 quads
// GATHER = 2: the rows each head block's runs attended (as in Arrivals),
// set by the block's last workgroup (the host reads it to balance the runs).
layout(std430, binding = 17) restrict writeonly buffer Taken { uint taken[]; };  // [B][Hq/GROUP]
// LOGITS = 1 only.
layout(std430, binding = 18) restrict writeonly buffer Rows { float rows[]; };   // [B][Hq][rowStride]
layout(std430, binding = 19) restrict writeonly buffer Norms { vec2 norms[]; };  // [B][Hq], GATHER = 2

layout(push_constant) uniform Push {
	uint n;           // tokens of this sequence (GATHER: token-list stride)
	uint headStride;  // uvec4 words between consecutive KV heads in Keys/Values
	uint kvBase;      // index of the bound range's first KV head
	uint seq;         // sequence index in the batch
	uint chunk;       // tokens per chunk (GATHER: at least)
	uint maxChunks;   // chunk slots per (sequence, head) in the partial buffers
	float scale;      // multiplies q·k
	uint qHeads;      // query heads per sequence
	uint groupSize;   // query heads per KV head
	// GATHER = 2 (chunk is then clusters per chunk, n the tokens stored):
	uint C;              // clusters per KV head
	uint clusterChunks;  // chunks of clusters; chunks past them take the fixed tokens
	uint clustered;      // members per KV head
	uint first;          // the clustered tokens are [first, clusteredEnd)
	uint clusteredEnd;
	// GATHER = 2 with runTable > 0: a one-dimensional grid whose
	// workgroups are, head block after head block (runTable of them),
	// that block's runs (runs[b], a byte each of runLo for b < 4 and of
	// runHi beyond) and then its fixedChunks chunks of fixed tokens
	// (clusterChunks is then unused). With runTable = 0 the grid's y is the head block and every block has
	// clusterChunks runs.
	uint runTable;
	uint runLo, runHi;
	uint fixedChunks;
	uint rowStride;  // LOGITS: floats between query heads' rows of logits
	uint fixedTile;  // GATHER = 2: fixed tokens per chunk of them (at most TILE)
} pc;

// The runs of clusters of this workgroup's head block (GATHER = 2).
uint runs;
// The first query head of the chunk being attended (LOGITS, APPROX).
uint blockHead;
// The KV head whose means the pseudo-tokens take (APPROX).
uint meansHead;
// A listed row (lst) that is a pseudo-token: PSEUDO | its cluster.
const uint PSEUDO = 0x80000000u;

shared vec4 qs[GROUP * D4];  // the queries
shared float sc[SCORE_SLOTS];  // a tile's scores, then weights, of row t and head g at t·GROUP + g
shared float red[REDUCE_SLOTS];
// GATHER = 2 only (one slot otherwise): a tile's token ids, and a window's
// clusters' member offsets and scanned counts.
const uint LIST = (GATHER / 2) * (TILE - 1) + 1;
const uint CW = (GATHER / 2) * (WINDOW - 1) + 1;  // clusters per window
shared uint lst[LIST];
const uint UPT = UNIT == 0 ? 1 : UNIT;  // clusters a thread decides per window
const uint SPAN = CW * UPT;  // clusters per window
shared uint from[CW];
shared uint pre[CW + 1];
// Subgroup totals of scanSizes (subgroups of at least 4 threads).
shared uint subTotal[(GATHER / 2) * (WG / 4 - 1) + 1];

// combine returns op over the workgroup of x[g] for each g (op: 0 max, 1 sum).
void combine(inout float x[GROUP], uint op) {
	uint tid = gl_LocalInvocationID.x;
	if (SUBGROUP_REDUCE != 0) {
		[[unroll]] for (uint g = 0; g < GROUP; g++) x[g] = op == 0 ? subgroupMax(x[g]) : subgroupAdd(x[g]);
		if (subgroupElect()) {
			[[unroll]] for (uint g = 0; g < GROUP; g++) red[g * gl_NumSubgroups + gl_SubgroupID] = x[g];
		}
		barrier();
		[[unroll]] for (uint g = 0; g < GROUP; g++) {
			float r = red[g * gl_NumSubgroups];
			for (uint i = 1; i < gl_NumSubgroups; i++) r = op == 0 ? max(r, red[g * gl_NumSubgroups + i]) : r + red[g * gl_NumSubgroups + i];
			x[g] = r;
		}
	} else {
		[[unroll]] for (uint g = 0; g < GROUP; g++) red[g * WG + tid] = x[g];
		barrier();
		for (uint s = WG / 2; s > 0; s >>= 1) {
			if (tid < s) {
				[[unroll]] for (uint g = 0; g < GROUP; g++)
					red[g * WG + tid] = op == 0 ? max(red[g * WG + tid], red[g * WG + tid + s]) : red[g * WG + tid] + red[g * WG + tid + s];
			}
			barrier();
		}
		[[unroll]] for (uint g = 0; g < GROUP; g++) x[g] = red[g * WG];
	}
	barrier();
}

// scanSizes writes the exclusive prefix sums of the window's sizes (size
// of thread tid < CW, 0 for the others) to pre[0 .. CW], with a subgroup
// scan where SUBGROUP_REDUCE allows, a shared-memory one otherwise, and
// returns after a barrier.
void scanSizes(uint size) {
	uint tid = gl_LocalInvocationID.x;
	if (tid == 0) pre[0] = 0;
	if (SUBGROUP_REDUCE != 0) {
		uint incl = subgroupInclusiveAdd(size);
		if (gl_SubgroupInvocationID == gl_SubgroupSize - 1) subTotal[gl_SubgroupID] = incl;
		barrier();
		for (uint i = 0; i < gl_SubgroupID; i++) incl += subTotal[i];
		if (tid < CW) pre[tid + 1] = incl;
		barrier();
		return;
	}
	if (tid < CW) pre[tid + 1] = size;
	barrier();
	for (uint k = 1; k < CW; k <<= 1) {
		uint x = tid < CW && tid >= k ? pre[tid + 1 - k] : 0;
		barrier();
		if (tid < CW) pre[tid + 1] += x;
		barrier();
	}
}

// rowOf returns the first uvec4 word of row t of the tile starting at t0.
// A pseudo-token's row is the head's first (its key is not used).
uint rowOf(uint headBase, uint rowBase, uint listBase, uint t0, uint t) {
	if (GATHER == 2) return headBase + (APPROX != 0 && (lst[t] & PSEUDO) != 0 ? 0 : lst[t] * DV);
	return GATHER != 0 ? headBase + tok[listBase + t0 + t] * DV : rowBase + t * DV;
}

// valueWord returns uvec4 word dg of the value row of row t of a tile of
// rowOf (t0 and the bases as there): of V, or for a pseudo-token of its
// cluster's mean (two fp16 quads).
uvec4 valueWord(uint headBase, uint rowBase, uint listBase, uint t0, uint t, uint dg) {
	if (APPROX != 0 && GATHER == 2 && (lst[t] & PSEUDO) != 0) {
		uint at = (meansHead * pc.C + (lst[t] & ~PSEUDO)) * D4 + 2 * dg;
		return uvec4(means[at], means[at + 1]);
	}
	return v[rowOf(headBase, rowBase, listBase, t0, t) + dg];
}

// attendTile folds the len rows of a tile (rowOf's t0, with the head's
// first word headBase and, without lists, the tile's first word rowBase)
// into the running max m, sum l and output acc of this thread.
void attendTile(uint len, uint headBase, uint rowBase, uint listBase, uint t0, inout float m[GROUP], inout float l[GROUP], inout vec4 acc[ACC]) {
	uint tid = gl_LocalInvocationID.x;
	const uint STRIDE = WG / TPR;  // rows between a thread's rows
	const uint ROWS = STRIDE * RPT;  // rows scored at once
	const uint VPT = DV / TPR;   // uvec4 per thread per row
	const uint LANES = WG / DV;  // rows weighted at once
	uint sub = tid % TPR;
	uint lane = tid / DV;
	uint dg = tid % DV;

	// Scores: TPR adjacent threads read one row, uvec4 j*TPR + sub each,
	// so a load instruction covers whole 16-byte runs of rows.
	float mt[GROUP];
	[[unroll]] for (uint g = 0; g < GROUP; g++) mt[g] = m[g];
	for (uint pass = 0; pass < len; pass += ROWS) {
		float s[SUMS];  // entry r·GROUP + g, then zeros
		uvec4 w[RPT * VPT];
		[[unroll]] for (uint i = 0; i < SUMS; i++) s[i] = 0.0;
		[[unroll]] for (uint r = 0; r < RPT; r++) {
			uint t = min(pass + r * STRIDE + tid / TPR, len - 1);  // a valid row; its scores are dropped
			uint row = rowOf(headBase, rowBase, listBase, t0, t);
			[[unroll]] for (uint j = 0; j < VPT; j++) w[r * VPT + j] = k[row + j * TPR + sub];
		}
		[[unroll]] for (uint j = 0; j < VPT; j++) {
			uint u = j * TPR + sub;
			vec4 a[RPT], b[RPT];
			[[unroll]] for (uint r = 0; r < RPT; r++) {
				uvec4 x = w[r * VPT + j];
				a[r] = vec4(unpackHalf2x16(x.x), unpackHalf2x16(x.y));
				b[r] = vec4(unpackHalf2x16(x.z), unpackHalf2x16(x.w));
			}
			[[unroll]] for (uint g = 0; g < GROUP; g++) {
				vec4 qa = qs[g * D4 + 2 * u];
				vec4 qb = qs[g * D4 + 2 * u + 1];
				[[unroll]] for (uint r = 0; r < RPT; r++) s[r * GROUP + g] += dot(a[r], qa) + dot(b[r], qb);
			}
		}
		// The TPR threads of a row meet by halving exchanges: in the round
		// with partner o a thread sends the half of its partial sums it
		// gives up to the thread o away and adds the other half it gets
		// (HELD·o shuffles), so that log2(TPR) rounds, HELD·(TPR − 1)
		// shuffles in all, leave thread sub with the whole sums
		// sub·HELD .. sub·HELD + HELD − 1 (entry r·GROUP + g: row r, head g).
		if (TPR > 1) {
			[[unroll]] for (uint o = TPR / 2; o > 0; o >>= 1) {
				bool upper = (sub & o) != 0;
				[[unroll]] for (uint i = 0; i < HELD * o; i++) {
					float give = upper ? s[i] : s[i + HELD * o];
					float keep = upper ? s[i + HELD * o] : s[i];
					s[i] = keep + subgroupShuffleXor(give, o);
				}
			}
		}
		[[unroll]] for (uint i = 0; i < HELD; i++) {
			uint e = sub * HELD + i;
			uint r = e / GROUP, g = e % GROUP;
			uint t = pass + r * STRIDE + tid / TPR;
			if (e < RPT * GROUP && t < len) {
				// A pseudo-token's score is in place already (its listing).
				float sv = s[i];
				if (APPROX != 0 && GATHER == 2 && (lst[t] & PSEUDO) != 0) sv = sc[t * GROUP + g];
				else sc[t * GROUP + g] = sv;
				if (LOGITS != 0) rows[(pc.seq * pc.qHeads + blockHead + g) * pc.rowStride + (GATHER == 2 ? lst[t] : t0 + t)] = sv;
				[[unroll]] for (uint x = 0; x < GROUP; x++) {
					if (x == g) mt[x] = max(mt[x], sv);
				}
			}
		}
	}
	combine(mt, 0);  // the new running max

	// Rescale what came before to the new max; weights p = exp(s - m).
	// Each thread sums the weights it computes; the sums are combined
	// once, after the last tile.
	// With pseudo-tokens a head may have seen only −∞ (rows it does not
	// keep): its max stays −∞ and its weights 0.
	const float NEG = -1.0 / 0.0;
	[[unroll]] for (uint g = 0; g < GROUP; g++) {
		float r = APPROX != 0 && mt[g] == NEG ? 1.0 : exp(m[g] - mt[g]);  // 0 on the first tile
		l[g] *= r;
		acc[2 * g] *= r;
		acc[2 * g + 1] *= r;
		m[g] = mt[g];
	}
	for (uint t = tid; t < len; t += WG) {
		[[unroll]] for (uint g = 0; g < GROUP; g++) {
			float p = APPROX != 0 && m[g] == NEG ? 0.0 : exp(sc[t * GROUP + g] - m[g]);
			sc[t * GROUP + g] = p;
			l[g] += p;
		}
	}
	barrier();  // every weight is written

	// Weighted values: lane takes rows lane, lane+LANES, ...; dg is its
	// eight dimensions, so DV adjacent threads read a whole row.
	if (lane < LANES) {
		uint t = lane;
		for (; t + (UNROLL - 1) * LANES < len; t += UNROLL * LANES) {
			uvec4 w[UNROLL];
			[[unroll]] for (uint r = 0; r < UNROLL; r++) w[r] = valueWord(headBase, rowBase, listBase, t0, t + r * LANES, dg);
			[[unroll]] for (uint r = 0; r < UNROLL; r++) {
				vec4 a = vec4(unpackHalf2x16(w[r].x), unpackHalf2x16(w[r].y));
				vec4 b = vec4(unpackHalf2x16(w[r].z), unpackHalf2x16(w[r].w));
				[[unroll]] for (uint g = 0; g < GROUP; g++) {
					float p = sc[(t + r * LANES) * GROUP + g];
					acc[2 * g] += p * a;
					acc[2 * g + 1] += p * b;
				}
			}
		}
		for (; t < len; t += LANES) {
			uvec4 w = valueWord(headBase, rowBase, listBase, t0, t, dg);
			vec4 a = vec4(unpackHalf2x16(w.x), unpackHalf2x16(w.y));
			vec4 b = vec4(unpackHalf2x16(w.z), unpackHalf2x16(w.w));
			[[unroll]] for (uint g = 0; g < GROUP; g++) {
				float p = sc[t * GROUP + g];
				acc[2 * g] += p * a;
				acc[2 * g + 1] += p * b;
			}
		}
	}
	barrier();  // the next tile overwrites the scores
}

// takenByGroup reports whether some query head of KV head g takes cluster
// cl (GATHER = 2).
bool takenByGroup(uint g, uint cl) {
	uint take = 0;
	for (uint h = g * pc.groupSize; h < (g + 1) * pc.groupSize; h++) take |= uint(rank[h * pc.C + cl] < cut[h]);
	return take != 0;
}

// clusterRows returns the rows cluster cl of KV head g adds to the run of
// query heads h0 .. h0 + GROUP − 1 (GATHER = 2, UNIT = 0): its members
// where some head of g takes it, its first slot in fromv; else, with
// APPROX, one pseudo-token (fromv = PSEUDO | cl) where some head of the
// block keeps it and it has members, of score ps[j] for head h0 + j: logit[h][cl] where h
// keeps it, −∞ otherwise; else none.
uint clusterRows(uint g, uint cl, uint h0, out uint fromv, out float ps[GROUP]) {
	fromv = pc.first + starts[g * pc.C + cl];
	[[unroll]] for (uint j = 0; j < GROUP; j++) ps[j] = -1.0 / 0.0;
	if (APPROX == 0) return takenByGroup(g, cl) ? sizes[g * pc.C + cl] : 0;
	uint size = sizes[g * pc.C + cl];
	bool any = false;
	[[unroll]] for (uint j = 0; j < GROUP; j++) {
		uint h = h0 + j;
		float lg = logit[h * pc.C + cl];
		bool kept = rank[h * pc.C + cl] < keep[h];
		if (kept) ps[j] = lg;
		any = any || kept;
	}
	if (takenByGroup(g, cl)) return size;
	if (!any || size == 0) return 0;
	fromv = PSEUDO | cl;
	return 1;
}

// unitCluster returns (UNIT > 0) the i-th cluster of run c: the runs
// take blocks of UNIT consecutive clusters, stride blocks apart, so that
// a thread's UNIT ranks of a head lie side by side in memory.
uint unitCluster(uint c, uint stride, uint i) {
	return (c + i / UNIT * stride) * UNIT + i % UNIT;
}

// takenUnits returns (UNIT > 0) the clusters of the window at w0 of run c
// (stride runs apart, end of them) that this thread decides and some query
// head of KV head g takes: bit u for run cluster w0 + tid·UNIT + u
// (unitCluster), below end and C. The ranks of up to 8 of g's heads are
// loaded before any is compared, so that a group of at most 8 heads waits
// for one round trip.
uint takenUnits(uint g, uint c, uint stride, uint w0, uint end) {
	uint tid = gl_LocalInvocationID.x;
	uint i0 = w0 + tid * UNIT;
	uint cl0 = unitCluster(c, stride, i0);
	uint hEnd = (g + 1) * pc.groupSize;
	uint mask = 0;
	if (tid >= CW) return 0;
	for (uint hb = g * pc.groupSize; hb < hEnd; hb += 8) {
		uint ct[8];
		uint r[8 * UPT];
		[[unroll]] for (uint j = 0; j < 8; j++) {
			ct[j] = 0;  // a head past the group takes nothing
			if (hb + j < hEnd) ct[j] = cut[hb + j];
			[[unroll]] for (uint u = 0; u < UNIT; u++) {
				r[j * UNIT + u] = 0;
				if (hb + j < hEnd && i0 + u < end && cl0 + u < pc.C) r[j * UNIT + u] = rank[(hb + j) * pc.C + cl0 + u];
			}
		}
		[[unroll]] for (uint j = 0; j < 8; j++) {
			[[unroll]] for (uint u = 0; u < UNIT; u++) mask |= uint(r[j * UNIT + u] < ct[j]) << u;
		}
	}
	uint valid = i0 < end && cl0 < pc.C ? (1u << min(min(end - i0, pc.C - cl0), UNIT)) - 1u : 0u;
	return mask & valid;
}

// attendChunk writes the partials of chunk c (of chunk tokens, or clusters
// with GATHER = 2, out of n) of query heads h0 .. h0 + GROUP − 1 (of KV
// head kvBase + kvLocal): m, l and o per head, or m = −∞ and l = 0 (o
// unwritten) where the chunk attends no token. It returns the members of
// taken clusters and the pseudo-tokens it attended (0
// but for runs of clusters).
uint attendChunk(uint c, uint h0, uint kvLocal, uint n, uint chunk) {
	uint tid = gl_LocalInvocationID.x;
	uint base = (pc.seq * pc.qHeads + h0) * pc.maxChunks + c;
	uint listBase = (pc.kvBase + kvLocal) * pc.n;
	uint chunkStart = c * chunk;
	uint chunkEnd = min(chunkStart + chunk, n);  // GATHER < 2: chunkStart < chunkEnd (main)

	// GATHER = 2: the first window's cluster (taken or not, its size and
	// its first slot) loaded with the queries, in flight together.
	uint g = pc.kvBase + kvLocal;
	uint stride = runs;
	uint cEnd = GATHER == 2 && c < runs ? (pc.C - c + stride - 1) / stride : 0;  // clusters of this run
	if (UNIT != 0) {
		// Blocks c, c + stride, ... of UNIT clusters (unitCluster).
		uint blocks = (pc.C + UNIT - 1) / UNIT;
		cEnd = GATHER == 2 && c < runs && c < blocks ? (blocks - c + stride - 1) / stride * UNIT : 0;
	}
	uint size0 = 0, from0 = 0;  // UNIT: size0 is takenUnits' mask
	float ps0[GROUP];  // APPROX: a pseudo-token's scores (clusterRows)
	if (UNIT != 0) {
		size0 = takenUnits(g, c, stride, 0, cEnd);
	} else if (tid < CW && tid < cEnd) {
		size0 = clusterRows(g, c + tid * stride, h0, from0, ps0);
	}
	for (uint i = tid; i < GROUP * D4; i += WG) {
		qs[i] = q[(pc.seq * pc.qHeads + h0) * D4 + i] * pc.scale;
	}
	barrier();

	const uint STRIDE = WG / TPR;  // rows between a thread's rows
	const uint ROWS = STRIDE * RPT;  // rows scored at once
	const uint VPT = DV / TPR;   // uvec4 per thread per row
	const uint LANES = WG / DV;  // rows weighted at once
	uint sub = tid % TPR;
	uint lane = tid / DV;
	uint dg = tid % DV;
	float m[GROUP];  // running max
	float l[GROUP];  // running sum of exp(s - m)
	vec4 acc[ACC];  // running output of this thread's eight dimensions
	[[unroll]] for (uint g = 0; g < GROUP; g++) {
		m[g] = -1.0 / 0.0;
		l[g] = 0.0;
		acc[2 * g] = vec4(0.0);
		acc[2 * g + 1] = vec4(0.0);
	}

	uint headBase = kvLocal * pc.headStride;
	blockHead = h0;
	meansHead = g;
	uint attended = 1;  // GATHER = 2: the members attended (every chunk attends some tokens otherwise)
	if (GATHER != 2) {
		for (uint t0 = chunkStart; t0 < chunkEnd; t0 += TILE) {
			attendTile(min(TILE, chunkEnd - t0), headBase, headBase + t0 * DV, listBase, t0, m, l, acc);
		}
	} else if (c < runs) {
		// Clusters c, c + R, c + 2R, ... of KV head g (R = runs
		// runs), SPAN at a time: the taken ones' member counts are scanned,
		// and their members' token ids appended to lst; each full tile is
		// attended, so that tiles stay full however few clusters a window
		// takes. Striding spreads the clusters a region of the context
		// holds, and so the tokens taken, over the runs.
		// With UNIT every cluster is one token: a thread lists its taken
		// clusters in order after the window's earlier threads' (pre[tid]).
		attended = 0;
		uint fill = 0;  // token ids in lst not yet attended
		for (uint w0 = 0; w0 < cEnd; w0 += SPAN) {
			uint cl = c + (w0 + tid) * stride;
			uint size = 0;
			uint mask = 0;  // UNIT: this thread's taken clusters (takenUnits)
			float ps[GROUP];  // APPROX: its cluster's pseudo-token's scores
			bool pseudo = false;  // whether its cluster is one
			if (UNIT != 0) {
				mask = w0 == 0 ? size0 : takenUnits(g, c, stride, w0, cEnd);
				size = uint(bitCount(mask));
			} else if (tid < CW && w0 + tid < cEnd) {
				// Clusters are runs of slots (kvcache Layer.Reorder).
				uint fv = from0;
				if (w0 == 0) {
					size = size0;
					if (APPROX != 0) [[unroll]] for (uint j = 0; j < GROUP; j++) ps[j] = ps0[j];
				} else {
					size = clusterRows(g, cl, h0, fv, ps);
				}
				from[tid] = fv;
				pseudo = APPROX != 0 && (fv & PSEUDO) != 0;
			}
			scanSizes(size);
			uint total = pre[CW];
			attended += total;
			bool last = w0 + SPAN >= cEnd;
			uint at = UNIT != 0 || APPROX != 0 ? pre[min(tid, CW)] : 0;  // UNIT, APPROX: this thread's first row in the window
			// One call of attendTile in the loop: a full tile, or what
			// remains after the last window.
			uint s0 = 0;
			do {
				uint len = min(TILE - fill, total - s0);
				if (UNIT != 0) {
					// Member j of the window (of its members [s0, s0 + len) that fit the tile) to lst[fill + j − s0].
					uint j = at;
					[[unroll]] for (uint u = 0; u < UNIT; u++) {
						if (((mask >> u) & 1u) != 0) {
							if (j >= s0 && j < s0 + len) lst[fill + j - s0] = pc.first + unitCluster(c, stride, w0 + tid * UNIT) + u;
							j++;
						}
					}
				} else for (uint y = tid; y < len; y += WG) {
					// The cluster j whose members hold s0 + y: pre[j] <= s0 + y < pre[j + 1].
					uint lo = 0, hi = CW - 1;
					while (lo < hi) {
						uint mid = (lo + hi + 1) / 2;
						if (pre[mid] <= s0 + y) lo = mid; else hi = mid - 1;
					}
					lst[fill + y] = from[lo] + s0 + y - pre[lo];
				}
				if (APPROX != 0 && pseudo && at >= s0 && at < s0 + len) {
					[[unroll]] for (uint j = 0; j < GROUP; j++) sc[(fill + at - s0) * GROUP + j] = ps[j];
				}
				fill += len;
				s0 += len;
				if (fill == TILE || (last && s0 == total && fill > 0)) {
					barrier();
					attendTile(fill, headBase, 0, 0, 0, m, l, acc);
					fill = 0;
				}
			} while (s0 < total);
			barrier();  // the next window rewrites pre and from
		}
	} else {
		// The fixed tokens [0, first) and [clusteredEnd, n), fixedTile a chunk.
		uint f0 = (c - runs) * pc.fixedTile;
		uint fixedCount = pc.first + pc.n - pc.clusteredEnd;
		attended = f0 < fixedCount ? 1 : 0;
		if (f0 < fixedCount) {
			uint len = min(pc.fixedTile, fixedCount - f0);
			for (uint y = tid; y < len; y += WG) {
				uint i = f0 + y;
				lst[y] = i < pc.first ? i : pc.clusteredEnd + (i - pc.first);
			}
			barrier();
			attendTile(len, headBase, 0, 0, 0, m, l, acc);
		}
	}

	if (attended == 0) {
		// Nothing taken in this chunk: m = −∞ tells the merge to skip it,
		// so its output is not written.
		if (tid < GROUP) pml[base + tid * pc.maxChunks] = vec2(-1.0 / 0.0, 0.0);
		return 0;
	}
	combine(l, 1);  // its last barrier: no thread reads the queries in qs again

	// Sum the lanes, one head at a time: the score slots, no longer needed,
	// hold the eight dimensions of every thread.
	[[unroll]] for (uint g = 0; g < GROUP; g++) {
		[[unroll]] for (uint j = 0; j < 8; j++) sc[j * WG + tid] = lane < LANES ? acc[2 * g + j / 4][j % 4] : 0.0;
		barrier();
		for (uint i = tid; i < D; i += WG) {
			uint j = i / DV;
			uint d = i % DV;
			float sum = 0.0;
			for (uint ln = 0; ln < LANES; ln++) sum += sc[j * WG + ln * DV + d];
			uint e = d * 8 + j;
			po[(base + g * pc.maxChunks) * D + e] = sum;
		}
		barrier();
	}
	if (tid < GROUP) pml[base + tid * pc.maxChunks] = vec2(m[tid], l[tid]);
	return GATHER == 2 && c < runs ? attended : 0;
}

// mergeChunks writes the output of query heads h0 .. h0 + GROUP − 1 of
// sequence pc.seq from the partials of chunks 0 .. nc − 1:
// out = sum_c exp(m_c - M) o_c / sum_c exp(m_c - M) l_c, M = max_c m_c,
// where chunks with m_c = −∞ add nothing (their o_c, maybe unwritten, is
// loaded but not used). Threads are (chunk lane, vec4 of the head block's
// output): each of MCL lanes folds every MCL-th chunk, MU at a time
// with their (m, l) and o loads in flight together, into a running max,
// sum and output (an online softmax over chunks); then the lanes' results
// are combined the same way.
void mergeChunks(uint h0, uint nc) {
	uint tid = gl_LocalInvocationID.x;
	uint base = (pc.seq * pc.qHeads + h0) * pc.maxChunks;  // head h0 + g is g·maxChunks further
	const uint ITEMS = GROUP * D4;              // vec4 of the head block's output
	const uint STEP = ITEMS < WG ? ITEMS : WG;  // of them summed at once
	const uint MCL = WG / STEP;                 // chunk lanes
	const float NEG = -1.0 / 0.0;
	const uint MU = 8;  // chunks whose loads a lane has in flight
	uint lane = tid / STEP;
	for (uint i0 = 0; i0 < ITEMS; i0 += STEP) {
		uint item = i0 + tid % STEP;
		float mr = NEG;  // running max, sum and output of this lane
		float lr = 0.0;
		vec4 acc = vec4(0.0);
		if (lane < MCL && item < ITEMS) {
			uint hb = base + (item / D4) * pc.maxChunks;
			uint j = item % D4;
			for (uint c = lane; c < nc; c += MU * MCL) {
				vec2 ml[MU];
				vec4 om[MU];
				[[unroll]] for (uint r = 0; r < MU; r++) {
					uint cr = min(c + r * MCL, nc - 1);  // a valid chunk; dropped below when past nc
					uint at = ((hb + cr) * D4 + j) * 4;
					ml[r] = pml[hb + cr];
					om[r] = vec4(po[at], po[at + 1], po[at + 2], po[at + 3]);
				}
				float mb = mr;
				[[unroll]] for (uint r = 0; r < MU; r++) {
					if (c + r * MCL >= nc) ml[r].x = NEG;
					mb = max(mb, ml[r].x);
				}
				if (mb != NEG) {
					float s = exp(mr - mb);  // 0 while nothing was folded
					lr *= s;
					acc *= s;
					[[unroll]] for (uint r = 0; r < MU; r++) {
						if (ml[r].x != NEG) {
							float w = exp(ml[r].x - mb);
							lr += w * ml[r].y;
							acc += w * om[r];
						}
					}
					mr = mb;
				}
			}
		}
		// The lanes meet in the score slots (at least 8 · WG floats, no
		// longer needed): six floats a thread.
		sc[6 * tid] = mr;
		sc[6 * tid + 1] = lr;
		[[unroll]] for (uint k = 0; k < 4; k++) sc[6 * tid + 2 + k] = acc[k];
		barrier();
		if (tid < STEP && item < ITEMS) {
			float M = NEG;
			for (uint ln = 0; ln < MCL; ln++) M = max(M, sc[6 * (ln * STEP + tid)]);
			float L = 0.0;
			vec4 sum = vec4(0.0);
			for (uint ln = 0; ln < MCL; ln++) {
				uint at = 6 * (ln * STEP + tid);
				if (sc[at] != NEG) {
					float w = exp(sc[at] - M);
					L += w * sc[at + 1];
					sum += w * vec4(sc[at + 2], sc[at + 3], sc[at + 4], sc[at + 5]);
				}
			}
			o[(pc.seq * pc.qHeads + h0) * D4 + item] = sum / L;
			if (LOGITS != 0 && GATHER == 2 && item % D4 == 0) norms[pc.seq * pc.qHeads + h0 + item / D4] = vec2(M, L);
		}
		barrier();
	}
}

void main() {
	uint tid = gl_LocalInvocationID.x;
	uint headBlocks = pc.groupSize / GROUP;
	// This workgroup's head block and chunk, and the block's chunks.
	uint block = gl_WorkGroupID.y, x = gl_WorkGroupID.x;
	uint blockChunks = gl_NumWorkGroups.x;
	runs = pc.clusterChunks;
	if (GATHER == 2 && pc.runTable > 0) {
		block = 0;
		for (uint b = 0; b < pc.runTable; b++) {
			uint r = ((b < 4 ? pc.runLo : pc.runHi) >> (8 * (b % 4))) & 0xffu;
			if (x < r + pc.fixedChunks) {
				block = b;
				runs = r;
				blockChunks = r + pc.fixedChunks;
				break;
			}
			x -= r + pc.fixedChunks;
		}
	}
	uint kvLocal = block / headBlocks;
	uint h0 = (pc.kvBase + kvLocal) * pc.groupSize + (block % headBlocks) * GROUP;
	uint n = GATHER == 1 ? tokCount[pc.kvBase + kvLocal] : pc.n;
	// GATHER = 1: chunks of at least pc.chunk tokens, sized on the device
	// from the lists' total length so that all lists together take about
	// maxChunks chunks (and no list more).
	uint chunk = pc.chunk;
	if (GATHER == 1) {
		uint total = 0;
		for (uint g = 0; g < pc.qHeads / pc.groupSize; g++) total += tokCount[g];
		chunk = max(pc.chunk, (total + pc.maxChunks - 1) / pc.maxChunks);
	}
	// The chunks that attend, arrive and are merged: with token lists those
	// below the list's length (every workgroup computes the same count from
	// tokCount; the others exit at once: they would only add empty
	// partials, and on an H100 holding their slots for the arrival cost
	// more than the separate merge kernel saved), every chunk otherwise.
	uint used = GATHER == 1 ? min((n + chunk - 1) / chunk, blockChunks) : blockChunks;
	if (x >= used) return;
	uint members = attendChunk(x, h0, kvLocal, n, chunk);

	// Arrive: the partials written (and made visible device-wide) before
	// one thread counts this workgroup in. Only the last of the head
	// block's chunks goes on; none waits for another.
	uint counter = pc.seq * (pc.qHeads / GROUP) + h0 / GROUP;
	if (GATHER == 2 && tid == 0 && members > 0) atomicAdd(arrivals[2 * counter + 1], members);
	memoryBarrierBuffer();
	barrier();
	// Whether it was the last goes through red[0], free now (the merge does
	// not use red): no shared memory beyond the attention's.
	if (tid == 0) red[0] = atomicAdd(arrivals[2 * counter], 1) == used - 1 ? 1.0 : 0.0;
	barrier();
	if (red[0] == 0.0) return;
	memoryBarrierBuffer();
	uint attended = GATHER == 2 && tid == 0 ? arrivals[2 * counter + 1] : 0;  // loaded before the merge, used after
	mergeChunks(h0, used);
	if (tid == 0) {
		if (GATHER == 2) {
			taken[counter] = attended;
			arrivals[2 * counter + 1] = 0;
		}
		arrivals[2 * counter] = 0;  // for the next dispatch
	}
}
