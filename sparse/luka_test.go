package sparse

import (
	"fmt"
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/vk/vktest"
)

// TestLuKAStepMatchesReference runs LuKA steps on the GPU over a generated
// layer that grows by a token a step, the segmenter run every Every
// tokens, under each rule and compressor at odd segment sizes, and checks
// after every step (outputs, logits and partials poisoned with NaN before
// it):
//   - the cover's logits against float64 products with the GPU's fp16
//     summaries;
//   - each head's refined summaries, exactly, against LuKARefineRef on the
//     GPU's float32 logits and normaliser (ties to the lower summary);
//   - the output against LuKAAttendRef over the GPU's refined summaries;
//   - the raw tokens' accumulated masses against a float64 mirror;
//
// and after every run of the segmenter each new summary against
// LuKACompressRef with the mirror's accumulated weights.
func TestLuKAStepMatchesReference(t *testing.T) {
	dev := vktest.Open(t)
	h := Heads{Query: 8, KV: 2, Dim: 64}
	dense, err := NewDense(dev, h)
	require.NoError(t, err)
	defer dense.Release()
	for _, c := range []struct {
		opts     LuKA
		n, steps int
		held     int // logits luka_select holds in shared memory (0: the default)
	}{
		{LuKA{Segment: 16, Recent: 40, Every: 4, Compressor: LuKAWeighted, Tau: 0.05, Rule: RefineTopK, K: 3}, 700, 9, 0},
		{LuKA{Segment: 3, Recent: 40, Every: 4, Compressor: LuKAWeighted, Tau: 0.05, Rule: RefineTopK, K: 5}, 400, 3, 8}, // logits read from memory
		{LuKA{Segment: 7, Recent: 33, Every: 5, Compressor: LuKAMean, Rule: RefineThreshold, Epsilon: 0.004}, 301, 7, 0},
		{LuKA{Segment: 5, Recent: 1, Every: 1, Compressor: LuKARandom, Seed: 99, Rule: RefineFraction, Rho: 0.3}, 123, 4, 0},
		{LuKA{Segment: 16, Recent: 20, Every: 3, Compressor: LuKAWeighted, Tau: 0.5, Rule: RefineTopK, K: 1000}, 200, 4, 0}, // every summary refined
		{LuKA{Segment: 64, Recent: 10, Every: 2, Compressor: LuKAMean, Rule: RefineTopK, K: 2}, 60, 3, 0},                   // no summary at first
	} {
		what := fmt.Sprintf("%v, n %d", c.opts, c.n)
		testLuKA(t, dev, dense, h, c.opts, c.n, c.steps, c.held, what)
	}
	// Llama's head dimension, a group of 8 query heads.
	wide := Heads{Query: 16, KV: 2, Dim: 128}
	denseWide, err := NewDense(dev, wide)
	require.NoError(t, err)
	defer denseWide.Release()
	testLuKA(t, dev, denseWide, wide, LuKA{Segment: 16, Recent: 30, Every: 2, Rule: RefineFraction, Rho: 0.2}, 333, 3, 0, "D 128, group 8")
}

