package sparse

import "fmt"

// ClusterIndex is a partition of a set of tokens into clusters, each with a
// centroid.
type ClusterIndex struct {
	// D is the head dimension.
	D int
	// Centroids holds one centroid per cluster, C×D row-major.
	Centroids []float64
	// Sizes[c] = len(Members[c]); a cluster may be empty.
	Sizes []int
	// Members[c] lists the token ids of cluster c in ascending order.
	Members [][]int32
	// Spreads and DimWeights describe how the keys spread about their
	// cluster's mean (SetSpreadsRef; nil until then): Spreads[c] = σ²_c,
	// the mean squared deviation of cluster c's keys from their mean per
	// dimension, and DimWeights[i] = w_i, dimension i's pooled deviation
	// over that of the mean dimension. Tactic's moment estimate
	// (TacticFit.Moments) reads them.
	Spreads    []float64
	DimWeights []float64
}

// SetSpreadsRef sets Spreads and DimWeights from keys (rows of D values
// holding every member): with μ_c the mean of cluster c's member keys,
// n_c its size and N = Σ n_c,
//
//	σ²_c = (1/(n_c·D)) Σ_{t∈c} ‖k_t − μ_c‖²   (0 for an empty cluster)
//	v_i  = (1/N) Σ_c Σ_{t∈c} (k_ti − μ_ci)²,  v̄ = (1/D) Σ_i v_i
//	w_i  = v_i / v̄                            (1 where v̄ = 0)
//
// all in float64.
func (x *ClusterIndex) SetSpreadsRef(keys []float64) error {
	d := x.D
	if d <= 0 || len(keys)%d != 0 {
		return fmt.Errorf("sparse: SetSpreadsRef: %d key values are not rows of %d", len(keys), d)
	}
	rows := int32(len(keys) / d)
	spreads := make([]float64, len(x.Sizes))
	pooled := make([]float64, d)
	mean := make([]float64, d)
	n := 0
	for c, mem := range x.Members {
		if len(mem) == 0 {
			continue
		}
		clear(mean)
		for _, t := range mem {
			if t < 0 || t >= rows {
				return fmt.Errorf("sparse: SetSpreadsRef: cluster %d member %d outside the %d key rows", c, t, rows)
			}
			for i, v := range keys[int(t)*d : int(t+1)*d] {
				mean[i] += v
			}
		}
		for i := range mean {
			mean[i] /= float64(len(mem))
		}
		for _, t := range mem {
			for i, v := range keys[int(t)*d : int(t+1)*d] {
				dv := (v - mean[i]) * (v - mean[i])
				spreads[c] += dv
				pooled[i] += dv
			}
		}
		spreads[c] /= float64(len(mem) * d)
		n += len(mem)
	}
	total := 0.0
	for i := range pooled {
		if n > 0 {
			pooled[i] /= float64(n)
		}
		total += pooled[i]
	}
	for i := range pooled {
		if total > 0 {
			pooled[i] /= total / float64(d)
		} else {
			pooled[i] = 1
		}
	}
	x.Spreads, x.DimWeights = spreads, pooled
	return nil
}

// Clusters returns the number of clusters C.
func (x *ClusterIndex) Clusters() int { return len(x.Sizes) }

// Tokens returns the number of clustered tokens, Σ Sizes.
func (x *ClusterIndex) Tokens() int {
	n := 0
	for _, s := range x.Sizes {
		n += s
	}
	return n
}

// NewClusterIndex builds the index of assignments assign (as returned by
// KMeansRef) over rows that stand for tokens first, first+1, …: row r is
// token first+r and belongs to cluster assign[r]. centroids is C×d; C is
// len(centroids)/d and every assignment must lie in [0, C).
func NewClusterIndex(centroids []float64, d int, assign []int32, first int32) (*ClusterIndex, error) {
	if d <= 0 || len(centroids) == 0 || len(centroids)%d != 0 {
		return nil, fmt.Errorf("sparse: NewClusterIndex: %d centroid elements is not a positive multiple of d=%d", len(centroids), d)
	}
	if first < 0 || int64(first)+int64(len(assign)) > 1<<31-1 {
		return nil, fmt.Errorf("sparse: NewClusterIndex: token ids first=%d … +%d do not fit int32", first, len(assign))
	}
	c := len(centroids) / d
	x := &ClusterIndex{D: d, Centroids: append([]float64(nil), centroids...), Sizes: make([]int, c), Members: make([][]int32, c)}
	for r, a := range assign {
		if a < 0 || int(a) >= c {
			return nil, fmt.Errorf("sparse: NewClusterIndex: assign[%d] = %d outside [0, %d)", r, a, c)
		}
		x.Sizes[a]++
	}
	for j := range x.Members {
		x.Members[j] = make([]int32, 0, x.Sizes[j])
	}
	for r, a := range assign {
		x.Members[a] = append(x.Members[a], first+int32(r))
	}
	return x, nil
}

// BuildClusterIndexRef clusters tokens [first, first+count) of keys (rows of
// dimension d) the way Tactic does at prefill with whole-context K-means:
// BuildSpanClusterIndexRef with span 0.
func BuildClusterIndexRef(keys []float64, d, first, count, avgSize, maxIter int, seed uint64) (*ClusterIndex, error) {
	return BuildSpanClusterIndexRef(keys, d, first, count, 0, avgSize, maxIter, seed)
}

// BuildSpanClusterIndexRef clusters tokens [first, first+count) of keys
// (rows of dimension d) within spans of span tokens, as KMeans.Cluster does
// with KMeansOptions.Span: spans KMeansSpans(count, span, avgSize) (row r
// is token first+r), initial rows KMeansSpanInit(spans, seed), KMeansSpanRef
// with maxIter iterations, then NewClusterIndex. With span 0 (or ≥ count)
// that is whole-context K-means: KMeansClusterCount(count, avgSize)
// clusters, initial rows KMeansInit(count, clusters, seed) and KMeansRef.
func BuildSpanClusterIndexRef(keys []float64, d, first, count, span, avgSize, maxIter int, seed uint64) (*ClusterIndex, error) {
	if d <= 0 || first < 0 || count <= 0 || (first+count)*d > len(keys) {
		return nil, fmt.Errorf("sparse: BuildClusterIndexRef: tokens [%d, %d) of d=%d not inside %d key elements", first, first+count, d, len(keys))
	}
	spans, err := KMeansSpans(count, span, avgSize)
	if err != nil {
		return nil, err
	}
	init, err := KMeansSpanInit(spans, seed)
	if err != nil {
		return nil, err
	}
	cent, assign, _, err := KMeansSpanRef(keys[first*d:(first+count)*d], count, d, spans, init, maxIter)
	if err != nil {
		return nil, err
	}
	return NewClusterIndex(cent, d, assign, int32(first))
}
