package sparse

import (
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/shaders"
	"github.com/vksparse/vksparse/vk"
)

// TacticStep is the GPU part of a Tactic decode step for one sequence
// whose tokens [sinks, sinks+clustered) are clustered: centroid scoring,
// the union over each GQA group of the clusters its query heads select
// (score ≥ the head's threshold) together with the sinks and the recent
// tail, and gathered attention over that union. Every stage runs on the
// device in one submission. The thresholds, which the distribution fitting
// of TacticBudgetRef decides, are inputs here: the fitting kernel that will
// compute them on the device is not written yet.
type TacticStep struct {
	dense    *Dense
	layer    *kvcache.Layer
	clusters *kvcache.Clusters
	sinks    int
	plan     *DensePlan // gathered attention over the lists
	score    *vk.Pipeline
	sel      *vk.Pipeline
	scores   *vk.Buffer // float32 [Hq][C]
	thresh   *vk.Buffer // float32 [Hq]
	bScore   *vk.Binding
	bSelect  *vk.Binding
	clock    stopwatch
}

// NewTacticStep prepares decode steps over layer, whose tokens
// [clusters.First, clusters.First+clusters.Count) are clustered and whose
// tokens before clusters.First are the sinks.
func NewTacticStep(dense *Dense, layer *kvcache.Layer, clusters *kvcache.Clusters) (*TacticStep, error) {
	h := dense.heads
	if clusters.KVHeads != h.KV || clusters.HeadDim != h.Dim {
		return nil, fmt.Errorf("sparse: clusters of %d heads of %d for kernels of %d of %d", clusters.KVHeads, clusters.HeadDim, h.KV, h.Dim)
	}
	if clusters.First+clusters.Count > layer.Len() {
		return nil, fmt.Errorf("sparse: clustered tokens [%d, %d) beyond the %d stored", clusters.First, clusters.First+clusters.Count, layer.Len())
	}
	t := &TacticStep{dense: dense, layer: layer, clusters: clusters, sinks: clusters.First}
	var err error
	if t.plan, err = dense.PlanGather(layer, layer.Capacity()); err != nil {
		return nil, err
	}
	dev := dense.dev
	build := func(name string, bindings, push int, spec []uint32) *vk.Pipeline {
		if err != nil {
			return nil
		}
		var code []byte
		if code, err = shaders.SPIRV(name); err != nil {
			return nil
		}
		var p *vk.Pipeline
		p, err = dev.NewPipeline(vk.Kernel{Name: name, SPIRV: code, Bindings: bindings, PushWords: push, Specialization: spec})
		return p
	}
	t.score = build("tactic_score", 3, 3, []uint32{uint32(h.Dim)})
	t.sel = build("tactic_select", 8, 9, nil)
	if err == nil {
		t.scores, err = dev.NewBuffer(uint64(h.Query*clusters.C)*4, vk.DeviceLocal)
	}
	if err == nil {
		t.thresh, err = dev.NewBuffer(uint64(h.Query)*4, vk.DeviceLocal)
	}
	if err == nil {
		t.bScore, err = t.score.Bind(t.plan.query.All(), clusters.Centroids.All(), t.scores.All())
	}
	if err == nil {
		t.bSelect, err = t.sel.Bind(t.scores.All(), t.thresh.All(), clusters.Starts.All(), clusters.Counts.All(), clusters.Members.All(),
			t.plan.Tokens().All(), t.plan.TokenCounts().All(), t.plan.ChunkCounts().All())
	}
	if err != nil {
		t.Release()
		return nil, err
	}
	return t, nil
}

// Release frees what the step owns (not the layer, clusters or kernels).
func (t *TacticStep) Release() error {
	t.clock.release()
	var errs []error
	for _, r := range []interface{ Release() error }{t.bScore, t.bSelect, t.score, t.sel, t.scores, t.thresh, t.plan} {
		if r != nil {
			errs = append(errs, r.Release())
		}
	}
	return errors.Join(errs...)
}

// SetThresholds sets each query head's score threshold: a cluster c is
// selected by head h when scale·q_h·centroid_c ≥ th[h].
func (t *TacticStep) SetThresholds(th []float32) error {
	if len(th) != t.dense.heads.Query {
		return fmt.Errorf("sparse: %d thresholds for %d query heads", len(th), t.dense.heads.Query)
	}
	for i, x := range th {
		if math.IsNaN(float64(x)) {
			return fmt.Errorf("sparse: threshold %d is NaN", i)
		}
	}
	return t.thresh.WriteFloat32(0, th)
}

// SetQuery uploads the query, [Hq][D].
func (t *TacticStep) SetQuery(q []float32) error { return t.plan.SetQuery(q) }

// Record appends the step's kernels to c.
func (t *TacticStep) Record(c *vk.Commands) error {
	h, x := t.dense.heads, t.clusters
	cc := uint32(x.C)
	c.Dispatch(t.score, t.bScore, []uint32{cc, uint32(h.Group()), math.Float32bits(float32(1 / math.Sqrt(float64(h.Dim))))}, uint32(ceilDiv(x.C, 64)), uint32(h.Query), 1)
	n := t.layer.Len()
	end := x.First + x.Count
	push := func(pass uint32) []uint32 {
		return []uint32{pass, cc, uint32(h.Group()), uint32(t.sinks), uint32(end), uint32(n), uint32(t.plan.gatherStride), uint32(t.plan.GatherChunk()), uint32(x.Count)}
	}
	kv := uint32(h.KV)
	c.Dispatch(t.sel, t.bSelect, push(0), uint32(ceilDiv(max(1, t.sinks+n-end), 64)), kv, 1)
	c.Barrier()
	c.Dispatch(t.sel, t.bSelect, push(1), uint32(ceilDiv(x.C, 64)), kv, 1)
	c.Barrier()
	c.Dispatch(t.sel, t.bSelect, push(2), 1, kv, 1)
	c.Barrier()
	return t.plan.Record(c)
}

// Attend runs a step for the query q ([Hq][D]) and returns the output.
func (t *TacticStep) Attend(q []float32) ([]float32, error) {
	if err := t.SetQuery(q); err != nil {
		return nil, err
	}
	if err := runOnce(t.dense.dev, t.Record); err != nil {
		return nil, err
	}
	out := make([]float32, len(q))
	return out, t.plan.Output().ReadFloat32(0, out)
}

// Scores returns the centroid scores of the last step, [Hq][C].
func (t *TacticStep) Scores() ([]float32, error) {
	s := make([]float32, t.dense.heads.Query*t.clusters.C)
	return s, t.scores.ReadFloat32(0, s)
}

// Tokens returns the token list of each KV head of the last step.
func (t *TacticStep) Tokens() ([][]int32, error) {
	h := t.dense.heads
	counts := make([]uint32, h.KV)
	if err := t.plan.TokenCounts().ReadUint32(0, counts); err != nil {
		return nil, err
	}
	out := make([][]int32, h.KV)
	for g := range out {
		raw := make([]uint32, counts[g])
		if err := t.plan.Tokens().ReadUint32(uint64(g*t.plan.gatherStride)*4, raw); err != nil {
			return nil, err
		}
		for _, x := range raw {
			out[g] = append(out[g], int32(x))
		}
	}
	return out, nil
}

// Time records warmup+reps back-to-back steps in one submission and
// returns the timed ones' GPU times, sorted (as DensePlan.Time).
func (t *TacticStep) Time(warmup, reps int) ([]time.Duration, error) {
	return t.clock.time(t.dense.dev, warmup, reps, t.Record)
}
