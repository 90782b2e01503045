package sparse

import (
	"encoding/binary"
	"math"
	"math/rand"
	"slices"
	"testing"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/vk/vktest"
)

// floatsOf reads little-endian float32 values from b (trailing bytes that
// make no whole value are dropped).
func floatsOf(b []byte) []float32 {
	out := make([]float32, len(b)/4)
	for i := range out {
		out[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
	}
	return out
}

func bytesOfFloats(f []float32) []byte {
	var b []byte
	for _, x := range f {
		b = binary.LittleEndian.AppendUint32(b, math.Float32bits(x))
	}
	return b
}

func allFinite(f []float32) bool {
	for _, x := range f {
		if math.IsNaN(float64(x)) || math.IsInf(float64(x), 0) {
			return false
		}
	}
	return true
}

// FuzzQueryCheck checks the device-free query check against its rule: a
// query is accepted exactly when it holds batch × heads × dim finite
// values.
func FuzzQueryCheck(f *testing.F) {
	ones := make([]float32, 16)
	for i := range ones {
		ones[i] = 1
	}
	f.Add(uint8(1), uint8(2), uint8(1), bytesOfFloats(ones))                                              // valid: 1 × 2 heads × 8
	f.Add(uint8(2), uint8(2), uint8(1), bytesOfFloats(ones))                                              // too short for a batch of 2
	f.Add(uint8(1), uint8(2), uint8(1), bytesOfFloats([]float32{float32(math.NaN()), 1}))                 // NaN
	f.Add(uint8(1), uint8(1), uint8(0), bytesOfFloats(append(make([]float32, 7), float32(math.Inf(-1))))) // −Inf
	f.Add(uint8(0), uint8(1), uint8(0), []byte{})                                                         // empty batch
	f.Fuzz(func(t *testing.T, batch, heads, dims uint8, data []byte) {
		h := Heads{Query: int(heads%8) + 1, KV: 1, Dim: 8 * (int(dims%4) + 1)}
		b := int(batch % 4)
		q := floatsOf(data)
		ok := len(q) == b*h.Query*h.Dim && allFinite(q)
		if err := checkQuery(q, b, h); (err == nil) != ok {
			t.Fatalf("checkQuery(%d values, batch %d, %+v) = %v, want ok %v", len(q), b, h, err, ok)
		}
	})
}

// FuzzSetQuery sends arbitrary queries to a plan on the device: an
// accepted query lands in the plan's query buffer as given, a refused one
// leaves the buffer as the last accepted query left it.
func FuzzSetQuery(f *testing.F) {
	h := Heads{Query: 2, KV: 1, Dim: 8}
	valid := make([]float32, h.Query*h.Dim)
	for i := range valid {
		valid[i] = float32(i) - 7.5
	}
	f.Add(bytesOfFloats(valid))
	f.Add(bytesOfFloats(valid[:5]))
	f.Add(bytesOfFloats(append(slices.Clone(valid), 1)))
	nan := slices.Clone(valid)
	nan[3] = float32(math.NaN())
	f.Add(bytesOfFloats(nan))
	inf := slices.Clone(valid)
	inf[15] = float32(math.Inf(1))
	f.Add(bytesOfFloats(inf))
	f.Add([]byte{})

	dev := vktest.Open(f)
	layer, err := kvcache.NewLayer(dev, h.KV, h.Dim, 4)
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { layer.Release() })
	one := make([]uint16, h.KV*h.Dim)
	if err := layer.Prefill(one, one, 1); err != nil {
		f.Fatal(err)
	}
	dense, err := NewDense(dev, h)
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { dense.Release() })
	plan, err := dense.Plan([]*kvcache.Layer{layer})
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { plan.Release() })
	last := make([]float32, len(valid))
	if err := plan.SetQuery(last); err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		q := floatsOf(data)
		err := plan.SetQuery(q)
		if (err == nil) != (len(q) == len(valid) && allFinite(q)) {
			t.Fatalf("SetQuery of %d values (finite %v) returned %v", len(q), allFinite(q), err)
		}
		if err == nil {
			last = slices.Clone(q)
		}
		got := make([]float32, len(valid))
		if err := plan.query.ReadFloat32(0, got); err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(got, last) {
			t.Fatalf("after SetQuery (error %v) the query buffer holds %v, want %v", err, got, last)
		}
	})
}

