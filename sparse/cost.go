package sparse

import (
	"errors"
	"fmt"
	"math"
	"sync"
	"time"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/shaders"
	"github.com/vksparse/vksparse/vk"
)

// Cost is what one sequence's step of a layer costs the device: the
// dependent dispatches it runs (each waits for the one before), the bytes
// it reads from memory, and the tokens stored in the layer it attends
// over (its context).
type Cost struct {
	Dispatches int     `json:"dispatches"`
	Bytes      float64 `json:"bytes"`
	Tokens     int     `json:"tokens,omitempty"`
}

// CostModel prices a Cost on a device: every dependent dispatch pays
// FloorUs before any work, every token of the context TokenNs (the
// selection's and attention's chains that grow with the context, not with
// what is read: scores, binning, runs), and the bytes stream at ReadGBps
// (10⁹ bytes a second). The step costs Dispatches·FloorUs +
// Tokens·TokenNs/10³ + Bytes/(ReadGBps·10³) µs. A device's model
// (Calibrate) has TokenNs 0.
type CostModel struct {
	FloorUs  float64 `json:"floor_us"`
	ReadGBps float64 `json:"read_gb_per_s"`
	TokenNs  float64 `json:"token_ns,omitempty"`
}

// Validate refuses a floor or a cost per token that is negative or not
// finite and a bandwidth that is not positive and finite.
func (m CostModel) Validate() error {
	if !(m.FloorUs >= 0) || math.IsInf(m.FloorUs, 0) || !(m.ReadGBps > 0) || math.IsInf(m.ReadGBps, 0) || !(m.TokenNs >= 0) || math.IsInf(m.TokenNs, 0) {
		return fmt.Errorf("sparse: a cost model of %v µs a dispatch, %v ns a token and %v GB/s: the floor and the cost per token must be ≥ 0 and the bandwidth > 0, all finite", m.FloorUs, m.TokenNs, m.ReadGBps)
	}
	return nil
}

// Us returns what c costs under the model, in µs.
func (m CostModel) Us(c Cost) float64 {
	return float64(c.Dispatches)*m.FloorUs + float64(c.Tokens)*m.TokenNs/1e3 + c.Bytes/(m.ReadGBps*1e3)
}

// PerSequence returns the model of one sequence's part of a step whose
// dispatches n sequences share: the floor per dispatch divided among
// them (n below 1 counts as 1).
func (m CostModel) PerSequence(n int) CostModel {
	m.FloorUs /= float64(max(1, n))
	return m
}

// rowBytes is the bytes of one fp16 row of keys (or values) of a KV head.
func (h Heads) rowBytes() float64 { return float64(2 * h.Dim) }

// AttentionBytes returns what attention reads when each KV head attends
// rows rows: their fp16 keys and values.
func (h Heads) AttentionBytes(rows float64) float64 {
	return 2 * rows * float64(h.KV) * h.rowBytes()
}

// DenseCost returns dense attention's cost over tokens tokens: one
// dispatch (DensePlan.Record) reading every key and value row.
func (h Heads) DenseCost(tokens int) Cost {
	return Cost{Dispatches: 1, Bytes: h.AttentionBytes(float64(tokens)), Tokens: tokens}
}

// selectionReader is a selector that counts the bytes its stages read in
// one step.
type selectionReader interface {
	selectionBytes() float64
}

// selectionBytes returns what sel's stages read in one step: its own count
// where it keeps one, otherwise the 8-bit centroids of its index and one
// float32 score per query head and cluster (a lower bound).
func selectionBytes(sel Selector, h Heads) float64 {
	if r, ok := sel.(selectionReader); ok {
		return r.selectionBytes()
	}
	x := sel.Selection().Clusters
	if x == nil {
		return 0
	}
	return CentroidBytes(h, x.C)
}

// CentroidBytes returns what scoring c clusters per KV head reads: their
// 8-bit centroids with their row and dimension scales
// (kvcache.CodedHeadBytes a KV head), and one float32 score per query head
// and cluster read back by the stage after.
func CentroidBytes(h Heads, c int) float64 {
	return float64(h.KV*kvcache.CodedHeadBytes(c, h.Dim)) + float64(4*h.Query*c)
}

