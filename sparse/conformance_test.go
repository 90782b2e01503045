package sparse_test

import (
	"errors"
	"fmt"
	"testing"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/sparse/sparsetest"
	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/vk/vktest"
)

// TestConforms runs every policy's step through the conformance suite
// (package sparsetest) over one set of kernels: its output against its
// float64 reference at a few lengths, poisoned first, counters at rest,
// determinism, refused input, batches and release. The tests beside each
// policy check what is its own: its selection, stage by stage.
func TestConforms(t *testing.T) {
	dev := vktest.Open(t)
	dense, err := sparse.NewDense(dev, sparse.Heads{Query: 8, KV: 2, Dim: 64})
	if err != nil {
		t.Fatal(err)
	}
	defer dense.Release()
	for _, c := range []struct {
		name   string
		policy sparsetest.Policy
	}{
		{"Dense", densePolicy()}, {"Quest", questPolicy()}, {"Streaming", streamingPolicy()}, {"H2O", h2oPolicy()},
		{"TokenOracle", tokenOraclePolicy()}, {"ClusterOracle", clusterOraclePolicy()}, {"Tactic", tacticPolicy()},
		{"DoubleP", doublePPolicy()}, {"Delta", deltaPolicy()}, {"LuKA", lukaPolicy()},
	} {
		t.Run(c.name, func(t *testing.T) { sparsetest.RunOn(t, dev, dense, c.policy) })
	}
}

func densePolicy() sparsetest.Policy {
	return sparsetest.Policy{
		Lengths: []int{1, 67, 1025},
		New: func(in *sparsetest.Inputs) (sparsetest.Step, error) {
			return in.Dense.Plan([]*kvcache.Layer{in.Layer})
		},
		Reference: func(in *sparsetest.Inputs, _ sparsetest.Step, q []float32) ([]float64, error) {
			return sparse.DenseRef(in.Heads, q, in.K, in.V, in.N, in.Scale)
		},
		Idle: idle,
	}
}

func questPolicy() sparsetest.Policy {
	return sparsetest.Policy{
		Lengths: []int{70, 1001},
		New: func(in *sparsetest.Inputs) (sparsetest.Step, error) {
			return sparse.NewQuestStep(in.Dense, in.Layer, min(200, in.N))
		},
		Reference: selectionRef,
		Idle:      idle,
		Scratch:   scratch,
		Batch:     batch,
	}
}

func streamingPolicy() sparsetest.Policy {
	const budget = 300
	return sparsetest.Policy{
		Lengths: []int{69, 1001}, // 69: one middle token
		New: func(in *sparsetest.Inputs) (sparsetest.Step, error) {
			return sparse.NewStreamingStep(in.Dense, in.Layer, budget)
		},
		Reference: func(in *sparsetest.Inputs, _ sparsetest.Step, q []float32) ([]float64, error) {
			var want []float64
			for g := 0; g < in.Heads.KV; g++ {
				keys, values := in.KV(g)
				outs, _, err := sparse.StreamingDecodeRef(in.QueryHeads(q, g), keys, values, in.Scale, sparse.DefaultBaselineLayout(), budget)
				if err != nil {
					return nil, err
				}
				for _, o := range outs {
					want = append(want, o...)
				}
			}
			return want, nil
		},
		Idle:  idle,
		Batch: batch,
	}
}

func h2oPolicy() sparsetest.Policy {
	return sparsetest.Policy{
		Lengths: []int{70, 1001},
		New: func(in *sparsetest.Inputs) (sparsetest.Step, error) {
			return sparse.NewH2OStep(in.Dense, in.Layer, min(121, in.N))
		},
		Reference: selectionRef,
		Idle:      idle,
		Scratch:   scratch,
		Batch:     batch,
	}
}

func tokenOraclePolicy() sparsetest.Policy {
	return sparsetest.Policy{
		Lengths: []int{701},
		New: func(in *sparsetest.Inputs) (sparsetest.Step, error) {
			return sparse.NewTokenOracleStep(in.Dense, in.Layer, 0.9)
		},
		Reference: selectionRef,
		Idle:      idle,
		Scratch:   scratch,
	}
}

