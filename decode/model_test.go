package decode

import (
	"fmt"
	"math"
	"math/rand"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/trace"
	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/vk/vktest"
	"github.com/vksparse/vksparse/workload"
)

var testHeads = sparse.Heads{Query: 8, KV: 2, Dim: 64}

// layerData is one generated layer of one sequence: tokens of the trace
// are prefilled and appended in order.
type layerData struct {
	tr             *trace.Trace
	keys, values   []float64 // decoded, [KV][Tokens][D]
	n, kvHeads, hd int
}

func generate(t *testing.T, h sparse.Heads, n int, seed int64) *layerData {
	t.Helper()
	cfg := workload.DefaultConfig(n)
	cfg.KVHeads, cfg.QHeads, cfg.HeadDim, cfg.Queries, cfg.Seed, cfg.Kinds = h.KV, h.Query, h.Dim, 2, seed, nil
	tr, err := workload.Generate(cfg)
	require.NoError(t, err)
	return &layerData{tr: tr, keys: sparse.HalvesToFloat64(tr.K), values: sparse.HalvesToFloat64(tr.V), n: n, kvHeads: h.KV, hd: h.Dim}
}

// rows returns tokens [from, to) of every KV head, [KV][to−from][D].
func (d *layerData) rows(from, to int) (k, v []uint16) {
	for g := 0; g < d.kvHeads; g++ {
		k = append(k, d.tr.K[(g*d.n+from)*d.hd:(g*d.n+to)*d.hd]...)
		v = append(v, d.tr.V[(g*d.n+from)*d.hd:(g*d.n+to)*d.hd]...)
	}
	return k, v
}

// fixture is a model's sequences: data[slot][layer].
type fixture struct {
	h    sparse.Heads
	data [][]*layerData
}

func newFixture(t *testing.T, h sparse.Heads, layers int, total []int) *fixture {
	f := &fixture{h: h}
	for s, n := range total {
		var seq []*layerData
		for l := 0; l < layers; l++ {
			seq = append(seq, generate(t, h, n, int64(100*s+l+1)+rand.Int63n(1000)*1000))
		}
		f.data = append(f.data, seq)
	}
	return f
}

// prefill stores the first n tokens of slot's sequence in every layer.
func (f *fixture) prefill(t *testing.T, m *Model, slot, n int) {
	t.Helper()
	for l, d := range f.data[slot] {
		k, v := d.rows(0, n)
		require.NoError(t, m.Prefill(slot, l, k, v, n))
	}
}

// appendAll appends slot's next count tokens to every layer with AppendAll.
func (f *fixture) appendAll(t *testing.T, m *Model, slot, count int) {
	t.Helper()
	for range count {
		var k, v []uint16
		for l, d := range f.data[slot] {
			n := m.Len(slot, l)
			kt, vt := d.rows(n, n+1)
			k, v = append(k, kt...), append(v, vt...)
		}
		require.NoError(t, m.AppendAll(slot, k, v))
	}
}

// appendEach appends slot's next count tokens layer by layer with Append.
func (f *fixture) appendEach(t *testing.T, m *Model, slot, count int) {
	t.Helper()
	for range count {
		for l, d := range f.data[slot] {
			n := m.Len(slot, l)
			k, v := d.rows(n, n+1)
			require.NoError(t, m.Append(slot, l, k, v))
		}
	}
}

// queries returns query i of every active slot's layer, [B][Hq][D].
func (f *fixture) queries(m *Model, layer, i int) []float32 {
	var q []float32
	for _, s := range m.Active() {
		q = append(q, f.data[s][layer].tr.Query(i)...)
	}
	return q
}