// Cost returns the cost of the last step that ran: its stages (Stages)
// and the bytes its selection and its attention read, the attention's
// from the rows the step attended (Attended; ask before appending).
func (s *Step) Cost() (Cost, error) {
	rows, err := s.Attended()
	if err != nil {
		return Cost{}, err
	}
	h := s.dense.heads
	return Cost{Dispatches: len(s.Stages()), Bytes: selectionBytes(s.sel, h) + h.AttentionBytes(rows), Tokens: s.layer.Len()}, nil
}

// IndexedShare returns the share of its index's tokens that the last
// step that ran attended for a KV head, mean over KV heads (the members
// of the clusters its heads took, and the pseudo-tokens), in [0, 1] for
// an index of tokens; 0 for an empty index.
func (s *Step) IndexedShare() (float64, error) {
	if s.plan == nil {
		return 0, vk.ErrReleased
	}
	taken, err := s.plan.Taken()
	if err != nil {
		return 0, err
	}
	x := s.plan.index()
	if x == nil || x.Count == 0 || len(taken) == 0 {
		return 0, nil
	}
	sum := 0.0
	for _, t := range taken {
		sum += float64(t)
	}
	return sum / float64(len(taken)) / float64(x.Count), nil
}

// selectionBytes: Quest reads its pages' fp16 key bounds (lo and hi); the
// oracle reads every stored key. Both read back a score per query head
// and row.
func (s *binSelector) selectionBytes() float64 {
	h := s.dense.heads
	rows := s.rowCount()
	read := float64(rows) * float64(h.KV) * h.rowBytes()
	if s.kind == scoreBounds {
		read *= 2
	}
	return read + float64(4*h.Query*rows)
}

// selectionBytes: StreamingLLM's choice is fixed when it is built.
func (s *StreamingSelector) selectionBytes() float64 { return 0 }

// selectionBytes: H2O reads, per query head and indexed token, the logit
// its last attention recorded and the accumulated attention.
func (s *H2OSelector) selectionBytes() float64 {
	return float64(2 * 4 * s.dense.heads.Query * s.tokens.C)
}

// selectionBytes: Double-P scores its 8-bit centroids, then cuts over the
// scores.
func (s *DoublePSelector) selectionBytes() float64 {
	return CentroidBytes(s.dense.heads, s.Selection().Clusters.C)
}

// FitCostModel returns the cost model through two measurements of one
// kind of step, a step of cost a taking aUs µs and one of cost b taking
// bUs (same dispatches), with fallback's bandwidth (the device's): what
// the bytes do not explain, r = us − Bytes/bandwidth, is a floor per
// dispatch and a cost per token through both points, TokenNs = (r_b −
// r_a)/(Tokens_b − Tokens_a) with b the longer context. Measured at two
// lengths of a workload whose share of selected tokens changes with the
// length, a line through the bytes alone would charge the bytes what the
// chains cost (Double-P priced at 1.33× dense attention where it took
// 0.92×, bench/README.md). Where the contexts are equal or the longer one
// is left with less, TokenNs is 0 and the floor what is left of b; where
// the floor would come out negative it is 0, and TokenNs what is left of
// b per token; where b took less than its bytes at that bandwidth, the
// bandwidth is the one that prices b at bUs. The model prices b at bUs
// in every case.
func FitCostModel(a Cost, aUs float64, b Cost, bUs float64, fallback CostModel) (CostModel, error) {
	if a.Tokens > b.Tokens {
		a, aUs, b, bUs = b, bUs, a, aUs
	}
	if a.Dispatches != b.Dispatches || a.Dispatches <= 0 || !(aUs > 0) || !(bUs > 0) || math.IsInf(aUs, 0) || math.IsInf(bUs, 0) || !(a.Bytes >= 0) || !(b.Bytes >= 0) || a.Tokens < 0 {
		return CostModel{}, fmt.Errorf("sparse: fitting a cost model to %v in %v µs and %v in %v µs: the dispatches must match and the times be positive", a, aUs, b, bUs)
	}
	if err := fallback.Validate(); err != nil {
		return CostModel{}, err
	}
	d := float64(b.Dispatches)
	m := CostModel{ReadGBps: fallback.ReadGBps}
	ra, rb := aUs-a.Bytes/(m.ReadGBps*1e3), bUs-b.Bytes/(m.ReadGBps*1e3)
	switch {
	case rb <= 0:
		m.ReadGBps = b.Bytes / (bUs * 1e3)
	case b.Tokens > a.Tokens && rb > ra:
		m.TokenNs = (rb - ra) / float64(b.Tokens-a.Tokens) * 1e3
		m.FloorUs = (ra - float64(a.Tokens)*m.TokenNs/1e3) / d
		if m.FloorUs < 0 {
			m.FloorUs, m.TokenNs = 0, rb/float64(b.Tokens)*1e3
		}
	default:
		m.FloorUs = rb / d
	}
	if err := m.Validate(); err != nil {
		return CostModel{}, fmt.Errorf("sparse: fitting a cost model: %w", err)
	}
	return m, nil
}