func clusterOraclePolicy() sparsetest.Policy {
	return sparsetest.Policy{
		Lengths: []int{701},
		Prepare: clustered,
		New: func(in *sparsetest.Inputs) (sparsetest.Step, error) {
			return sparse.NewClusterOracleStep(in.Dense, in.Layer, in.Prepared.(*kvcache.Clusters), 0.9)
		},
		Reference: selectionRef,
		Idle:      idle,
		Scratch:   scratch,
	}
}

// clustered prepares a layer for the clustered policies: K-means over
// the tokens between 4 sinks and a tail of 64, the layer reordered.
func clustered(in *sparsetest.Inputs) (any, error) {
	km, err := sparse.NewKMeans(in.Dev, in.Heads.KV, in.Heads.Dim)
	if err != nil {
		return nil, err
	}
	defer km.Release()
	x, err := km.Cluster(in.Layer, 4, in.N-68, sparse.KMeansOptions{Seed: uint64(in.Seed)})
	if err != nil {
		return nil, err
	}
	if err := in.Layer.Reorder(x); err != nil {
		return nil, errors.Join(err, x.Release())
	}
	return x, nil
}

func tacticPolicy() sparsetest.Policy {
	return sparsetest.Policy{
		Lengths: []int{300, 1025},
		Prepare: clustered,
		New: func(in *sparsetest.Inputs) (sparsetest.Step, error) {
			return sparse.NewTacticStep(in.Dense, in.Layer, in.Prepared.(*kvcache.Clusters), 0.9, sparse.DefaultTacticFit())
		},
		Reference: selectionRef,
		Idle:      idle,
		Scratch:   scratch,
		Batch:     batch,
	}
}

func doublePPolicy() sparsetest.Policy {
	return sparsetest.Policy{
		Lengths: []int{300, 1001},
		Prepare: clustered,
		New: func(in *sparsetest.Inputs) (sparsetest.Step, error) {
			return sparse.NewDoublePStep(in.Dense, in.Layer, in.Prepared.(*kvcache.Clusters), sparse.DefaultDoubleP())
		},
		Reference: doublePRef,
		Idle:      idle,
		Scratch:   scratch,
		Batch:     batch,
	}
}

func deltaPolicy() sparsetest.Policy {
	return sparsetest.Policy{
		Lengths: []int{17, 1001},
		New: func(in *sparsetest.Inputs) (sparsetest.Step, error) {
			return newDeltaStep(in, sparse.Delta{Pages: 16, Recent: 4, PageSize: sparse.QuestPageSize})
		},
		Reference: selectionRef,
		Idle:      idle,
	}
}

func lukaPolicy() sparsetest.Policy {
	opts := sparse.LuKA{Segment: 7, Recent: 40, Every: 4, Compressor: sparse.LuKAWeighted, Tau: 0.05, Rule: sparse.RefineTopK, K: 3}
	return sparsetest.Policy{
		Lengths: []int{1, 701},
		New: func(in *sparsetest.Inputs) (sparsetest.Step, error) {
			return sparse.NewLuKAStep(in.Dense, in.Layer, opts)
		},
		Reference: lukaRef,
		Idle:      idle,
		Scratch:   scratch,
	}
}

func idle(s sparsetest.Step) []vk.Range    { return sparse.IdleRanges(s) }
func scratch(s sparsetest.Step) []vk.Range { return sparse.ScratchRanges(s) }

// stepOf returns the sparse.Step of s.
func stepOf(s sparsetest.Step) *sparse.Step {
	switch s := s.(type) {
	case *sparse.Step:
		return s
	case *sparse.TacticStep:
		return s.Step
	case *deltaStep:
		return s.Step
	}
	panic(fmt.Sprintf("no sparse.Step in %T", s))
}

// batch batches steps of a policy whose steps are sparse.Steps.
func batch(dense *sparse.Dense, steps []sparsetest.Step) (sparsetest.Batch, error) {
	ss := make([]*sparse.Step, len(steps))
	for i, s := range steps {
		ss[i] = stepOf(s)
	}
	return sparse.NewBatch(dense, ss)
}

