package lm

import (
	"fmt"
	"math"
	"math/rand"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// document is the test document, the first 16 384 bytes of Go's
// net/http/serve_test.go.
func document(t testing.TB) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "testdata", "model", "serve_test_16k.txt"))
	require.NoError(t, err)
	require.Len(t, b, 16384)
	return b
}

// mismatch is one logit where two computations differ.
type mismatch struct {
	pos, tok  int
	got, want float64
}

// compareLogits returns the largest |got − want| over [positions][vocab]
// logits and a report of the positions worst off.
func compareLogits[G, W float32 | float64](got []G, want []W, vocab int) (float64, string) {
	var worst float64
	perPos := map[int]mismatch{}
	for i := range got {
		d := math.Abs(float64(got[i]) - float64(want[i]))
		if d > worst || math.IsNaN(d) {
			worst = d
		}
		p := i / vocab
		if m, ok := perPos[p]; !ok || d > math.Abs(m.got-m.want) {
			perPos[p] = mismatch{p, i % vocab, float64(got[i]), float64(want[i])}
		}
	}
	ms := make([]mismatch, 0, len(perPos))
	for _, m := range perPos {
		ms = append(ms, m)
	}
	sort.Slice(ms, func(i, j int) bool { return math.Abs(ms[i].got-ms[i].want) > math.Abs(ms[j].got-ms[j].want) })
	var b strings.Builder
	for _, m := range ms[:min(5, len(ms))] {
		fmt.Fprintf(&b, "  position %d byte %d: %.6f, want %.6f (%.2g)\n", m.pos, m.tok, m.got, m.want, m.got-m.want)
	}
	return worst, b.String()
}

func TestForwardMatchesReference(t *testing.T) {
	w := testWeights(t)
	text := document(t)[:40]
	ref, err := w.Reference(text)
	require.NoError(t, err)
	got, err := w.Forward(text)
	require.NoError(t, err)
	require.Len(t, got, len(ref))
	// Without the fp16 rounding the two agree to about 3e-5; with it, a
	// key or value that float32 puts on the other side of an fp16
	// rounding boundary moves by one fp16 step, and logits by up to
	// about 2e-3. Most logits stay far closer.
	worst, report := compareLogits(got, ref, w.Config.Vocab)
	var sum float64
	for i := range got {
		sum += math.Abs(float64(got[i]) - ref[i])
	}
	mean := sum / float64(len(got))
	t.Logf("float32 forward vs float64 reference, %d bytes: max |Δlogit| %.3g, mean %.3g; worst positions:\n%s", len(text), worst, mean, report)
	require.Less(t, worst, 5e-3, report)
	require.Less(t, mean, 2e-4)

	_, err = w.Forward(nil)
	require.Error(t, err)
	_, err = w.Reference(nil)
	require.Error(t, err)
}

func TestRopeRotatesInterleavedPairs(t *testing.T) {
	x := make([]float32, 2*64)
	for i := range x {
		x[i] = float32(i%7) - 3
	}
	orig := append([]float32(nil), x...)
	rope(x, 2, 64, 5, 100000)
	for h := 0; h < 2; h++ {
		for i := 0; i < 32; i++ {
			th := 5 * math.Pow(100000, -float64(2*i)/64)
			a, b := float64(orig[h*64+2*i]), float64(orig[h*64+2*i+1])
			require.InDelta(t, a*math.Cos(th)-b*math.Sin(th), x[h*64+2*i], 1e-6)
			require.InDelta(t, a*math.Sin(th)+b*math.Cos(th), x[h*64+2*i+1], 1e-6)
		}
	}
}

func TestMatmulT(t *testing.T) {
	rng := rand.New(rand.NewSource(1))
	for _, s := range [][3]int{{1, 512, 128}, {3, 7, 5}, {130, 512, 1408}} {
		rows, in, out := s[0], s[1], s[2]
		x, w := make([]float32, rows*in), make([]float32, out*in)
		for i := range x {
			x[i] = rng.Float32() - 0.5
		}
		for i := range w {
			w[i] = rng.Float32() - 0.5
		}
		y := make([]float32, rows*out)
		matmulT(y, x, rows, in, w, out)
		for r := 0; r < rows; r++ {
			for o := 0; o < out; o++ {
				var s float64
				for i := 0; i < in; i++ {
					s += float64(x[r*in+i]) * float64(w[o*in+i])
				}
				require.InDelta(t, s, y[r*out+o], 1e-4)
			}
		}
	}
}

// BenchmarkMatmulT measures y = x Wᵀ at the prefill's shapes (a chunk of
// rows) and a decode step's.
func BenchmarkMatmulT(b *testing.B) {
	for _, s := range [][3]int{{chunkRows, 512, 1408}, {512, 512, 1408}, {chunkRows, 1408, 512}, {chunkRows, 512, 512}, {2, 512, 1408}} {
		rows, in, out := s[0], s[1], s[2]
		b.Run(fmt.Sprintf("%dx%dx%d", rows, in, out), func(b *testing.B) {
			rng := rand.New(rand.NewSource(1))
			x, w, y := make([]float32, rows*in), make([]float32, out*in), make([]float32, rows*out)
			for i := range x {
				x[i] = rng.Float32()
			}
			for i := range w {
				w[i] = rng.Float32()
			}
			b.ResetTimer()
			for range b.N {
				matmulT(y, x, rows, in, w, out)
			}
			b.ReportMetric(float64(2*rows*in*out)*float64(b.N)/b.Elapsed().Seconds()/1e9, "GFLOP/s")
		})
	}
}

// BenchmarkForwardChunk measures the CPU part of a prefill: every layer's
// products for a chunk of positions (no attention).
func BenchmarkForwardChunk(b *testing.B) {
	w := testWeights(b)
	text := document(b)[:chunkRows]
	s := newWork(w.Config, chunkRows)
	pos := make([]int, chunkRows)
	for i := range pos {
		pos[i] = i
	}
	b.ResetTimer()
	for range b.N {
		w.embed(s, text)
		for l := range w.Layers {
			if err := w.qkv(l, s, pos); err != nil {
				b.Fatal(err)
			}
			w.finish(l, s)
		}
		w.head(s)
	}
	b.ReportMetric(float64(chunkRows)*float64(b.N)/b.Elapsed().Seconds(), "tokens/s")
}

func TestForwardRejectsBadWeights(t *testing.T) {
	w := testWeights(t)
	short := *w
	short.Layers = append([]Layer(nil), w.Layers...)
	short.Layers[2].W3 = short.Layers[2].W3[:100]
	_, err := short.Forward([]byte("x"))
	require.ErrorContains(t, err, "blocks.2.w3 has 100 values")
	_, err = short.Reference([]byte("x"))
	require.Error(t, err)
	odd := *w
	odd.Config.Heads = 7
	_, err = odd.Forward([]byte("x"))
	require.ErrorContains(t, err, "unusable configuration")
}