// requireClose compares per query head: ‖got − want‖ / ‖want‖ < tol.
func requireClose(t *testing.T, want []float64, got []float32, dim int, tol float64, what string) {
	t.Helper()
	require.Len(t, got, len(want), what)
	for h := 0; h*dim < len(want); h++ {
		var num, den float64
		for i := h * dim; i < (h+1)*dim; i++ {
			diff := float64(got[i]) - want[i]
			if math.IsNaN(float64(got[i])) {
				diff = math.Inf(1)
			}
			num += diff * diff
			den += want[i] * want[i]
		}
		rel := math.Sqrt(num / math.Max(den, 1e-300))
		require.Less(t, rel, tol, "%s: head %d relative error", what, h)
	}
}

// subsetRef returns attention of every query head of q ([Hq][D]) over
// its KV head's tokens in d (lists[g]; nil: the first n tokens).
func subsetRef(t *testing.T, h sparse.Heads, d *layerData, q []float32, n int, lists [][]int32) []float64 {
	t.Helper()
	var want []float64
	for hh := 0; hh < h.Query; hh++ {
		g := hh / h.Group()
		qh := make([]float64, h.Dim)
		for i := range qh {
			qh[i] = float64(q[hh*h.Dim+i])
		}
		k, v := d.keys[g*d.n*h.Dim:(g+1)*d.n*h.Dim], d.values[g*d.n*h.Dim:(g+1)*d.n*h.Dim]
		var o []float64
		var err error
		if lists == nil {
			o, err = sparse.AttendRef(qh, k[:n*h.Dim], v[:n*h.Dim], 1/math.Sqrt(float64(h.Dim)))
		} else {
			o, err = sparse.AttendSubsetRef(qh, k, v, lists[g], 1/math.Sqrt(float64(h.Dim)))
		}
		require.NoError(t, err)
		want = append(want, o...)
	}
	return want
}

// check compares a layer's output for the active slots (out, [B][Hq][D])
// with the float64 reference: dense attention over every stored token, or
// with Tactic attention over the tokens each slot's step of the layer's
// batch attended, whose cuts must also agree within a bin with the same
// slot's step run alone (sparse.TacticStep). It returns the tokens
// attended and stored over the slots and KV heads.
func (f *fixture) check(t *testing.T, m *Model, layer int, q, out []float32, what string) (attended, stored int) {
	t.Helper()
	h := f.h
	per := h.Query * h.Dim
	active := m.Active()
	require.Len(t, out, len(active)*per, what)
	for i, s := range active {
		d := f.data[s][layer]
		n := m.Len(s, layer)
		name := fmt.Sprintf("%s, layer %d, slot %d (%d tokens)", what, layer, s, n)
		qi, got := q[i*per:(i+1)*per], out[i*per:(i+1)*per]
		stored += h.KV * n
		if !m.policy[layer].IsTactic() {
			requireClose(t, subsetRef(t, h, d, qi, n, nil), got, h.Dim, 1e-3, name)
			attended += h.KV * n
			continue
		}
		x := m.slots[s].seq[layer].clusters
		members := make([][][]int32, h.KV)
		for g := range members {
			hc, err := x.Read(g)
			require.NoError(t, err)
			members[g] = hc.Members
		}
		step := m.layers[layer].tactic.Step(i)
		lists, err := step.Tokens(members)
		require.NoError(t, err)
		for _, l := range lists {
			attended += len(l)
		}
		requireClose(t, subsetRef(t, h, d, qi, n, lists), got, h.Dim, 1e-3, name)

		cuts, err := step.Cuts()
		require.NoError(t, err)
		alone, err := sparse.NewTacticStep(m.dense, m.slots[s].seq[layer].cache, x, m.policy[layer].P(), m.policy[layer].opts.Fit)
		require.NoError(t, err)
		_, err = alone.Attend(qi)
		require.NoError(t, err)
		aloneCuts, err := alone.Cuts()
		require.NoError(t, err)
		require.NoError(t, alone.Release())
		for hh := range cuts {
			require.InDelta(t, aloneCuts[hh], cuts[hh], 1, "%s: head %d's cut in the batch and alone", name, hh)
		}
	}
	return attended, stored
}