// selectionRef returns the reference of a step whose selection (no
// approximation) just ran: SelectionGroupRef over the ranks and cuts its
// kernels wrote, every token outside the index attended.
func selectionRef(in *sparsetest.Inputs, s sparsetest.Step, q []float32) ([]float64, error) {
	sel := stepOf(s).Selector().Selection()
	x, h := sel.Clusters, in.Heads
	ranks, err := readInts(sel.Rank, h.Query*x.C)
	if err != nil {
		return nil, err
	}
	cuts, err := readInts(sel.Cut, h.Query)
	if err != nil {
		return nil, err
	}
	var fixed []int32
	for tok := 0; tok < in.N; tok++ {
		if tok < x.First || tok >= x.First+x.Count {
			fixed = append(fixed, int32(tok))
		}
	}
	var want []float64
	for g := 0; g < h.KV; g++ {
		idx, err := hostIndex(x, g)
		if err != nil {
			return nil, err
		}
		var rs [][]int
		for hh := g * h.Group(); hh < (g+1)*h.Group(); hh++ {
			rs = append(rs, ranks[hh*x.C:(hh+1)*x.C])
		}
		keys, values := in.KV(g)
		outs, _, err := sparse.SelectionGroupRef(in.QueryHeads(q, g), keys, values, in.Scale, idx, fixed, rs, cuts[g*h.Group():(g+1)*h.Group()])
		if err != nil {
			return nil, err
		}
		for _, o := range outs {
			want = append(want, o...)
		}
	}
	return want, nil
}

// doublePRef returns DoublePGroupRef over the logits, bins and cuts the
// step's selection just wrote, with the clusters' mean values in fp16.
func doublePRef(in *sparsetest.Inputs, s sparsetest.Step, q []float32) ([]float64, error) {
	sel := stepOf(s).Selector().(*sparse.DoublePSelector)
	x, h := sel.Selection().Clusters, in.Heads
	logits, err := sel.Logits()
	if err != nil {
		return nil, err
	}
	bins, err := sel.Bins()
	if err != nil {
		return nil, err
	}
	exact, keep, err := sel.Cuts()
	if err != nil {
		return nil, err
	}
	fixed, err := sparse.TacticFixedTokens(x.First, x.First+x.Count, in.N-1)
	if err != nil {
		return nil, err
	}
	var want []float64
	for g := 0; g < h.KV; g++ {
		idx, err := hostIndex(x, g)
		if err != nil {
			return nil, err
		}
		keys, values := in.KV(g)
		means, err := toHalves(sparse.ClusterValueMeansRef(values, h.Dim, idx))
		if err != nil {
			return nil, err
		}
		var ls [][]float64
		var rs [][]int
		for hh := g * h.Group(); hh < (g+1)*h.Group(); hh++ {
			row := make([]float64, x.C)
			for c, v := range logits[hh*x.C : (hh+1)*x.C] {
				row[c] = float64(v)
			}
			ls, rs = append(ls, row), append(rs, bins[hh*x.C:(hh+1)*x.C])
		}
		gh := func(c []int) []int { return c[g*h.Group() : (g+1)*h.Group()] }
		outs, _, _, err := sparse.DoublePGroupRef(in.QueryHeads(q, g), keys, values, in.Scale, idx, fixed, means, ls, rs, gh(exact), gh(keep))
		if err != nil {
			return nil, err
		}
		for _, o := range outs {
			want = append(want, o...)
		}
	}
	return want, nil
}

// lukaRef returns LuKAAttendRef of every query head over the summaries
// and the refinement the step just used.
func lukaRef(in *sparsetest.Inputs, s sparsetest.Step, q []float32) ([]float64, error) {
	step := s.(*sparse.LuKAStep)
	h, opts := in.Heads, step.Options()
	refined, err := step.Refined()
	if err != nil {
		return nil, err
	}
	sk, sv, err := step.SummaryRows()
	if err != nil {
		return nil, err
	}
	n, d := step.Summaries(), h.Dim
	var want []float64
	for hh := 0; hh < h.Query; hh++ {
		g := hh / h.Group()
		keys, values := in.KV(g)
		out, _, _, err := sparse.LuKAAttendRef(in.QueryHeads(q, g)[hh%h.Group()], keys, values,
			sparse.HalvesToFloat64(sk[g*n*d:(g+1)*n*d]), sparse.HalvesToFloat64(sv[g*n*d:(g+1)*n*d]), d, opts.Segment, in.Scale, opts.SummaryBias(), refined[hh])
		if err != nil {
			return nil, err
		}
		want = append(want, out...)
	}
	return want, nil
}

