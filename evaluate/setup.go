package evaluate

import (
	"fmt"
	"runtime"
	"slices"
	"sync"

	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/trace"
)

// Setup is what the float64 runs over a trace (Tactic, Compare) share:
// which queries are evaluated, the prefill clustered, the target masses,
// the sinks, and Tactic's clustering and fit. Fields derived from the
// trace are so when zero or nil.
type Setup struct {
	// Prefill is the number of leading tokens present at prefill: tokens
	// [Sinks, Prefill) are clustered, and a query at position pos attends
	// [0, Sinks) and [Prefill, pos] in full (sparse.TacticFixedTokens).
	// 0 means DefaultPrefill.
	Prefill int `json:"prefill"`
	// Queries lists the indices of the trace's queries to evaluate; each
	// must sit at a position ≥ Prefill−1. nil means TailQueries.
	Queries []int `json:"queries"`
	// P lists the target masses, each in (0, 1].
	P []float64 `json:"p"`
	// Sinks is the number of leading sink tokens, 0 ≤ Sinks < Prefill.
	Sinks int `json:"sinks"`
	// AvgClusterSize, KMeansIters and KMeansSpan set the clustering of
	// every KV head's prefill (sparse.BuildSpanClusterIndexRef): K-means
	// within spans of KMeansSpan tokens (sparse.KMeansOptions.Span), or
	// over the whole prefill when KMeansSpan is 0. KV head g uses the seed
	// Seed+g.
	AvgClusterSize int    `json:"avg_cluster_size"`
	KMeansIters    int    `json:"kmeans_iters"`
	KMeansSpan     int    `json:"kmeans_span"`
	Seed           uint64 `json:"seed"`
	// Fit holds Tactic's distribution-fitting parameters.
	Fit sparse.TacticFit `json:"fit"`
	// Workers bounds the goroutines used; 0 means GOMAXPROCS. The result
	// does not depend on it.
	Workers int `json:"-"`
	// Progress, if not nil, is called after each unit of work with the
	// units done and their total. Calls come from several goroutines, one
	// at a time.
	Progress func(done, total int) `json:"-"`
}

// validate reports the first problem with the setup that does not depend
// on the trace; who names the run in the error.
func (s *Setup) validate(who string) error {
	switch {
	case len(s.P) == 0:
		return fmt.Errorf("evaluate: %s: no target masses P", who)
	case s.Sinks < 0:
		return fmt.Errorf("evaluate: %s: %d sinks", who, s.Sinks)
	case s.AvgClusterSize <= 0 || s.KMeansIters < 1:
		return fmt.Errorf("evaluate: %s: average cluster size %d and K-means iterations %d must be positive", who, s.AvgClusterSize, s.KMeansIters)
	case s.KMeansSpan < 0:
		return fmt.Errorf("evaluate: %s: K-means span %d is negative", who, s.KMeansSpan)
	}
	for _, p := range s.P {
		if err := sparse.CheckP(p); err != nil {
			return err
		}
	}
	return s.Fit.Validate()
}

// resolve returns the queries (a copy of Queries, or TailQueries) and the
// prefill (Prefill, or DefaultPrefill) of a run over t, after checking
// them against t; who names the run in the error.
func (s *Setup) resolve(t *trace.Trace, who string) ([]int, int, error) {
	queries := slices.Clone(s.Queries)
	if queries == nil {
		queries = TailQueries(t)
	}
	prefill := s.Prefill
	if prefill == 0 {
		prefill = DefaultPrefill(t, queries)
	}
	switch {
	case len(queries) == 0:
		return nil, 0, fmt.Errorf("evaluate: %s: no queries to evaluate", who)
	case s.Sinks >= prefill || prefill > t.Tokens:
		return nil, 0, fmt.Errorf("evaluate: %s: want 0 ≤ sinks (%d) < prefill (%d) ≤ tokens (%d)", who, s.Sinks, prefill, t.Tokens)
	}
	seen := make(map[int]bool, len(queries))
	for _, qi := range queries {
		if qi < 0 || qi >= t.Queries() || seen[qi] {
			return nil, 0, fmt.Errorf("evaluate: %s: query index %d repeated or outside [0, %d)", who, qi, t.Queries())
		}
		seen[qi] = true
		if int(t.QPos[qi])+1 < prefill {
			return nil, 0, fmt.Errorf("evaluate: %s: query %d at position %d lies inside the prefill [0, %d)", who, qi, t.QPos[qi], prefill)
		}
	}
	return queries, prefill, nil
}

// workers returns the goroutines to use: Workers, or GOMAXPROCS.
func (s *Setup) workers() int {
	if s.Workers > 0 {
		return s.Workers
	}
	return runtime.GOMAXPROCS(0)
}

// counter returns a function that counts one unit of work of total and
// reports it to Progress, safe to call from several goroutines.
func (s *Setup) counter(total int) func() {
	var mu sync.Mutex
	done := 0
	return func() {
		if s.Progress != nil {
			mu.Lock()
			done++
			s.Progress(done, total)
			mu.Unlock()
		}
	}
}

// kvHead is one KV head of a trace in float64 with its prefill clustered.
type kvHead struct {
	keys, values []float64
	idx          *sparse.ClusterIndex
}

// clusterHeads decodes the first rows tokens of every KV head of t and
// clusters each head's prefill [Sinks, prefill) as Setup says, its
// centroids then held in 8 bits as the GPU's selection reads them
// (sparse.QuantizedCentroidsRef), calling step after each head.
func (s *Setup) clusterHeads(t *trace.Trace, rows, prefill int, step func()) ([]kvHead, error) {
	d := t.HeadDim
	heads := make([]kvHead, t.KVHeads)
	err := parallelFor(t.KVHeads, s.workers(), func(g int) error {
		h := &heads[g]
		off := g * t.Tokens * d
		h.keys = sparse.HalvesToFloat64(t.K[off : off+rows*d])
		h.values = sparse.HalvesToFloat64(t.V[off : off+rows*d])
		var err error
		h.idx, err = sparse.BuildSpanClusterIndexRef(h.keys, d, s.Sinks, prefill-s.Sinks, s.KMeansSpan, s.AvgClusterSize, s.KMeansIters, s.Seed+uint64(g))
		if err == nil {
			err = h.idx.SetSpreadsRef(h.keys)
		}
		if err == nil {
			h.idx.Centroids, err = sparse.QuantizedCentroidsRef(h.idx.Centroids, d)
		}
		step()
		return err
	})
	if err != nil {
		return nil, err
	}
	return heads, nil
}