// TestModelTacticMatchesReference prefills three slots of three layers
// with generated sequences of different lengths (a slot is active only
// once every layer is prefilled), attends every layer for the batch,
// appends past the recluster interval (one slot with AppendAll, one layer
// by layer, one fewer tokens) while the batches exist, and attends again,
// layer 0 with Attend and the others recorded into one command buffer of
// the caller's. Every slot's output must match AttendSubsetRef over the
// tokens its step attended, its cuts those of the slot's step alone.
func TestModelTacticMatchesReference(t *testing.T) {
	dev := vktest.Open(t)
	const layers, sinks, recluster = 3, 4, 64
	prefill := []int{1800, 2500, 1200}
	appends := []int{70, 70, 20}
	var total []int
	for s := range prefill {
		total = append(total, prefill[s]+appends[s])
	}
	f := newFixture(t, testHeads, layers, total)
	m, err := New(dev, Config{Fallback: FallbackNever, Heads: testHeads, Layers: layers, Slots: 3, Capacity: 2600,
		Policy: Tactic(0.9, sparse.TacticDecoderOptions{Sinks: sinks, Recluster: recluster, KMeans: sparse.KMeansOptions{Seed: 3}})})
	require.NoError(t, err)
	defer func() { require.NoError(t, m.Release()) }()

	for s := range prefill {
		for l, d := range f.data[s] {
			require.Len(t, m.Active(), s, "slot %d is not active before its layer %d", s, l)
			k, v := d.rows(0, prefill[s])
			require.NoError(t, m.Prefill(s, l, k, v, prefill[s]))
		}
	}
	require.Equal(t, []int{0, 1, 2}, m.Active())
	require.Empty(t, m.Idle())

	attended, stored := 0, 0
	for l := 0; l < layers; l++ {
		q := f.queries(m, l, 0)
		out, err := m.Attend(l, q)
		require.NoError(t, err)
		a, s := f.check(t, m, l, q, out, "after the prefill")
		attended, stored = attended+a, stored+s
	}
	require.Less(t, attended, stored, "Tactic at P 0.9 attends fewer tokens than are stored")

	f.appendAll(t, m, 0, appends[0])
	f.appendEach(t, m, 1, appends[1])
	f.appendAll(t, m, 2, appends[2])
	for s := range prefill {
		for l := 0; l < layers; l++ {
			x := m.slots[s].seq[l].clusters
			joined := appends[s] / recluster * recluster
			require.Equal(t, []int{sinks, prefill[s] - sinks + joined, total[s]},
				[]int{x.First, x.Count, m.Len(s, l)}, "slot %d layer %d: clustered range and length", s, l)
			require.True(t, x.Contiguous)
		}
	}

	q0 := f.queries(m, 0, 1)
	out, err := m.Attend(0, q0)
	require.NoError(t, err)
	f.check(t, m, 0, q0, out, "after the appends, Attend")

	c, err := dev.NewCommands()
	require.NoError(t, err)
	defer c.Release()
	require.NoError(t, c.Begin())
	qs := map[int][]float32{}
	for l := 1; l < layers; l++ {
		qs[l] = f.queries(m, l, 1)
		require.NoError(t, m.SetQuery(l, qs[l]))
		require.NoError(t, m.Record(l, c))
	}
	require.NoError(t, c.End())
	require.NoError(t, c.Submit())
	for l := 1; l < layers; l++ {
		r, err := m.Output(l)
		require.NoError(t, err)
		require.Equal(t, uint64(3*testHeads.Query*testHeads.Dim*4), r.Size)
		out, err := m.ReadOutput(l)
		require.NoError(t, err)
		f.check(t, m, l, qs[l], out, "after the appends, recorded")
	}
}

