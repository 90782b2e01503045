package sparse

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/x448/float16"

	"github.com/vksparse/vksparse/trace"
)

// Evaluation setup on the real traces (see ../shared/traces/README.md from
// the repository root).
const (
	traceClusteredEnd = 16320 // keys [0, 16320) are the prefill
	traceTailQueries  = 32    // the last 32 queries are decode steps
	traceKMeansSeed   = 0x7AC71C
)

// tracesDir returns $VKSPARSE_TRACES or ../shared/traces relative to the
// repository root.
func tracesDir() string {
	if d := os.Getenv("VKSPARSE_TRACES"); d != "" {
		return d
	}
	return filepath.Join("..", "..", "shared", "traces")
}

// traceKVHead is one KV head of a trace in float64 with its cluster index.
type traceKVHead struct {
	keys, values []float64
	idx          *ClusterIndex
}

type traceLayer struct {
	name  string
	tr    *trace.Trace
	heads []traceKVHead
}

func halfRows(bits []uint16) []float64 {
	out := make([]float64, len(bits))
	for i, h := range bits {
		out[i] = float64(float16.Frombits(h).Float32())
	}
	return out
}

// loadTraceLayer reads a trace and clusters tokens [sinks, traceClusteredEnd)
// of every KV head (average size 16, 10 iterations, fixed seed).
func loadTraceLayer(path string, sinks int) (*traceLayer, error) {
	tr, err := trace.Read(path)
	if err != nil {
		return nil, err
	}
	l := &traceLayer{name: filepath.Base(path), tr: tr, heads: make([]traceKVHead, tr.KVHeads)}
	per := tr.Tokens * tr.HeadDim
	for g := range l.heads {
		h := &l.heads[g]
		h.keys = halfRows(tr.K[g*per : (g+1)*per])
		h.values = halfRows(tr.V[g*per : (g+1)*per])
		h.idx, err = BuildClusterIndexRef(h.keys, tr.HeadDim, sinks, traceClusteredEnd-sinks,
			KMeansDefaultAvgClusterSize, KMeansDefaultIters, traceKMeansSeed+uint64(g))
		if err != nil {
			return nil, err
		}
	}
	return l, nil
}

// tacticTraceStats sums per-query-head figures for one (layer, P).
type tacticTraceStats struct {
	heads        int
	success      int     // own selection reaches P
	successUnion int     // GQA union reaches P
	mass         float64 // own selection
	massUnion    float64
	selected     float64 // own selection, F included
	union        float64 // union size (per head, so weighted by heads)
	clusterOpt   float64 // ClusterTopPCount with F forced
	clusterOptS  float64 // ClusterTopPCount with F as singleton clusters, nothing forced
	globalOpt    float64
	relErr       float64 // union attention vs dense
}

// row formats the means: success and mass of the attended union (own
// selection in brackets), own selection size, cluster-optimal with F forced,
// their ratio, global-optimal, union size, cluster-optimal with F as
// singleton clusters, and the relative output error of union attention.
func (s tacticTraceStats) row(layer string, p float64) string {
	n := float64(s.heads)
	return fmt.Sprintf("%s P=%.1f  success %5.1f%% (own %5.1f%%)  mass %.3f (own %.3f)  selected %7.1f  cluster-opt %7.1f  ratio %.3f  global-opt %7.1f  union %7.1f  cluster-opt/F-singletons %7.1f  relerr %.4f",
		layer, p, 100*float64(s.successUnion)/n, 100*float64(s.success)/n, s.massUnion/n, s.mass/n,
		s.selected/n, s.clusterOpt/n, s.selected/s.clusterOpt, s.globalOpt/n, s.union/n, s.clusterOptS/n, s.relErr/n)
}

// evalTacticTrace runs Tactic on the tail queries of l for every P.
func evalTacticTrace(l *traceLayer, sinks int, ps []float64, fit TacticFit) ([]tacticTraceStats, error) {
	tr := l.tr
	d, group := tr.HeadDim, tr.QHeads/tr.KVHeads
	stats := make([]tacticTraceStats, len(ps))
	var mu sync.Mutex
	var wg sync.WaitGroup
	errs := make(chan error, tr.Queries())
	for qi := tr.Queries() - traceTailQueries; qi < tr.Queries(); qi++ {
		wg.Add(1)
		go func(qi int) {
			defer wg.Done()
			local := make([]tacticTraceStats, len(ps))
			if err := evalTacticQuery(l, qi, d, group, sinks, ps, fit, local); err != nil {
				errs <- err
				return
			}
			mu.Lock()
			for i, s := range local {
				t := &stats[i]
				t.heads += s.heads
				t.success += s.success
				t.successUnion += s.successUnion
				t.mass += s.mass
				t.massUnion += s.massUnion
				t.selected += s.selected
				t.union += s.union
				t.clusterOpt += s.clusterOpt
				t.clusterOptS += s.clusterOptS
				t.globalOpt += s.globalOpt
				t.relErr += s.relErr
			}
			mu.Unlock()
		}(qi)
	}
	wg.Wait()
	close(errs)
	return stats, <-errs
}