// fuzzIndex builds a small random cluster index over 48 tokens of 8
// dimensions (some clusters empty), the first 3 tokens fixed.
func fuzzIndex(seed int64) (q, keys []float64, idx *ClusterIndex, fixed []int32) {
	const n, d, c = 48, 8, 6
	rng := rand.New(rand.NewSource(seed))
	q = make([]float64, d)
	for i := range q {
		q[i] = rng.NormFloat64() * 2
	}
	keys = make([]float64, n*d)
	for i := range keys {
		keys[i] = rng.NormFloat64()
	}
	fixed = []int32{0, 1, 2}
	idx = &ClusterIndex{D: d, Centroids: make([]float64, c*d), Sizes: make([]int, c), Members: make([][]int32, c)}
	for t := int32(3); t < n; t++ {
		k := rng.Intn(c - 1) // the last cluster stays empty
		idx.Members[k] = append(idx.Members[k], t)
	}
	for k, mem := range idx.Members {
		idx.Sizes[k] = len(mem)
		for _, t := range mem {
			for i := 0; i < d; i++ {
				idx.Centroids[k*d+i] += keys[int(t)*d+i] / float64(len(mem))
			}
		}
	}
	return q, keys, idx, fixed
}

func fracOK(x float64) bool { return x >= 0 && x <= 1 }

// FuzzTacticFit checks the fit parameters' and the target mass's
// validation against their rules, and that any accepted set runs the
// float64 reference of the budget without a panic, with the budget and the
// sampling windows inside the clustered tokens.
func FuzzTacticFit(f *testing.F) {
	def := TacticCurveFit()
	f.Add(def.InitialFrac, def.Window1, def.Window2, def.WindowFrac, def.MaxWindow, 0.9, int64(1))
	f.Add(0.0, 0.0, 0.0, 0.0, 0, 1.0, int64(2))                  // every fraction zero, P = 1
	f.Add(1.0, 1.0, 1.0, 1.0, 1, 0.5, int64(3))                  // every fraction one
	f.Add(math.NaN(), 0.1, 0.4, 0.02, 512, 0.9, int64(4))        // NaN fraction
	f.Add(0.02, -0.1, 0.4, 0.02, 512, 0.9, int64(5))             // negative window
	f.Add(0.02, 0.1, 0.4, 0.02, -1, 0.9, int64(6))               // negative MaxWindow
	f.Add(0.02, 0.1, 0.4, 0.02, 512, 0.0, int64(7))              // P = 0
	f.Add(0.02, 0.1, 0.4, 0.02, 512, math.Inf(1), int64(8))      // P = +Inf
	f.Add(0.02, 0.1, math.Inf(1), 0.02, 512, 0.9, int64(9))      // infinite window
	f.Add(0.5, 0.99, 0.01, 1e-9, math.MaxInt, 1e-300, int64(10)) // extremes that are valid
	f.Fuzz(func(t *testing.T, initial, w1, w2, width float64, maxWindow int, p float64, seed int64) {
		fit := TacticFit{InitialFrac: initial, Window1: w1, Window2: w2, WindowFrac: width, MaxWindow: maxWindow}
		fitOK := fracOK(initial) && fracOK(w1) && fracOK(w2) && fracOK(width) && maxWindow >= 0
		if err := fit.validate(); (err == nil) != fitOK {
			t.Fatalf("validate(%+v) = %v, want ok %v", fit, err, fitOK)
		}
		pOK := p > 0 && p <= 1
		if err := checkP(p); (err == nil) != pOK {
			t.Fatalf("checkP(%v) = %v, want ok %v", p, err, pOK)
		}
		q, keys, idx, fixed := fuzzIndex(seed)
		b, err := TacticBudgetRef(q, 1/math.Sqrt(8), keys, idx, fixed, p, fit)
		if (err == nil) != (fitOK && pOK) {
			t.Fatalf("TacticBudgetRef(%+v, P %v) = %v, want ok %v", fit, p, err, fitOK && pOK)
		}
		if err != nil {
			return
		}
		if b.Budget < 0 || b.Budget > b.N || b.Selected < 0 || b.Selected > idx.Clusters() || b.SelectedTokens < b.Budget {
			t.Fatalf("%+v, P %v: budget %d of %d tokens, %d clusters covering %d tokens", fit, p, b.Budget, b.N, b.Selected, b.SelectedTokens)
		}
		need, win := windowPositions(fit, b.N)
		if need < 0 || need > b.N {
			t.Fatalf("%+v: exact part of %d tokens of %d", fit, need, b.N)
		}
		for k := 0; k < 2; k++ {
			if lo, hi := win[2*k], win[2*k+1]; lo < 1 || lo > hi || hi > b.N {
				t.Fatalf("%+v: window %d at [%d, %d] of %d tokens", fit, k, lo, hi, b.N)
			}
		}
	})
}

