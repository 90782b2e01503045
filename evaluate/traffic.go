package evaluate

import "github.com/vksparse/vksparse/kvcache"

// StepTraffic is what one decode step of a layer reads from memory at the
// least, in bytes, from the float64 selection, mean over the evaluated
// queries: every KV head's 8-bit centroids with their row and dimension
// scales once (Centroids, kvcache.CodedHeadBytes a head), the fp16 key
// rows that each query head's fit scores, fixed tokens included
// (Sampled), and the fp16 key and value rows of every KV head's union
// (Attended). Dense is what dense attention reads: every key and value
// row. Scores, cuts and partial results are left out: they are small
// beside these and stay in the GPU's cache.
type StepTraffic struct {
	Centroids float64 `json:"centroid_bytes"`
	Sampled   float64 `json:"sampled_bytes"`
	Attended  float64 `json:"attended_bytes"`
	Dense     float64 `json:"dense_bytes"`
}

// Total returns Centroids + Sampled + Attended.
func (s StepTraffic) Total() float64 { return s.Centroids + s.Sampled + s.Attended }

// Selection returns what the step reads before attention: Centroids +
// Sampled.
func (s StepTraffic) Selection() float64 { return s.Centroids + s.Sampled }

// SelectionShare returns Selection / Attended: the selection's bytes per
// byte that attention over the unions reads (0 when it reads none).
func (s StepTraffic) SelectionShare() float64 {
	if s.Attended == 0 {
		return 0
	}
	return s.Selection() / s.Attended
}

// BoundUs returns the least time of a step for a batch of b sequences like
// this one, in µs, when it reads at bw bytes per µs and each of its
// dependent dispatches costs floor µs before any work:
// dispatches·floor + b·Total/bw.
func (s StepTraffic) BoundUs(bw, floor float64, dispatches, b int) float64 {
	return float64(dispatches)*floor + float64(b)*s.Total()/bw
}

// DenseBoundUs returns the least time of dense attention over the same
// batch, one dispatch reading at the same bandwidth: floor + b·Dense/bw.
func (s StepTraffic) DenseBoundUs(bw, floor float64, b int) float64 {
	return floor + float64(b)*s.Dense/bw
}

// BoundSpeedup returns the most such a step can gain over dense attention
// of the same batch: DenseBoundUs / BoundUs.
func (s StepTraffic) BoundSpeedup(bw, floor float64, dispatches, b int) float64 {
	return s.DenseBoundUs(bw, floor, b) / s.BoundUs(bw, floor, dispatches, b)
}

// stepTraffic returns the mean traffic over the evaluated queries of
// cases[a][h] (query a, query head h), d the head dimension; moments adds
// the clusters' spreads and the head's dimension weights (float32) that
// the moment estimate reads beside the centroids.
func stepTraffic(cases [][]tacticCase, heads []kvHead, d int, moments bool) StepTraffic {
	var s StepTraffic
	if len(cases) == 0 || len(heads) == 0 {
		return s
	}
	group := len(cases[0]) / len(heads)
	row := float64(2 * d) // bytes of one fp16 row
	for _, byHead := range cases {
		for g, h := range heads {
			s.Centroids += float64(kvcache.CodedHeadBytes(h.idx.Clusters(), d))
			if moments {
				s.Centroids += float64(4 * (h.idx.Clusters() + d))
			}
			// The union is the same for every query head of the group.
			s.Attended += 2 * float64(byHead[g*group].union.Selected) * row
			s.Dense += 2 * float64(byHead[g*group].attended) * row
			for j := 0; j < group; j++ {
				s.Sampled += float64(byHead[g*group+j].sampled) * row
			}
		}
	}
	n := float64(len(cases))
	s.Centroids /= n
	s.Sampled /= n
	s.Attended /= n
	s.Dense /= n
	return s
}
