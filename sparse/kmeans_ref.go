package sparse

import (
	"fmt"
	"runtime"
	"sort"
	"sync"
)

// KMeansDefaultAvgClusterSize is the average cluster size Tactic uses: a
// prefill of n tokens is split into KMeansClusterCount(n, 16) clusters.
const KMeansDefaultAvgClusterSize = 16

// KMeansDefaultIters is the iteration cap Tactic uses for K-means.
const KMeansDefaultIters = 10

// KMeansClusterCount returns ceil(n / avgSize), the number of clusters for
// n tokens at average cluster size avgSize (0 when n is 0).
func KMeansClusterCount(n, avgSize int) (int, error) {
	if n < 0 || avgSize <= 0 {
		return 0, fmt.Errorf("sparse: KMeansClusterCount(n=%d, avgSize=%d): want n ≥ 0 and avgSize > 0", n, avgSize)
	}
	return (n + avgSize - 1) / avgSize, nil
}

// SplitMix64 is the splitmix64 generator (Steele, Lea, Flood 2014). Each
// call to Next adds 0x9E3779B97F4A7C15 to the state and returns
//
//	z = state
//	z = (z ^ z>>30) * 0xBF58476D1CE4E5B9
//	z = (z ^ z>>27) * 0x94D049BB133111EB
//	z ^ z>>31
//
// with all arithmetic modulo 2^64.
type SplitMix64 struct{ State uint64 }

// Next advances the generator and returns the next 64-bit output.
func (s *SplitMix64) Next() uint64 {
	s.State += 0x9E3779B97F4A7C15
	z := s.State
	z = (z ^ z>>30) * 0xBF58476D1CE4E5B9
	z = (z ^ z>>27) * 0x94D049BB133111EB
	return z ^ z>>31
}

// KMeansInit returns the initial centroid rows: clusters distinct indices in
// [0, n) drawn by a partial Fisher-Yates shuffle driven by SplitMix64{seed}.
// Exactly:
//
//	perm = [0, 1, …, n-1]
//	for i = 0 … clusters-1:
//	    j = i + Next() mod (n - i)      // unsigned 64-bit remainder
//	    swap perm[i], perm[j]
//	return perm[0:clusters]
//
// (The remainder has a modulo bias below 2^-50 for n < 2^14; it is part of
// the definition, not an error.)
func KMeansInit(n, clusters int, seed uint64) ([]int, error) {
	if n < 0 || clusters < 0 || clusters > n {
		return nil, fmt.Errorf("sparse: KMeansInit(n=%d, clusters=%d): want 0 ≤ clusters ≤ n", n, clusters)
	}
	perm := make([]int, n)
	for i := range perm {
		perm[i] = i
	}
	rng := SplitMix64{State: seed}
	for i := 0; i < clusters; i++ {
		j := i + int(rng.Next()%uint64(n-i))
		perm[i], perm[j] = perm[j], perm[i]
	}
	return perm[:clusters:clusters], nil
}

// KMeansDefaultSpan is the span recommended for clustering a long
// context (KMeansOptions.Span, evaluate.TacticOptions.KMeansSpan): spans of
// 2 048 tokens, 128 clusters each at the default cluster size, the same
// tokens per clustering as TacticDecoder's tail. Each token is compared
// with 128 centroids per step, whatever the context's length, so a
// clustering costs time linear in it. On the generated workload and the
// real traces, tokens selected and success rate stay within 2 points and
// 5 % of whole-context K-means at this span.
const KMeansDefaultSpan = 2048

// KMeansSpan is one span of a span-wise clustering: rows [First,
// First+Count) of the clustered range form clusters [FirstCluster,
// FirstCluster+Clusters) and nothing else.
type KMeansSpan struct {
	First, Count           int
	FirstCluster, Clusters int
}