func testLuKA(t *testing.T, dev *vk.Device, dense *Dense, h Heads, opts LuKA, n, steps, held int, what string) {
	total := n + steps
	tr := generated(t, h, total, steps)
	layer, err := kvcache.NewLayer(dev, h.KV, h.Dim, total+3)
	require.NoError(t, err)
	defer layer.Release()
	head := func(x []uint16, g, from, count int) []uint16 {
		return x[(g*total+from)*h.Dim : (g*total+from+count)*h.Dim]
	}
	prefK, prefV := make([]uint16, 0, h.KV*n*h.Dim), make([]uint16, 0, h.KV*n*h.Dim)
	for g := 0; g < h.KV; g++ {
		prefK, prefV = append(prefK, head(tr.K, g, 0, n)...), append(prefV, head(tr.V, g, 0, n)...)
	}
	require.NoError(t, layer.Prefill(prefK, prefV, n))
	keys, values := HalvesToFloat64(tr.K), HalvesToFloat64(tr.V)
	rows := func(x []float64, g, from, count int) []float64 {
		return x[(g*total+from)*h.Dim : (g*total+from+count)*h.Dim]
	}

	step, err := newLuKAStep(dense, layer, opts, held)
	require.NoError(t, err)
	defer func() { require.NoError(t, step.Release()) }()
	opts = step.Options()
	p := opts.Segment
	require.Equal(t, opts.Summaries(n), step.Summaries(), "%s: summaries after the prefill", what)

	// The float64 mirror of the accumulated masses, by token.
	weight := make([][]float64, h.Query)
	for hh := range weight {
		weight[hh] = make([]float64, total)
	}
	checkSummaries := func(from, to int, at string) {
		sk, sv, err := step.SummaryRows()
		require.NoError(t, err)
		s := step.Summaries()
		for g := 0; g < h.KV; g++ {
			for c := from; c < to; c++ {
				w := make([]float64, p)
				for u := range w {
					for j := 0; j < h.Group(); j++ {
						w[u] += weight[g*h.Group()+j][c*p+u]
					}
				}
				wk, wv, err := LuKACompressRef(rows(keys, g, c*p, p), rows(values, g, c*p, p), h.Dim, opts.Compressor, w, opts.Tau, LuKAPick(opts.Seed, g, c, p))
				require.NoError(t, err)
				gk := HalvesToFloat64(sk[(g*s+c)*h.Dim : (g*s+c+1)*h.Dim])
				gv := HalvesToFloat64(sv[(g*s+c)*h.Dim : (g*s+c+1)*h.Dim])
				for i := range wk {
					require.InDelta(t, wk[i], gk[i], 2e-3*(1+math.Abs(wk[i])), "%s %s: KV head %d summary %d key %d", what, at, g, c, i)
					require.InDelta(t, wv[i], gv[i], 2e-3*(1+math.Abs(wv[i])), "%s %s: KV head %d summary %d value %d", what, at, g, c, i)
				}
			}
		}
	}
	checkSummaries(0, step.Summaries(), "prefill")

	scale := 1 / math.Sqrt(float64(h.Dim))
	sinceSegment := 0
	for st := 0; st < steps; st++ {
		at := fmt.Sprintf("step %d", st)
		q := tr.Query(st)
		nan := math.Float32bits(float32(math.NaN()))
		require.NoError(t, dev.Run(func(cmd *vk.Commands) {
			for _, b := range []*vk.Buffer{step.out, step.row, step.mz, step.outPart} {
				cmd.Fill(b.All(), nan)
			}
		}))
		got, err := step.Attend(q)
		require.NoError(t, err)
		logits, logZ, err := step.Logits()
		require.NoError(t, err)
		refined, err := step.Refined()
		require.NoError(t, err)
		acc, ring, err := step.Accumulated()
		require.NoError(t, err)
		sk, sv, err := step.SummaryRows()
		require.NoError(t, err)
		s, cur := step.Summaries(), layer.Len()
		nodes := s + cur - s*p
		var want []float64
		for hh := 0; hh < h.Query; hh++ {
			g := hh / h.Group()
			qh := make([]float64, h.Dim)
			for i := range qh {
				qh[i] = float64(q[hh*h.Dim+i])
			}
			out, ls, lz, err := LuKAAttendRef(qh, rows(keys, g, 0, cur), rows(values, g, 0, cur),
				HalvesToFloat64(sk[g*s*h.Dim:(g+1)*s*h.Dim]), HalvesToFloat64(sv[g*s*h.Dim:(g+1)*s*h.Dim]), h.Dim, p, scale, opts.SummaryBias(), refined[hh])
			require.NoError(t, err)
			require.Len(t, ls, nodes)
			gotLogits := make([]float64, nodes)
			for j := range ls {
				gotLogits[j] = float64(logits[hh*nodes+j])
				require.InDelta(t, ls[j], gotLogits[j], 1e-3*(1+math.Abs(ls[j])), "%s %s: head %d cover logit %d", what, at, hh, j)
			}
			require.InDelta(t, lz, logZ[hh], 1e-3*(1+math.Abs(lz)), "%s %s: head %d log normaliser", what, at, hh)
			wantRefined := LuKARefineRef(gotLogits[:s], logZ[hh], opts)
			if wantRefined == nil {
				wantRefined = []int{}
			}
			require.Equal(t, wantRefined, refined[hh], "%s %s: head %d refined summaries", what, at, hh)
			want = append(want, out...)
			for j := s; j < nodes; j++ {
				tok := s*p + j - s
				weight[hh][tok] += math.Exp(gotLogits[j] - logZ[hh])
			}
			for tok := s * p; tok < cur; tok++ {
				require.InDelta(t, weight[hh][tok], float64(acc[hh*ring+tok%ring]), 1e-5*(1+weight[hh][tok]), "%s %s: head %d token %d accumulated mass", what, at, hh, tok)
			}
		}
		requireClose(t, want, got, h.Dim, 1e-3, what+" "+at)
		attended, err := step.Attended()
		require.NoError(t, err)
		require.GreaterOrEqual(t, attended, float64(nodes), "%s %s: rows attended", what, at)

		// The next token, and the segmenter every Every of them.
		var k1, v1 []uint16
		for g := 0; g < h.KV; g++ {
			k1, v1 = append(k1, head(tr.K, g, cur, 1)...), append(v1, head(tr.V, g, cur, 1)...)
		}
		require.NoError(t, layer.Append(k1, v1))
		if sinceSegment++; sinceSegment >= opts.Every {
			sinceSegment = 0
			before := step.Summaries()
			made, err := step.Segment()
			require.NoError(t, err)
			require.Equal(t, opts.Summaries(layer.Len())-before, made, "%s %s: summaries made", what, at)
			checkSummaries(before, step.Summaries(), at+" segmenter")
		}
	}
}