// calibrations caches Calibrate's models per device (vk.Info.Identity).
var calibrations sync.Map

// Calibrate returns dev's cost model, measured on its first call for that
// device and driver (name, IDs and driver version) and cached for the
// process: the floor is the median time per dispatch of chains of
// calibrationChain dispatches that read nothing, each after a compute
// barrier; the bandwidth is a large buffer's bytes over the median time
// of one dispatch reading it, less the floor. It needs timestamps on the
// compute queue.
func Calibrate(dev *vk.Device) (CostModel, error) {
	key := dev.Info().Identity()
	if m, ok := calibrations.Load(key); ok {
		return m.(CostModel), nil
	}
	m, err := measureCostModel(dev)
	if err != nil {
		return CostModel{}, err
	}
	calibrations.Store(key, m)
	return m, nil
}

// calibrationChain is the dependent dispatches of one timed chain.
const calibrationChain = 32

// calibrationBytes returns the buffer Calibrate reads: 256 MiB on a GPU,
// 16 MiB on a CPU (a software renderer), within the device's limits.
func calibrationBytes(info vk.Info) uint64 {
	b := uint64(256 << 20)
	if info.Type == "cpu" {
		b = 16 << 20
	}
	b = min(b, info.MaxStorageBufferRange, info.MaxAllocation, info.DeviceLocalBytes/4)
	return b &^ 15
}

// readProbe is the read_probe kernel bound over a buffer of its own:
// every dispatch of record reads all of it once.
type readProbe struct {
	pipe *vk.Pipeline
	src  *vk.Buffer
	dst  *vk.Buffer
	bind *vk.Binding
}

// Workgroups of the read probe, and their threads.
const probeGroups, probeWG = 1024, 256

// newReadProbe binds read_probe (the device's shared pipeline) over size
// bytes of device memory.
func newReadProbe(dev *vk.Device, size uint64) (_ *readProbe, err error) {
	code, err := shaders.SPIRV("read_probe")
	if err != nil {
		return nil, err
	}
	r := &readProbe{}
	defer func() {
		if err != nil {
			err = errors.Join(err, r.Release())
		}
	}()
	if r.pipe, err = dev.SharedPipeline(vk.Kernel{Name: "read_probe", SPIRV: code, Bindings: 2, PushWords: 1, Specialization: []uint32{probeWG}}); err != nil {
		return nil, err
	}
	if r.src, err = dev.NewBuffer(size, vk.DeviceLocal); err != nil {
		return nil, err
	}
	if r.dst, err = dev.NewBuffer(probeGroups*probeWG*4, vk.DeviceLocal); err != nil {
		return nil, err
	}
	if r.bind, err = r.pipe.Bind(r.src.All(), r.dst.All()); err != nil {
		return nil, err
	}
	return r, nil
}

// read records one dispatch reading the whole buffer, after a compute
// barrier.
func (r *readProbe) read(c *vk.Commands) {
	c.ComputeBarrier()
	c.Dispatch(r.pipe, r.bind, []uint32{uint32(r.src.Size() / 16)}, probeGroups, 1, 1)
}

// empty records one dispatch of one workgroup that reads nothing, after
// a compute barrier.
func (r *readProbe) empty(c *vk.Commands) {
	c.ComputeBarrier()
	c.Dispatch(r.pipe, r.bind, []uint32{0}, 1, 1, 1)
}

// Release frees the buffers and the binding (the pipeline is the
// device's).
func (r *readProbe) Release() error {
	return errors.Join(releaseAll(r.bind), releaseAll(r.dst, r.src))
}