func evalTacticQuery(l *traceLayer, qi, d, group, sinks int, ps []float64, fit TacticFit, out []tacticTraceStats) error {
	tr := l.tr
	pos := int(tr.QPos[qi])
	if pos < traceClusteredEnd {
		return fmt.Errorf("query %d at %d is not a decode step", qi, pos)
	}
	qrow := tr.Query(qi)
	fixed, err := TacticFixedTokens(sinks, traceClusteredEnd, pos)
	if err != nil {
		return err
	}
	for g, h := range l.heads {
		keys, values := h.keys[:(pos+1)*d], h.values[:(pos+1)*d]
		singletons := append([][]int32(nil), h.idx.Members...)
		for _, t := range fixed {
			singletons = append(singletons, []int32{t})
		}
		qs := make([][]float64, group)
		probs := make([][]float64, group)
		dense := make([][]float64, group)
		for j := range qs {
			qs[j] = make([]float64, d)
			for k := range qs[j] {
				qs[j][k] = float64(qrow[(g*group+j)*d+k])
			}
			if probs[j], err = SoftmaxRef(qs[j], keys, tr.Scale); err != nil {
				return err
			}
			if dense[j], err = AttendRef(qs[j], keys, values, tr.Scale); err != nil {
				return err
			}
		}
		for pi, p := range ps {
			outs, union, budgets, err := TacticDecodeRef(qs, keys, values, tr.Scale, h.idx, fixed, p, fit)
			if err != nil {
				return err
			}
			s := &out[pi]
			for j := range qs {
				own := TacticSelectRef(h.idx, fixed, budgets[j])
				mOwn, err := SubsetMass(probs[j], own)
				if err != nil {
					return err
				}
				mUnion, err := SubsetMass(probs[j], union)
				if err != nil {
					return err
				}
				co, err := ClusterTopPCount(probs[j], h.idx.Members, fixed, p)
				if err != nil {
					return err
				}
				cs, err := ClusterTopPCount(probs[j], singletons, nil, p)
				if err != nil {
					return err
				}
				gopt, err := TopPCount(probs[j], p)
				if err != nil {
					return err
				}
				re, err := RelativeError(outs[j], dense[j])
				if err != nil {
					return err
				}
				s.heads++
				if mOwn >= p {
					s.success++
				}
				if mUnion >= p {
					s.successUnion++
				}
				s.mass += mOwn
				s.massUnion += mUnion
				s.selected += float64(len(own))
				s.union += float64(len(union))
				s.clusterOpt += float64(co)
				s.clusterOptS += float64(cs)
				s.globalOpt += float64(gopt)
				s.relErr += re
			}
		}
	}
	return nil
}

// TestTacticRealTraces is the fidelity evaluation on the real traces: for
// layers 1 and 4 and P = 0.5, 0.7, 0.9, each query head attends the union of
// the selections of its GQA group (plus sinks and tail). Across the (tail
// query, query head) pairs the attended mass must reach P at least 85 % of
// the time, and the mean of each head's own selection (before the union,
// sinks and tail included) must stay within 1.3× the mean cluster-optimal
// count (ClusterTopPCount with the sinks and tail forced).
func TestTacticRealTraces(t *testing.T) {
	ps := []float64{0.5, 0.7, 0.9}
	fit := DefaultTacticFit()
	var table []string
	type check struct {
		name    string
		p, rate float64
		ratio   float64
	}
	var checks []check
	for _, name := range []string{"L1", "L4"} {
		path := filepath.Join(tracesDir(), "trace-shared_http_serve_test-"+name+".safetensors")
		if _, err := os.Stat(path); err != nil {
			if os.Getenv("VKSPARSE_REQUIRE_TRACES") != "" {
				t.Fatalf("real trace %s missing but VKSPARSE_REQUIRE_TRACES is set: %v", path, err)
			}
			t.Skipf("real trace %s not available (set VKSPARSE_TRACES to the traces folder): %v", path, err)
		}
		l, err := loadTraceLayer(path, TacticDefaultSinks)
		require.NoError(t, err)
		stats, err := evalTacticTrace(l, TacticDefaultSinks, ps, fit)
		require.NoError(t, err)
		for i, p := range ps {
			s := stats[i]
			require.Equal(t, traceTailQueries*l.tr.QHeads, s.heads)
			table = append(table, s.row(name, p))
			checks = append(checks, check{name, p, float64(s.successUnion) / float64(s.heads), s.selected / s.clusterOpt})
		}
	}
	t.Log("\n" + strings.Join(table, "\n"))
	for _, c := range checks {
		require.GreaterOrEqualf(t, c.rate, 0.85, "%s P=%.1f success rate", c.name, c.p)
		require.LessOrEqualf(t, c.ratio, 1.3, "%s P=%.1f tokens selected / cluster-optimal", c.name, c.p)
	}
}