// TestLuKARefuses checks LuKA's option errors and a tail the segmenter
// fell behind on.
func TestLuKARefuses(t *testing.T) {
	for _, bad := range []LuKA{{Segment: 65}, {Segment: -1}, {Recent: -1}, {Every: -2}, {Tau: math.NaN()}, {Tau: -1}, {K: -1},
		{Epsilon: 1.5}, {Rho: 2}, {Rule: 7}, {Compressor: 9}} {
		_, err := bad.Resolve()
		require.Error(t, err, "%+v", bad)
	}
	dev := vktest.Open(t)
	h := Heads{Query: 4, KV: 1, Dim: 32}
	dense, err := NewDense(dev, h)
	require.NoError(t, err)
	defer dense.Release()
	layer, err := kvcache.NewLayer(dev, h.KV, h.Dim, 400)
	require.NoError(t, err)
	defer layer.Release()
	tr := generated(t, h, 300, 1)
	require.NoError(t, layer.Prefill(tr.K[:100*h.Dim], tr.V[:100*h.Dim], 100))
	step, err := NewLuKAStep(dense, layer, LuKA{Segment: 4, Recent: 8, Every: 2})
	require.NoError(t, err)
	defer step.Release()
	for i := 100; i < 300; i++ {
		require.NoError(t, layer.Append(tr.K[i*h.Dim:(i+1)*h.Dim], tr.V[i*h.Dim:(i+1)*h.Dim]))
	}
	_, err = step.Attend(tr.Query(0))
	require.ErrorContains(t, err, "run Segment")
	_, err = step.Segment()
	require.NoError(t, err)
	_, err = step.Attend(tr.Query(0))
	require.NoError(t, err)
	require.NoError(t, layer.Truncate(10))
	_, err = step.Segment()
	require.Error(t, err, "a layer truncated below its summaries")
}