// TestModelDenseMatchesReference runs the Dense policy over three slots
// of two layers, before and after appends, against sparse.AttendRef, and
// recorded into the caller's command buffer.
func TestModelDenseMatchesReference(t *testing.T) {
	dev := vktest.Open(t)
	const layers = 2
	prefill := []int{900, 1500, 600}
	f := newFixture(t, testHeads, layers, []int{905, 1505, 605})
	m, err := New(dev, Config{Heads: testHeads, Layers: layers, Slots: 3, Capacity: 1600, Policy: Dense()})
	require.NoError(t, err)
	defer func() { require.NoError(t, m.Release()) }()
	for s, n := range prefill {
		f.prefill(t, m, s, n)
	}
	for l := 0; l < layers; l++ {
		q := f.queries(m, l, 0)
		out, err := m.Attend(l, q)
		require.NoError(t, err)
		f.check(t, m, l, q, out, "dense after the prefill")
	}
	for s := range prefill {
		f.appendAll(t, m, s, 3)
		f.appendEach(t, m, s, 2)
	}
	c, err := dev.NewCommands()
	require.NoError(t, err)
	defer c.Release()
	for l := 0; l < layers; l++ {
		q := f.queries(m, l, 1)
		require.NoError(t, m.SetQuery(l, q))
		require.NoError(t, c.Begin())
		require.NoError(t, m.Record(l, c))
		require.NoError(t, c.End())
		require.NoError(t, c.Submit())
		out, err := m.ReadOutput(l)
		require.NoError(t, err)
		f.check(t, m, l, q, out, "dense after the appends, recorded")
	}
}

// TestModelFreeAndReuse frees an active slot (the batch shrinks to the
// other), checks the freed slot is refused, prefills it with a new
// sequence layer by layer (not attended until every layer is), appends
// past the recluster interval and checks both slots' outputs.
func TestModelFreeAndReuse(t *testing.T) {
	dev := vktest.Open(t)
	const layers = 2
	f := newFixture(t, testHeads, layers, []int{700, 900})
	m, err := New(dev, Config{Fallback: FallbackNever, Heads: testHeads, Layers: layers, Slots: 2, Capacity: 1000,
		Policy: Tactic(0.9, sparse.TacticDecoderOptions{Recluster: 64})})
	require.NoError(t, err)
	defer func() { require.NoError(t, m.Release()) }()
	f.prefill(t, m, 0, 700)
	f.prefill(t, m, 1, 800)
	for l := 0; l < layers; l++ {
		q := f.queries(m, l, 0)
		out, err := m.Attend(l, q)
		require.NoError(t, err)
		f.check(t, m, l, q, out, "two slots")
	}

	require.NoError(t, m.Free(0))
	require.Equal(t, []int{1}, m.Active())
	require.Equal(t, []int{0}, m.Idle())
	require.Zero(t, m.Len(0, 0))
	k, v := f.data[0][0].rows(0, 1)
	require.ErrorContains(t, m.Append(0, 0, k, v), "holds no sequence")
	require.ErrorContains(t, m.Free(0), "no sequence")
	c, err := dev.NewCommands()
	require.NoError(t, err)
	defer c.Release()
	require.ErrorContains(t, m.Record(0, c), "before its SetQuery", "the batch changed with the active slots")
	q := f.queries(m, 0, 1)
	require.Len(t, q, testHeads.Query*testHeads.Dim)
	out, err := m.Attend(0, q)
	require.NoError(t, err)
	f.check(t, m, 0, q, out, "slot 1 alone")

	// A new sequence in slot 0, prefilled layer by layer.
	f.data[0] = newFixture(t, testHeads, layers, []int{600}).data[0]
	k, v = f.data[0][0].rows(0, 500)
	require.NoError(t, m.Prefill(0, 0, k, v, 500))
	require.Equal(t, []int{1}, m.Active(), "slot 0 has one layer of two")
	out, err = m.Attend(1, f.queries(m, 1, 1))
	require.NoError(t, err)
	require.Len(t, out, testHeads.Query*testHeads.Dim)
	k, v = f.data[0][1].rows(0, 500)
	require.NoError(t, m.Prefill(0, 1, k, v, 500))
	require.Equal(t, []int{0, 1}, m.Active())
	f.appendAll(t, m, 0, 70)
	f.appendEach(t, m, 1, 5)
	require.Equal(t, 496+64, m.slots[0].seq[1].clusters.Count, "slot 0's first tail joined its index")
	for l := 0; l < layers; l++ {
		q := f.queries(m, l, 1)
		out, err := m.Attend(l, q)
		require.NoError(t, err)
		f.check(t, m, l, q, out, "the reused slot beside the other")
	}

	// A slot freed part way through its prefill.
	require.NoError(t, m.Free(0))
	k, v = f.data[0][0].rows(0, 300)
	require.NoError(t, m.Prefill(0, 0, k, v, 300))
	require.NoError(t, m.Free(0))
	require.Equal(t, []int{0}, m.Idle())
	require.Equal(t, []int{1}, m.Active())
}