// KMeansSpans cuts n rows into spans of span rows: span s holds rows
// [s·span, min((s+1)·span, n)), so the last one may be shorter, and
// KMeansClusterCount(its rows, avgSize) clusters, numbered after those of
// span s−1. Every span but the last has the same number of clusters, so
// span s's first cluster is s·KMeansClusterCount(span, avgSize). span 0,
// or any span ≥ n, gives one span of all n rows: whole-context K-means.
func KMeansSpans(n, span, avgSize int) ([]KMeansSpan, error) {
	if n <= 0 || span < 0 || avgSize <= 0 {
		return nil, fmt.Errorf("sparse: KMeansSpans(n=%d, span=%d, avgSize=%d): want n > 0, span ≥ 0 and avgSize > 0", n, span, avgSize)
	}
	if span == 0 || span > n {
		span = n
	}
	var out []KMeansSpan
	c := 0
	for first := 0; first < n; first += span {
		count := min(span, n-first)
		k, err := KMeansClusterCount(count, avgSize)
		if err != nil {
			return nil, err
		}
		out = append(out, KMeansSpan{First: first, Count: count, FirstCluster: c, Clusters: k})
		c += k
	}
	return out, nil
}

// KMeansSpanSeed returns the seed of span s's initial rows: seed itself
// for span 0 (so that one span is whole-context K-means exactly), and
// seed + s·0xD1B54A32D192ED03 (modulo 2^64) after it, an odd step that
// keeps the spans' SplitMix64 streams apart.
func KMeansSpanSeed(seed uint64, s int) uint64 {
	return seed + uint64(s)*0xD1B54A32D192ED03
}

// KMeansSpanInit returns the initial rows of span-wise K-means, one per
// cluster: cluster spans[s].FirstCluster+i starts at row spans[s].First +
// KMeansInit(spans[s].Count, spans[s].Clusters, KMeansSpanSeed(seed, s))[i].
// With one span it is KMeansInit(n, clusters, seed).
func KMeansSpanInit(spans []KMeansSpan, seed uint64) ([]int, error) {
	var out []int
	for s, sp := range spans {
		if sp.FirstCluster != len(out) {
			return nil, fmt.Errorf("sparse: KMeansSpanInit: span %d starts at cluster %d, want %d", s, sp.FirstCluster, len(out))
		}
		init, err := KMeansInit(sp.Count, sp.Clusters, KMeansSpanSeed(seed, s))
		if err != nil {
			return nil, err
		}
		for _, r := range init {
			out = append(out, sp.First+r)
		}
	}
	return out, nil
}

// KMeansSpanRef runs K-means within each span of spans separately: span
// sp is KMeansRef over rows [sp.First, sp.First+sp.Count) of keys, with
// initial rows init[sp.FirstCluster : sp.FirstCluster+sp.Clusters] (row
// numbers of keys, all inside the span; KMeansSpanInit makes them) and
// maxIter iterations, stopping on its own when its assignment changes
// nothing. Its centroids become rows sp.FirstCluster… of the returned
// centroids and its rows' clusters are numbered from sp.FirstCluster. The
// spans must cover rows [0, n) in order. iters is the most any span ran.
// With one span this is KMeansRef(keys, n, d, init, maxIter).
func KMeansSpanRef(keys []float64, n, d int, spans []KMeansSpan, init []int, maxIter int) (centroids []float64, assign []int32, iters int, err error) {
	if n <= 0 || d <= 0 || len(keys) != n*d {
		return nil, nil, 0, fmt.Errorf("sparse: KMeansSpanRef: keys has %d elements, want n×d with n=%d, d=%d positive", len(keys), n, d)
	}
	row, c := 0, 0
	for s, sp := range spans {
		if sp.First != row || sp.Count <= 0 || sp.FirstCluster != c || sp.Clusters <= 0 || sp.Clusters > sp.Count {
			return nil, nil, 0, fmt.Errorf("sparse: KMeansSpanRef: span %d %+v does not follow rows [0, %d) and clusters [0, %d)", s, sp, row, c)
		}
		row, c = row+sp.Count, c+sp.Clusters
	}
	if row != n || len(init) != c {
		return nil, nil, 0, fmt.Errorf("sparse: KMeansSpanRef: spans cover %d rows and %d clusters, want %d rows and %d initial rows", row, c, n, len(init))
	}
	centroids = make([]float64, c*d)
	assign = make([]int32, n)
	for s, sp := range spans {
		local := make([]int, sp.Clusters)
		for i, r := range init[sp.FirstCluster : sp.FirstCluster+sp.Clusters] {
			if r < sp.First || r >= sp.First+sp.Count {
				return nil, nil, 0, fmt.Errorf("sparse: KMeansSpanRef: initial row %d of span %d outside its rows [%d, %d)", r, s, sp.First, sp.First+sp.Count)
			}
			local[i] = r - sp.First
		}
		cent, a, it, err := KMeansRef(keys[sp.First*d:(sp.First+sp.Count)*d], sp.Count, d, local, maxIter)
		if err != nil {
			return nil, nil, 0, err
		}
		copy(centroids[sp.FirstCluster*d:], cent)
		for r, j := range a {
			assign[sp.First+r] = j + int32(sp.FirstCluster)
		}
		iters = max(iters, it)
	}
	return centroids, assign, iters, nil
}

