package evaluate

import (
	"math"
	"testing"

	"github.com/vksparse/vksparse/sparse"
)

func fracOK(x float64) bool { return x >= 0 && x <= 1 }

// FuzzTacticOptions checks TacticOptions.Validate against its rules: a
// target mass in (0, 1], no negative sinks or span, a positive cluster
// size and iteration count, fit fractions in [0, 1] and MaxWindow ≥ 0 (the
// zero fit included); nothing panics.
func FuzzTacticOptions(f *testing.F) {
	f.Add(4, 0, 16, 10, 512, 0.02, 0.1, 0.9)     // the defaults
	f.Add(4, 2048, 16, 10, 512, 0.02, 0.1, 0.5)  // spans of the recommended length
	f.Add(0, 0, 0, 0, 0, 0.0, 0.0, 0.9)          // zero counts
	f.Add(-1, 0, 16, 10, 0, 0.0, 0.0, 0.9)       // negative sinks
	f.Add(4, -5, 16, 10, 0, 0.0, 0.0, 0.9)       // negative span
	f.Add(4, 0, -16, 10, 0, 0.0, 0.0, 0.9)       // negative cluster size
	f.Add(4, 0, 16, -1, 0, 0.0, 0.0, 0.9)        // negative iterations
	f.Add(4, 0, 16, 10, -1, 0.02, 0.1, 0.9)      // negative MaxWindow
	f.Add(4, 0, 16, 10, 0, math.NaN(), 0.1, 0.9) // NaN fraction
	f.Add(1, 1, 1, 1, 0, 1.0, 1.0, math.NaN())   // NaN mass
	f.Add(math.MaxInt, math.MaxInt, 1, 1, 0, 0.0, 0.0, 1.0)
	f.Fuzz(func(t *testing.T, sinks, span, avg, iters, maxWindow int, initial, w1, p float64) {
		fit := sparse.TacticFit{InitialFrac: initial, Window1: w1, Window2: 0.4, WindowFrac: 0.02, MaxWindow: maxWindow}
		o := TacticOptions{Setup{P: []float64{0.5, p}, Sinks: sinks, AvgClusterSize: avg, KMeansIters: iters, KMeansSpan: span, Fit: fit}}
		ok := sinks >= 0 && span >= 0 && avg > 0 && iters >= 1 && p > 0 && p <= 1 && fracOK(initial) && fracOK(w1) && maxWindow >= 0
		if err := o.Validate(); (err == nil) != ok {
			t.Fatalf("TacticOptions%+v.Validate() = %v, want ok %v", o, err, ok)
		}
	})
}
