package sparse

import (
	"math"

	"github.com/vksparse/vksparse/vk"
)

// ScoreBins is the number of bins by which the GPU ranks a head's
// clusters by a per-cluster score (Tactic, Quest, Double-P and the
// oracles): bin 0 holds the best scores.
const ScoreBins = 1024

// ScoreBinScale returns the best of a head's scores m and the bin factor
// u = 2^(log2 ScoreBins − e), where m − m0 = f·2^e with f in [0.5, 1) and
// m0 the worst score (u = 1 when all scores are equal): a power of two, so
// bins are exact in float32, and they span half to all of [m0, m].
func ScoreBinScale(scores []float32) (m, u float32) {
	m, m0 := float32(math.Inf(-1)), float32(math.Inf(1))
	for _, s := range scores {
		m, m0 = max(m, s), min(m0, s)
	}
	u = 1
	if r := m - m0; r > 0 {
		_, e := math.Frexp(float64(r))
		u = float32(math.Ldexp(1, 10-e)) // 10 = log2 ScoreBins
	}
	return m, u
}

// ScoreBin returns the bin of score s: min(ScoreBins−1, ⌊(m − s)·u⌋) in
// float32, with m and u from ScoreBinScale.
func ScoreBin(m, u, s float32) int {
	return min(ScoreBins-1, int(math.Floor(float64((m-s)*u))))
}

// perHeadWorkgroup is the threads per workgroup of the per-head passes
// (Tactic's selection, Double-P's cuts, the selections by bins): up to
// 1024, so that the few workgroups of a head spread their loops over many
// threads.
func perHeadWorkgroup(info vk.Info) uint32 {
	wg := uint32(1024)
	for wg > 64 && wg > info.MaxWorkgroupInvocations {
		wg /= 2
	}
	return wg
}