// snapshot is what a refused call must leave as it was.
type snapshot struct {
	Active, Idle []int
	Lens         [][]int
	Clustered    [][]int
}

func snap(m *Model) snapshot {
	s := snapshot{Active: m.Active(), Idle: m.Idle()}
	for i := range m.cfg.Slots {
		var lens, clustered []int
		for l := range m.cfg.Layers {
			lens = append(lens, m.Len(i, l))
			n := 0
			if x := m.slots[i].seq[l].clusters; x != nil {
				n = x.Count
			}
			clustered = append(clustered, n)
		}
		s.Lens, s.Clustered = append(s.Lens, lens), append(s.Clustered, clustered)
	}
	return s
}

// TestModelRejectsBadInput makes every kind of bad call and checks that
// each is refused and leaves the model as it was: the slots, lengths and
// indexes, and the output of an attention run before and after.
func TestModelRejectsBadInput(t *testing.T) {
	dev := vktest.Open(t)
	h := testHeads
	tactic := Tactic(0.9, sparse.TacticDecoderOptions{Recluster: 64})
	for _, cfg := range []Config{
		{Heads: sparse.Heads{Query: 8, KV: 3, Dim: 64}, Layers: 1, Slots: 1, Capacity: 100},
		{Heads: h, Layers: 0, Slots: 1, Capacity: 100},
		{Heads: h, Layers: 1, Slots: 0, Capacity: 100},
		{Heads: h, Layers: 1, Slots: 1, Capacity: 0},
		{Heads: h, Layers: 1, Slots: 1, Capacity: 100, Policy: Tactic(0, sparse.TacticDecoderOptions{})},
		{Heads: h, Layers: 1, Slots: 1, Capacity: 100, Policy: Tactic(math.NaN(), sparse.TacticDecoderOptions{})},
		{Heads: h, Layers: 1, Slots: 1, Capacity: 100, Policy: Tactic(0.9, sparse.TacticDecoderOptions{Sinks: -1})},
		{Heads: h, Layers: 1, Slots: 1, Capacity: 100, Policy: Tactic(0.9, sparse.TacticDecoderOptions{Fit: sparse.TacticFit{InitialFrac: 2}})},
		{Heads: h, Layers: 1, Slots: 1, Capacity: 4, Policy: tactic},
	} {
		_, err := New(dev, cfg)
		require.Error(t, err, "%+v", cfg)
	}

	const layers, capacity = 2, 520
	f := newFixture(t, h, layers, []int{capacity, capacity})
	m, err := New(dev, Config{Fallback: FallbackNever, Heads: h, Layers: layers, Slots: 2, Capacity: capacity, Policy: tactic})
	require.NoError(t, err)
	f.prefill(t, m, 1, capacity-2)
	k, v := f.data[0][0].rows(0, 300)
	require.NoError(t, m.Prefill(0, 0, k, v, 300)) // slot 0: one layer of two
	q := f.queries(m, 0, 0)
	before, err := m.Attend(0, q)
	require.NoError(t, err)
	state := snap(m)

	nan := uint16(0x7e00)
	bad := func(x []uint16, i int) []uint16 {
		x = append([]uint16(nil), x...)
		x[i] = nan
		return x
	}
	k1, v1 := f.data[1][0].rows(capacity-2, capacity-1)
	kAll, vAll := append(append([]uint16(nil), k1...), f.data[1][1].tr.K[:len(k1)]...), append(append([]uint16(nil), v1...), f.data[1][1].tr.V[:len(v1)]...)
	kp, vp := f.data[0][1].rows(0, 300)
	cmd, err := dev.NewCommands()
	require.NoError(t, err)
	defer cmd.Release()
	qnan := append([]float32(nil), q...)
	qnan[5] = float32(math.NaN())
	for _, c := range []struct {
		what string
		call func() error
		want string
	}{
		{"prefill of a slot out of range", func() error { return m.Prefill(2, 1, kp, vp, 300) }, "slot 2"},
		{"prefill of a layer out of range", func() error { return m.Prefill(0, 2, kp, vp, 300) }, "layer 2"},
		{"prefill of a layer holding a sequence", func() error { return m.Prefill(0, 0, kp, vp, 300) }, "Free"},
		{"prefill of another length than the slot's other layers", func() error { return m.Prefill(0, 1, kp[:len(kp)-h.Dim*h.KV], vp[:len(vp)-h.Dim*h.KV], 299) }, "other layers"},
		{"prefill of the wrong shape", func() error { return m.Prefill(0, 1, kp[:len(kp)-1], vp, 300) }, "needs"},
		{"prefill with a NaN key", func() error { return m.Prefill(0, 1, bad(kp, 77), vp, 300) }, "not finite"},
		{"prefill with an infinite value", func() error { v := append([]uint16(nil), vp...); v[3] = 0x7c00; return m.Prefill(0, 1, kp, v, 300) }, "not finite"},
		{"prefill beyond the capacity", func() error { return m.Prefill(0, 1, kp, vp, capacity+1) }, "capacity"},
		{"prefill of the sinks only", func() error { k, v := f.data[0][1].rows(0, 4); return m.Prefill(0, 1, k, v, 4) }, "sinks"},
		{"append to a partly prefilled slot", func() error { return m.Append(0, 0, k1, v1) }, "1 of its 2 layers"},
		{"append to a layer out of range", func() error { return m.Append(1, 2, k1, v1) }, "layer 2"},
		{"append of the wrong shape", func() error { return m.Append(1, 0, k1[1:], v1) }, "needs"},
		{"append with a NaN value", func() error { return m.Append(1, 0, k1, bad(v1, 9)) }, "not finite"},
		{"append to all layers, a NaN in the last", func() error { return m.AppendAll(1, kAll, bad(vAll, len(vAll)-1)) }, "layer 1"},
		{"append to all layers, the wrong shape", func() error { return m.AppendAll(1, k1, v1) }, "needs"},
		{"append to all layers of a partly prefilled slot", func() error { return m.AppendAll(0, kAll, vAll) }, "layers prefilled"},
		{"attend a layer out of range", func() error { _, err := m.Attend(2, q); return err }, "layer 2"},
		{"attend queries of the wrong length", func() error { _, err := m.Attend(0, q[1:]); return err }, "queries"},
		{"attend a NaN query", func() error { _, err := m.Attend(1, qnan); return err }, "NaN"},
		{"set a NaN query", func() error { return m.SetQuery(0, qnan) }, "NaN"},
		{"record a layer without queries", func() error { return m.Record(1, cmd) }, "SetQuery"},
		{"record into no command buffer", func() error { return m.Record(0, nil) }, "command buffer"},
		{"output of a layer without queries", func() error { _, err := m.Output(1); return err }, "SetQuery"},
		{"free a slot out of range", func() error { return m.Free(-1) }, "slot -1"},
	} {
		err := c.call()
		require.Error(t, err, c.what)
		require.ErrorContains(t, err, c.want, c.what)
		require.Equal(t, state, snap(m), "%s changed the model", c.what)
	}
	after, err := m.Attend(0, q)
	require.NoError(t, err)
	want := make([]float64, len(before))
	for i, x := range before {
		want[i] = float64(x)
	}
	requireClose(t, want, after, h.Dim, 1e-6, "attention after the refused calls")

	// The slot's last room, then appends beyond the capacity.
	f.appendAll(t, m, 1, 1)
	k2, v2 := f.data[1][0].rows(capacity-1, capacity)
	require.NoError(t, m.Append(1, 0, k2, v2))
	state = snap(m)
	require.ErrorContains(t, m.Append(1, 0, k2, v2), "full")
	require.ErrorContains(t, m.AppendAll(1, append(k2, k2...), append(v2, v2...)), "full")
	require.Equal(t, state, snap(m), "appends beyond the capacity changed the model")

	require.NoError(t, m.Release())
	require.ErrorIs(t, m.Prefill(0, 1, kp, vp, 300), vk.ErrReleased)
	require.ErrorIs(t, m.Append(1, 0, k1, v1), vk.ErrReleased)
	_, err = m.Attend(0, q)
	require.ErrorIs(t, err, vk.ErrReleased)
	require.ErrorIs(t, m.Free(1), vk.ErrReleased)
	require.ErrorIs(t, m.Release(), vk.ErrReleased)
	require.Zero(t, m.Len(1, 0))
}

