package sparsetest_test

import (
	"testing"

	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/sparse/sparsetest"
)

// TestRunStreaming runs the suite on its own device over StreamingLLM's
// step, a policy as a package outside sparse would describe it.
func TestRunStreaming(t *testing.T) {
	const budget = 100
	sparsetest.Run(t, sparsetest.Policy{
		Heads:   sparse.Heads{Query: 4, KV: 1, Dim: 32},
		Lengths: []int{69, 301},
		New: func(in *sparsetest.Inputs) (sparsetest.Step, error) {
			return sparse.NewStreamingStep(in.Dense, in.Layer, budget)
		},
		Reference: func(in *sparsetest.Inputs, _ sparsetest.Step, q []float32) ([]float64, error) {
			keys, values := in.KV(0)
			outs, _, err := sparse.StreamingDecodeRef(in.QueryHeads(q, 0), keys, values, in.Scale, sparse.DefaultBaselineLayout(), budget)
			var want []float64
			for _, o := range outs {
				want = append(want, o...)
			}
			return want, err
		},
		Batch: func(dense *sparse.Dense, steps []sparsetest.Step) (sparsetest.Batch, error) {
			ss := make([]*sparse.Step, len(steps))
			for i, s := range steps {
				ss[i] = s.(*sparse.Step)
			}
			return sparse.NewBatch(dense, ss)
		},
	})
}

var _ sparsetest.Step = (*sparse.DensePlan)(nil)
var _ sparsetest.Step = (*sparse.LuKAStep)(nil)
var _ sparsetest.Step = (*sparse.TacticStep)(nil)