// FuzzPolicyOptions checks the decoder's options against their rules:
// zero values take the defaults, negative counts and out-of-range
// fractions are refused, nothing panics. (Package evaluate fuzzes the
// options of its evaluation.)
func FuzzPolicyOptions(f *testing.F) {
	f.Add(0, 0, 0, 0, 0, 0.0, 0.0)         // all defaults
	f.Add(4, 2048, 16, 10, 512, 0.02, 0.1) // explicit defaults
	f.Add(-1, 0, 0, 0, 0, 0.0, 0.0)        // negative sinks
	f.Add(0, -5, 0, 0, 0, 0.0, 0.0)        // negative recluster
	f.Add(0, 0, -16, 0, 0, 0.0, 0.0)       // negative cluster size
	f.Add(0, 0, 0, -1, 0, 0.0, 0.0)        // negative iterations
	f.Add(0, 0, 0, 0, -1, 0.02, 0.1)       // negative MaxWindow
	f.Add(0, 0, 0, 0, 0, math.NaN(), 0.1)  // NaN fraction
	f.Add(1, 1, 1, 1, 0, 1.0, 1.0)         // every fraction one
	f.Add(math.MaxInt, math.MaxInt, 1, 1, 0, 0.0, 0.0)
	f.Fuzz(func(t *testing.T, sinks, recluster, avg, iters, maxWindow int, initial, w1 float64) {
		fit := TacticFit{InitialFrac: initial, Window1: w1, Window2: 0.4, WindowFrac: 0.02, MaxWindow: maxWindow}
		if fit == (TacticFit{Window2: 0.4, WindowFrac: 0.02}) {
			fit = TacticFit{} // let the zero value stand for the default
		}
		o := TacticDecoderOptions{Sinks: sinks, Recluster: recluster, KMeans: KMeansOptions{AvgClusterSize: avg, MaxIter: iters}, Fit: fit}
		r, err := o.resolve()
		fitOK := fit == (TacticFit{}) || (fracOK(initial) && fracOK(w1) && maxWindow >= 0)
		ok := sinks >= 0 && recluster >= 0 && avg >= 0 && iters >= 0 && fitOK
		if (err == nil) != ok {
			t.Fatalf("resolve(%+v) = %v, want ok %v", o, err, ok)
		}
		if err == nil && (r.Sinks <= 0 || r.Recluster <= 0 || r.Fit == (TacticFit{}) || (sinks != 0 && r.Sinks != sinks) || (recluster != 0 && r.Recluster != recluster)) {
			t.Fatalf("resolve(%+v) gave %+v", o, r)
		}
	})
}