// KMeansRef runs Lloyd's algorithm on the n rows of keys (n×d, row-major).
//
// The initial centroids are the rows keys[init[j]], j = 0 … len(init)-1.
// Each iteration is an assignment step followed by an update step:
//
//   - assignment: row r goes to the cluster c minimising the squared
//     Euclidean distance Σ_k (keys[r,k] − centroid[c,k])²; ties go to the
//     lowest c. Distances are float64; the reference accumulates dimension
//     k into partial sum k mod 4 and adds ((s0+s1)+(s2+s3)).
//   - if this is not the first iteration and no row changed cluster, stop
//     (the centroids are already the means of their members).
//   - update: each centroid becomes the mean of its members, summed in
//     ascending row order and divided by the member count; a cluster with no
//     members keeps its previous centroid.
//
// At most maxIter iterations run. It returns the centroids (len(init)×d),
// the final assignment (so centroids are always the means of the final
// members, and the final assignment is nearest with respect to the
// centroids before the last update), and iters, the number of assignment
// steps run: iters < maxIter, or iters == maxIter with the last step
// unchanged, means converged.
func KMeansRef(keys []float64, n, d int, init []int, maxIter int) (centroids []float64, assign []int32, iters int, err error) {
	switch {
	case n <= 0 || d <= 0 || len(keys) != n*d:
		return nil, nil, 0, fmt.Errorf("sparse: KMeansRef: keys has %d elements, want n×d with n=%d, d=%d positive", len(keys), n, d)
	case len(init) == 0 || len(init) > n:
		return nil, nil, 0, fmt.Errorf("sparse: KMeansRef: %d initial centroids for %d rows", len(init), n)
	case maxIter < 1:
		return nil, nil, 0, fmt.Errorf("sparse: KMeansRef: maxIter %d < 1", maxIter)
	}
	c := len(init)
	centroids = make([]float64, c*d)
	for j, r := range init {
		if r < 0 || r >= n {
			return nil, nil, 0, fmt.Errorf("sparse: KMeansRef: init[%d] = %d outside [0, %d)", j, r, n)
		}
		copy(centroids[j*d:(j+1)*d], keys[r*d:(r+1)*d])
	}
	assign = make([]int32, n)
	for i := range assign {
		assign[i] = -1
	}
	next := make([]int32, n)
	sums := make([]float64, c*d)
	counts := make([]int, c)
	perm := kmeansPruneOrder(keys, n, d)
	pkeys := permuteRows(keys, d, perm)
	for iters = 1; iters <= maxIter; iters++ {
		kmeansAssign(keys, pkeys, n, d, centroids, permuteRows(centroids, d, perm), assign, next)
		changed := false
		for i := range next {
			if next[i] != assign[i] {
				changed = true
				break
			}
		}
		assign, next = next, assign
		if !changed {
			break
		}
		clear(sums)
		clear(counts)
		for r := 0; r < n; r++ {
			j := int(assign[r])
			counts[j]++
			row, s := keys[r*d:(r+1)*d], sums[j*d:(j+1)*d]
			for k := range s {
				s[k] += row[k]
			}
		}
		for j := 0; j < c; j++ {
			if counts[j] == 0 {
				continue
			}
			cnt := float64(counts[j])
			for k := 0; k < d; k++ {
				centroids[j*d+k] = sums[j*d+k] / cnt
			}
		}
	}
	if iters > maxIter {
		iters = maxIter
	}
	return centroids, assign, iters, nil
}