// deltaStep is a layer after a Δ-layer over the same cache, the two in one
// submission: the Δ-layer's dense attention writing its logits, its page
// scores and its pick, then the step attending the pick.
type deltaStep struct {
	*sparse.Step
	dev      *vk.Device
	plan     *sparse.DensePlan
	pages    *sparse.DeltaPages
	pick     *sparse.DeltaSelect
	released bool
}

func newDeltaStep(in *sparsetest.Inputs, opts sparse.Delta) (*deltaStep, error) {
	s := &deltaStep{dev: in.Dev}
	var err error
	if s.plan, err = in.Dense.PlanLogits(in.Layer); err == nil {
		if s.pages, err = sparse.NewDeltaPages(s.plan, opts.PageSize); err == nil {
			pages := (in.N - 1) / opts.PageSize
			if s.pick, err = sparse.NewDeltaSelect(in.Dense, s.pages.Pages().All(), pages, opts.Pages, opts.Recent, opts.PageSize); err == nil {
				s.Step, err = sparse.NewDeltaReuseStep(in.Dense, in.Layer, s.pick)
			}
		}
	}
	if err != nil {
		return nil, errors.Join(err, s.Release())
	}
	return s, nil
}

func (s *deltaStep) SetQuery(q []float32) error {
	if s.released {
		return vk.ErrReleased
	}
	if err := s.plan.SetQuery(q); err != nil {
		return err
	}
	return s.Step.SetQuery(q)
}

func (s *deltaStep) Record(c *vk.Commands) error {
	if s.released {
		return vk.ErrReleased
	}
	for _, r := range []func(*vk.Commands) error{s.plan.Record, s.pages.Record, s.pick.Record} {
		if err := r(c); err != nil {
			return err
		}
		c.ComputeBarrier()
	}
	return s.Step.Record(c)
}

func (s *deltaStep) Attend(q []float32) ([]float32, error) {
	if err := s.SetQuery(q); err != nil {
		return nil, err
	}
	if err := s.Rebalance(); err != nil {
		return nil, err
	}
	c, err := s.dev.NewCommands()
	if err != nil {
		return nil, err
	}
	defer c.Release()
	if err := c.Begin(); err != nil {
		return nil, err
	}
	if err := s.Record(c); err != nil {
		return nil, errors.Join(err, c.End())
	}
	if err := c.End(); err != nil {
		return nil, err
	}
	if err := c.Submit(); err != nil {
		return nil, err
	}
	o := s.OutputRange()
	out := make([]float32, len(q))
	return out, o.Buffer.ReadFloat32(o.Offset, out)
}

func (s *deltaStep) Release() error {
	if s.released {
		return vk.ErrReleased
	}
	s.released = true
	var errs []error
	if s.Step != nil {
		errs = append(errs, s.Step.Release())
	}
	for _, r := range []interface{ Release() error }{s.pick, s.pages, s.plan} {
		if r != nil {
			errs = append(errs, r.Release())
		}
	}
	return errors.Join(errs...)
}

// hostIndex reads KV head g's index back as a ClusterIndex.
func hostIndex(x *kvcache.Clusters, g int) (*sparse.ClusterIndex, error) {
	hc, err := x.Read(g)
	if err != nil {
		return nil, err
	}
	cent := make([]float64, len(hc.Centroids))
	for i, v := range hc.Centroids {
		cent[i] = float64(v)
	}
	idx := &sparse.ClusterIndex{D: x.HeadDim, Centroids: cent, Members: hc.Members}
	for _, m := range hc.Members {
		idx.Sizes = append(idx.Sizes, len(m))
	}
	return idx, nil
}

// readInts reads n uint32 words of r.
func readInts(r vk.Range, n int) ([]int, error) {
	w := make([]uint32, n)
	if err := r.Buffer.ReadUint32(r.Offset, w); err != nil {
		return nil, err
	}
	out := make([]int, n)
	for i, x := range w {
		out[i] = int(x)
	}
	return out, nil
}

// toHalves rounds x to fp16 and back.
func toHalves(x []float64) ([]float64, error) {
	f := make([]float32, len(x))
	for i, v := range x {
		f[i] = float32(v)
	}
	h, err := kvcache.ToHalves(f)
	if err != nil {
		return nil, err
	}
	return sparse.HalvesToFloat64(h), nil
}