// TestModelConcurrentUse appends to and attends a dense model from several
// goroutines at once (run with -race): the mutex serializes the calls.
func TestModelConcurrentUse(t *testing.T) {
	dev := vktest.Open(t)
	const layers, steps = 2, 8
	f := newFixture(t, testHeads, layers, []int{300 + steps, 200 + steps})
	m, err := New(dev, Config{Heads: testHeads, Layers: layers, Slots: 2, Capacity: 400})
	require.NoError(t, err)
	defer func() { require.NoError(t, m.Release()) }()
	f.prefill(t, m, 0, 300)
	f.prefill(t, m, 1, 200)
	var wg sync.WaitGroup
	errs := make(chan error, 2*layers*steps+layers*steps)
	for s := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range steps {
				for l, d := range f.data[s] {
					n := m.Len(s, l)
					k, v := d.rows(n, n+1)
					errs <- m.Append(s, l, k, v)
				}
			}
		}()
	}
	for l := range layers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range steps {
				_, err := m.Attend(l, f.queries(m, l, i%2))
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	for l := range layers {
		q := f.queries(m, l, 0)
		out, err := m.Attend(l, q)
		require.NoError(t, err)
		f.check(t, m, l, q, out, "after concurrent appends")
	}
	require.Equal(t, [][]int{{300 + steps, 300 + steps}, {200 + steps, 200 + steps}}, snap(m).Lens)
}

// TestDeviceReleaseUnderModel checks that releasing the device while a
// model holds objects on it is refused and leaves the model working.
func TestDeviceReleaseUnderModel(t *testing.T) {
	dev, err := vk.Open(vk.OptionsFromEnv())
	if err != nil {
		vktest.Open(t) // skips or fails as the environment says
		t.Fatal(err)
	}
	f := newFixture(t, testHeads, 1, []int{300})
	m, err := New(dev, Config{Heads: testHeads, Layers: 1, Slots: 1, Capacity: 300, Policy: Dense()})
	require.NoError(t, err)
	f.prefill(t, m, 0, 200)
	require.ErrorContains(t, dev.Release(), "not released", "refused while the model lives")
	_, err = m.Attend(0, f.queries(m, 0, 0))
	require.NoError(t, err, "the model still works")
	require.NoError(t, m.Release())
	require.NoError(t, dev.Release())
}