// measureCostModel times the chains and the read (Calibrate).
func measureCostModel(dev *vk.Device) (_ CostModel, err error) {
	info := dev.Info()
	if info.TimestampValidBits == 0 {
		return CostModel{}, fmt.Errorf("%w: calibrating the cost model needs timestamps on the compute queue: give the model", vk.ErrUnsupported)
	}
	probe, err := newReadProbe(dev, calibrationBytes(info))
	if err != nil {
		return CostModel{}, err
	}
	defer func() { err = errors.Join(err, probe.Release()) }()
	cmd, err := dev.NewCommands()
	if err != nil {
		return CostModel{}, err
	}
	defer func() { err = errors.Join(err, cmd.Release()) }()
	median := func(t []time.Duration) float64 { return float64(t[len(t)/2].Nanoseconds()) / 1e3 }
	chain, err := dev.TimeRuns(cmd, 2, 9, func(c *vk.Commands) error {
		for range calibrationChain {
			probe.empty(c)
		}
		return nil
	})
	if err != nil {
		return CostModel{}, err
	}
	read, err := dev.TimeRuns(cmd, 1, 5, func(c *vk.Commands) error {
		probe.read(c)
		return nil
	})
	if err != nil {
		return CostModel{}, err
	}
	m := CostModel{FloorUs: median(chain) / calibrationChain}
	m.ReadGBps = float64(probe.src.Size()) / (max(median(read)-m.FloorUs, median(read)/2) * 1e3)
	if err := m.Validate(); err != nil {
		return CostModel{}, fmt.Errorf("sparse: calibrating %s: %w", info.Name, err)
	}
	return m, nil
}

// SampledRows returns about how many key rows each query head's fit
// scores over n clustered tokens in c clusters: the exact part and the
// two sampling windows, thinned by the stride where it applies (whole
// clusters overlapping a window make it somewhat more); none with the
// moment estimate (Moments).
func (f TacticFit) SampledRows(n, c int) float64 {
	if n <= 0 || c <= 0 || f.Moments {
		return 0
	}
	w := float64(f.windowWidth(n)) / float64(f.windowStride(n, c))
	return min(float64(n), float64(f.initialTokens(n))+2*w)
}

// TacticCost returns about what one Tactic step over an index of c
// clusters holding n tokens costs, when each KV head attends rows rows
// (the sinks, the tail and its union): its stages (TacticStages, then
// attention), the 8-bit centroids and their scores, the fit's key rows of
// every query head (with the moment estimate instead the clusters'
// spreads, for every query head), and attention's keys and values (Tokens
// left 0 for the caller, who knows the context).
func (h Heads) TacticCost(fit TacticFit, n, c int, rows float64) Cost {
	sampled := float64(h.Query) * fit.SampledRows(n, c) * h.rowBytes()
	if fit.Moments {
		sampled = float64(h.Query * c * 4)
	}
	return Cost{Dispatches: len(TacticStages) + 1, Bytes: CentroidBytes(h, c) + sampled + h.AttentionBytes(rows)}
}

// WarmUp keeps a GPU busy for about d of wall time, reading a 64 MiB
// buffer over and over in submissions of about a tenth of d, so that its
// clocks are up before something is timed: GPUs lower their clocks when
// idle and raise them with a lag (an H100 ran at 345 MHz of its 1 980
// after a second of host work, and took 3.4× as long over dense
// attention). A CPU device (a software renderer) has no clocks to raise:
// WarmUp returns at once.
func WarmUp(dev *vk.Device, d time.Duration) (err error) {
	if d <= 0 || dev.Info().Type == "cpu" {
		return nil
	}
	probe, err := newReadProbe(dev, min(uint64(64<<20), calibrationBytes(dev.Info())))
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, probe.Release()) }()
	// Reads of 64 MiB take about 20 µs on an H100: runs grows until a
	// submission takes about a tenth of d.
	runs := 16
	for start := time.Now(); time.Since(start) < d; {
		t0 := time.Now()
		err := dev.Do(func(c *vk.Commands) error {
			for range runs {
				probe.read(c)
			}
			return nil
		})
		if err != nil {
			return err
		}
		if time.Since(t0) < d/10 && runs < 1<<16 {
			runs *= 2
		}
	}
	return nil
}