// kmeansAssign writes the nearest centroid of every row into out. Rows are
// independent, so they are split over goroutines; the result does not
// depend on the split. prev seeds each row's search with its previous
// cluster, which only enables pruning.
//
// Pruning never changes the result. A candidate is first measured on pkeys
// and pcentroids, the same rows with their dimensions reordered (see
// kmeansPruneOrder), and abandoned once that partial sum exceeds the best
// distance so far by the factor 1+1e-12: both sums add the same
// non-negative terms, in orders whose rounding differs by far less, so the
// candidate's distance as KMeansRef defines it is larger than the best. A
// candidate that survives is measured in the defined order, where it is
// again abandoned once its partial sum exceeds the best.
func kmeansAssign(keys, pkeys []float64, n, d int, centroids, pcentroids []float64, prev, out []int32) {
	c := len(centroids) / d
	workers := runtime.GOMAXPROCS(0)
	chunk := (n + workers - 1) / workers
	var wg sync.WaitGroup
	for lo := 0; lo < n; lo += chunk {
		hi := min(lo+chunk, n)
		wg.Add(1)
		go func(lo, hi int) {
			defer wg.Done()
			for r := lo; r < hi; r++ {
				x, px := keys[r*d:(r+1)*d], pkeys[r*d:(r+1)*d]
				best, bestD := 0, 0.0
				if p := int(prev[r]); p >= 0 {
					best = p
				}
				bestD = sqDist(x, centroids[best*d:(best+1)*d], -1)
				for j := 0; j < c; j++ {
					if j == best {
						continue
					}
					if bound := bestD * (1 + 1e-12); sqDist(px, pcentroids[j*d:(j+1)*d], bound) > bound {
						continue
					}
					dj := sqDist(x, centroids[j*d:(j+1)*d], bestD)
					if dj < bestD || (dj == bestD && j < best) {
						best, bestD = j, dj
					}
				}
				out[r] = int32(best)
			}
		}(lo, hi)
	}
	wg.Wait()
}

// kmeansPruneOrder returns the dimensions by descending variance over the
// n rows of keys (ties by index). Partial distances summed in this order
// grow fastest, so candidates are abandoned early.
func kmeansPruneOrder(keys []float64, n, d int) []int {
	mean, variance := make([]float64, d), make([]float64, d)
	for r := 0; r < n; r++ {
		for k, x := range keys[r*d : (r+1)*d] {
			mean[k] += x
		}
	}
	for k := range mean {
		mean[k] /= float64(n)
	}
	for r := 0; r < n; r++ {
		for k, x := range keys[r*d : (r+1)*d] {
			variance[k] += (x - mean[k]) * (x - mean[k])
		}
	}
	perm := make([]int, d)
	for k := range perm {
		perm[k] = k
	}
	sort.SliceStable(perm, func(i, j int) bool { return variance[perm[i]] > variance[perm[j]] })
	return perm
}

// permuteRows returns a copy of the rows of m (width d) with column k
// taken from column perm[k].
func permuteRows(m []float64, d int, perm []int) []float64 {
	out := make([]float64, len(m))
	for r := 0; r < len(m); r += d {
		for k, p := range perm {
			out[r+k] = m[r+p]
		}
	}
	return out
}

// sqDist returns Σ (x−y)² accumulated as documented in KMeansRef. When
// bound ≥ 0 it may stop early and return any value > bound once the partial
// sum after a multiple of 16 dimensions exceeds bound. Blocks of 16
// dimensions go through fixed-size arrays, so that the compiler drops the
// bounds checks; each partial sum still receives its terms in ascending
// dimension order.
func sqDist(x, y []float64, bound float64) float64 {
	y = y[:len(x)]
	var s0, s1, s2, s3 float64
	k := 0
	for ; k+16 <= len(x); k += 16 {
		a, b := (*[16]float64)(x[k:k+16]), (*[16]float64)(y[k:k+16])
		for j := 0; j < 16; j += 4 {
			d0, d1, d2, d3 := a[j]-b[j], a[j+1]-b[j+1], a[j+2]-b[j+2], a[j+3]-b[j+3]
			s0 += d0 * d0
			s1 += d1 * d1
			s2 += d2 * d2
			s3 += d3 * d3
		}
		if bound >= 0 {
			if p := (s0 + s1) + (s2 + s3); p > bound {
				return p
			}
		}
	}
	for ; k < len(x); k++ {
		a := x[k] - y[k]
		switch k & 3 {
		case 0:
			s0 += a * a
		case 1:
			s1 += a * a
		case 2:
			s2 += a * a
		default:
			s3 += a * a
		}
	}
	return (s0 + s1) + (s2 + s3)
}
