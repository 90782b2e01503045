package decode

import (
	"fmt"
	"math"
	"os"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/vk/vktest"
)

// The fault walk: for each policy decode offers and each operation that
// changes or reads the model (prefill, Append, AppendAll crossing a
// reclustering boundary, Attend building its batches, Free), a clean run
// counts the operation's calls at each fault site (vk.Site), then every
// one of them is made to fail in turn. The failed call must return the
// sentinel error; the caches, read back, must hold exactly the tokens the
// float64 record of the sequence says they hold (a prefill undone, a token
// stored or not, nothing else changed); after out of memory the operation
// is completed, and the model, carried on the same way, must give outputs
// bit-identical to the clean run's. Device lost is injected at the first
// and the last site of each operation (every site when
// VKSPARSE_FAULTS_ALL is set): the call and every later one must return
// vk.ErrDeviceLost, and the model and the device must still release with
// nothing left alive. VKSPARSE_FAULT_STRIDE=s walks only every s-th site
// of each kind (the first and the last always), and loses the device at
// the last site only, for slow renderers.

var faultHeads = sparse.Heads{Query: 4, KV: 2, Dim: 64}

const (
	faultRecluster = 8
	faultSinks     = 4
	faultFirst     = faultSinks + 12*faultRecluster // slot 0's prefill: clustered past its sinks, no tail
	faultSecond    = 120                            // slot 1's
	faultCapacity  = 160
)

type faultPolicy struct {
	name   string
	layout []Policy
}

func faultPolicies(t *testing.T) []faultPolicy {
	opts := sparse.TacticDecoderOptions{Sinks: faultSinks, Recluster: faultRecluster, KMeans: sparse.KMeansOptions{Seed: 7}}
	same := func(p Policy) []Policy { return []Policy{p, p} }
	delta, err := DeltaLayout(3, sparse.Delta{Warmup: 1, Refresh: []int{1}, Pages: 4, Recent: 2, PageSize: 16})
	require.NoError(t, err)
	return []faultPolicy{
		{"dense", same(Dense())},
		{"Tactic", same(Tactic(0.9, opts))},
		{"Double-P", same(DoubleP(sparse.DefaultDoubleP(), opts))},
		{"Quest", same(Quest(80).WithRecluster(faultRecluster))},
		{"StreamingLLM", same(StreamingLLM(80).WithRecluster(faultRecluster))},
		{"H2O", same(H2O(80).WithRecluster(faultRecluster))},
		{"Tactic, dense fallback", same(Tactic(0.9, opts).WithFallback(FallbackAlways))},
		{"DELTA", delta},
		{"LuKA", same(LuKA(sparse.LuKA{Segment: 16, Recent: 32, Every: faultRecluster, Rule: sparse.RefineTopK, K: 2}))},
	}
}

// faultOp is one operation walked: setup brings a fresh model to the state
// before it, run performs it and returns the first error (stopping there),
// finish completes what run left undone after out of memory, and check
// says whether the state after a failed run is one the docs allow.
type faultOp struct {
	name   string
	setup  func(w *faultWorld)
	run    func(w *faultWorld) error
	finish func(w *faultWorld)
}

// faultWorld is one model under test and the record of what its caches
// should hold: the tokens of each slot's layer are the fixture's first
// stored[slot][layer] tokens.
type faultWorld struct {
	t      *testing.T
	m      *Model
	f      *fixture
	layers int
	failed int // the layer at which run stopped (Append, Attend)
}

func (w *faultWorld) prefill(slot, layer, n int) error {
	k, v := w.f.data[slot][layer].rows(0, n)
	return w.m.Prefill(slot, layer, k, v, n)
}

func (w *faultWorld) token(slot, layer int) (k, v []uint16) {
	n := w.m.Len(slot, layer)
	return w.f.data[slot][layer].rows(n, n+1)
}

func (w *faultWorld) appendAll(slot int) error {
	var k, v []uint16
	for l := 0; l < w.layers; l++ {
		kt, vt := w.token(slot, l)
		k, v = append(k, kt...), append(v, vt...)
	}
	return w.m.AppendAll(slot, k, v)
}

func (w *faultWorld) attend(from int) error {
	for l := from; l < w.layers; l++ {
		if _, err := w.m.Attend(l, w.f.queries(w.m, l, 0)); err != nil {
			w.failed = l
			return err
		}
	}
	return nil
}

func (w *faultWorld) must(err error) {
	w.t.Helper()
	require.NoError(w.t, err)
}

// both makes slots 0 and 1 active, slot 0 one append short of a
// reclustering boundary, and attends once so that every batch exists.
func (w *faultWorld) both() {
	w.one()
	for l := 0; l < w.layers; l++ {
		w.must(w.prefill(1, l, faultSecond))
	}
	w.must(w.attend(0))
}

// one makes slot 0 active, one append short of a reclustering boundary,
// and attends once.
func (w *faultWorld) one() {
	for l := 0; l < w.layers; l++ {
		w.must(w.prefill(0, l, faultFirst))
	}
	for range faultRecluster - 1 {
		w.must(w.appendAll(0))
	}
	w.must(w.attend(0))
}

var faultOps = []faultOp{
	{
		name:  "Prefill",
		setup: (*faultWorld).one,
		run: func(w *faultWorld) error {
			for l := 0; l < w.layers; l++ {
				if err := w.prefill(1, l, faultSecond); err != nil {
					return err
				}
			}
			return nil
		},
		finish: func(w *faultWorld) {
			for l := 0; l < w.layers; l++ {
				if w.m.Len(1, l) == 0 {
					w.must(w.prefill(1, l, faultSecond))
				}
			}
		},
	},
	{
		name:  "Append",
		setup: (*faultWorld).both,
		run: func(w *faultWorld) error {
			for l := 0; l < w.layers; l++ {
				k, v := w.token(0, l)
				if err := w.m.Append(0, l, k, v); err != nil {
					w.failed = l
					return err
				}
			}
			return nil
		},
		finish: func(w *faultWorld) {
			for l := 0; l < w.layers; l++ {
				if w.m.Len(0, l) < faultFirst+faultRecluster {
					k, v := w.token(0, l)
					w.must(w.m.Append(0, l, k, v))
				}
			}
		},
	},
	{
		name:  "AppendAll",
		setup: (*faultWorld).both,
		run:   func(w *faultWorld) error { return w.appendAll(0) },
		finish: func(w *faultWorld) {
			if w.m.Len(0, 0) < faultFirst+faultRecluster {
				w.must(w.appendAll(0))
			}
		},
	},
	{
		name: "Attend",
		setup: func(w *faultWorld) {
			w.both()
			w.must(w.appendAll(0)) // crosses the boundary: indexes grow
			// Slot 1 ends and another sequence takes it: every layer's
			// batch is built again at its next Attend.
			w.must(w.m.Free(1))
			for l := 0; l < w.layers; l++ {
				w.must(w.prefill(1, l, faultSecond))
			}
		},
		run:    func(w *faultWorld) error { return w.attend(0) },
		finish: func(w *faultWorld) { w.must(w.attend(w.failed)) },
	},
	{
		name:  "Free",
		setup: (*faultWorld).both,
		run:   func(w *faultWorld) error { return w.m.Free(1) },
		finish: func(w *faultWorld) {
			if st, err := w.m.Slot(1); err == nil && st.Prefilled > 0 {
				w.must(w.m.Free(1))
			}
		},
	},
}

// after carries a model on past the operation the same way in every run:
// one more token for every active slot (a clustering left to the next
// append happens here), then every layer attended. It returns the outputs.
func (w *faultWorld) after() [][]float32 {
	for _, s := range w.m.Active() {
		w.must(w.appendAll(s))
	}
	var outs [][]float32
	for l := 0; l < w.layers; l++ {
		out, err := w.m.Attend(l, w.f.queries(w.m, l, 1))
		w.must(err)
		outs = append(outs, out)
	}
	return outs
}

// checkStored reads every slot's layers back and compares them with the
// fixture's first Len tokens, decoded to float64; it returns the lengths.
func (w *faultWorld) checkStored(what string) [][]int {
	w.t.Helper()
	h := w.f.h
	lens := make([][]int, len(w.f.data))
	for s := range w.f.data {
		lens[s] = make([]int, w.layers)
		for l := 0; l < w.layers; l++ {
			n := w.m.Len(s, l)
			lens[s][l] = n
			k, v, err := w.m.ReadSequence(s, l)
			require.NoError(w.t, err, "%s: reading slot %d layer %d", what, s, l)
			d := w.f.data[s][l]
			got := [2][]float64{sparse.HalvesToFloat64(k), sparse.HalvesToFloat64(v)}
			for i, name := range []string{"keys", "values"} {
				src := d.keys
				if i == 1 {
					src = d.values
				}
				var bad []string
				for g := 0; g < h.KV && len(bad) < 4; g++ {
					for r := 0; r < n*h.Dim && len(bad) < 4; r++ {
						if want := src[g*d.n*h.Dim+r]; got[i][g*n*h.Dim+r] != want {
							bad = append(bad, fmt.Sprintf("head %d token %d [%d]: %v, want %v", g, r/h.Dim, r%h.Dim, got[i][g*n*h.Dim+r], want))
						}
					}
				}
				require.Empty(w.t, bad, "%s: slot %d layer %d %s differ from the record of %d tokens", what, s, l, name, n)
			}
		}
	}
	return lens
}

func newFaultWorld(t *testing.T, dev *vk.Device, p faultPolicy, f *fixture) *faultWorld {
	m, err := New(dev, Config{Fallback: FallbackNever, Heads: faultHeads, Layers: len(p.layout), Slots: 2, Capacity: faultCapacity, Layout: p.layout})
	require.NoError(t, err)
	return &faultWorld{t: t, m: m, f: f, layers: len(p.layout)}
}

// allowed says whether lens (after a failed op) are ones its docs allow,
// given the lengths before it.
func allowed(op string, before, after [][]int) error {
	for s := range before {
		for l := range before[s] {
			b, a := before[s][l], after[s][l]
			ok := a == b
			switch {
			case op == "Prefill" && s == 1:
				ok = a == 0 || a == faultSecond // a layer prefilled, or undone
				if l > 0 && after[s][l-1] == 0 {
					ok = a == 0 // the op stopped at the first failure
				}
			case (op == "Append" || op == "AppendAll") && s == 0:
				ok = a == b || a == b+1 // stored or not
				if op == "AppendAll" && a != after[s][0] {
					ok = false // every layer or none
				}
				if op == "Append" && l > 0 && a > after[s][l-1] {
					ok = false // appended in order, stopping at the failure
				}
			case op == "Free" && s == 1:
				ok = a == 0 // freed even when releasing something failed
			}
			if !ok {
				return fmt.Errorf("slot %d layer %d holds %d tokens after the failed %s (before: %d)", s, l, a, op, b)
			}
		}
	}
	return nil
}

func TestFaultWalk(t *testing.T) {
	vktest.HostLogic(t)
	if testing.Short() {
		t.Skip("the fault walk runs every operation once per fault site")
	}
	opts := vk.OptionsFromEnv()
	opts.Faults = true
	every := os.Getenv("VKSPARSE_FAULTS_ALL") != ""
	stride := 1
	if v := os.Getenv("VKSPARSE_FAULT_STRIDE"); v != "" {
		var err error
		stride, err = strconv.Atoi(v)
		require.NoError(t, err, "VKSPARSE_FAULT_STRIDE")
		require.Positive(t, stride, "VKSPARSE_FAULT_STRIDE")
		t.Logf("walking every %d-th fault site of each kind, the first and the last", stride)
	}
	for _, p := range faultPolicies(t) {
		t.Run(p.name, func(t *testing.T) {
			f := newFixture(t, faultHeads, len(p.layout), []int{faultCapacity, faultCapacity})
			dev := vktest.OpenWith(t, opts)
			base := dev.Allocated()
			w := newFaultWorld(t, dev, p, f)
			defer func() {
				require.NoError(t, w.m.Release())
				require.Equal(t, base, dev.Allocated(), "device memory left allocated after the model's release")
			}()
			for _, op := range faultOps {
				t.Run(op.name, func(t *testing.T) {
					start := time.Now()
					w.t = t
					w.reset() // after an earlier op's failure
					// Two clean runs: the first grows what the model keeps
					// from one sequence to the next (its workspace, say);
					// the second counts the sites the op calls, and its
					// outputs must equal the first's.
					var calls [3]int
					var clean [][]float32
					for run := range 2 {
						op.setup(w)
						for s := range calls {
							calls[s] = -dev.Calls(vk.Site(s))
						}
						w.must(op.run(w))
						for s := range calls {
							calls[s] += dev.Calls(vk.Site(s))
						}
						outs := w.after()
						w.reset()
						for l := range outs {
							if run == 1 && !slices.Equal(math32bits(clean[l]), math32bits(outs[l])) {
								t.Fatalf("two clean runs differ at layer %d (first difference: %s)", l, firstDiff(clean[l], outs[l]))
							}
						}
						clean = outs
					}
					idle := dev.Allocated()
					walked := 0
					for site, n := range calls {
						for k := 1; k <= n; k++ {
							if (k-1)%stride != 0 && k != n {
								continue
							}
							walked++
							w.oomAt(op, vk.Site(site), k, clean)
							require.Equal(t, idle, dev.Allocated(), "%s %s, out of memory at %v %d: device memory held once every slot is free differs from the clean run's", p.name, op.name, vk.Site(site), k)
							if every || k == n || (k == 1 && stride == 1) {
								t.Run(fmt.Sprintf("lost at %v %d", vk.Site(site), k), func(t *testing.T) {
									lostAt(t, opts, p, f, op, vk.Site(site), k)
								})
							}
						}
					}
					t.Logf("%s %s: sites walked %d (allocations %d, submissions %d, mappings %d) in %v", p.name, op.name, walked, calls[vk.Allocation], calls[vk.Submission], calls[vk.Mapping], time.Since(start).Round(time.Millisecond))
				})
			}
		})
	}
}

// reset frees every slot that holds a sequence.
func (w *faultWorld) reset() {
	w.t.Helper()
	for s := range w.f.data {
		if st, err := w.m.Slot(s); err == nil && st.Prefilled > 0 {
			w.must(w.m.Free(s))
		}
	}
}

// oomAt runs op with the k-th call at site failing with out of memory, and
// checks what the failed call left, and that the model finishes the op and
// goes on exactly as the clean run did; it frees every slot after.
func (w *faultWorld) oomAt(op faultOp, site vk.Site, k int, clean [][]float32) {
	t := w.t
	t.Helper()
	dev := w.m.dev
	what := fmt.Sprintf("%s, out of memory at %v %d", op.name, site, k)
	op.setup(w)
	before := w.checkStored(what + ", before")
	require.NoError(t, dev.InjectFault(vk.Fault{Site: site, Nth: k, Err: vk.ErrOutOfMemory}))
	err := op.run(w)
	fired := dev.ClearFault()
	require.True(t, fired, "%s: the fault did not fire", what)
	require.ErrorIs(t, err, vk.ErrOutOfMemory, what)
	require.NoError(t, allowed(op.name, before, w.checkStored(what)), "%s: %v", what, err)
	op.finish(w)
	got := w.after()
	for l := range clean {
		if !slices.Equal(math32bits(clean[l]), math32bits(got[l])) {
			t.Fatalf("%s: layer %d's output after the fault differs from the clean run's (first difference: %s); the failed call said: %v", what, l, firstDiff(clean[l], got[l]), err)
		}
	}
	w.reset()
}

// lostAt runs op on a fresh device and model with the k-th call at site
// losing the device: that call and every later one return ErrDeviceLost,
// and the model and the device release with nothing left alive.
func lostAt(t *testing.T, opts vk.Options, p faultPolicy, f *fixture, op faultOp, site vk.Site, k int) {
	dev := vktest.OpenWith(t, opts)
	w := newFaultWorld(t, dev, p, f)
	op.setup(w)
	require.NoError(t, dev.InjectFault(vk.Fault{Site: site, Nth: k, Err: vk.ErrDeviceLost}))
	err := op.run(w)
	require.True(t, dev.ClearFault(), "the fault did not fire")
	require.ErrorIs(t, err, vk.ErrDeviceLost)
	k0, v0 := w.f.data[0][0].rows(0, 1)
	q := make([]float32, len(w.m.Active())*faultHeads.Query*faultHeads.Dim)
	for i := range q {
		q[i] = 0.5
	}
	calls := map[string]error{
		"Prefill":      w.m.Prefill(1, 0, k0, v0, 1),
		"Append":       w.m.Append(0, 0, k0, v0),
		"AppendAll":    w.appendAll(0),
		"SetQuery":     w.m.SetQuery(0, q),
		"Free":         w.m.Free(0),
		"ReadSequence": func() error { _, _, err := w.m.ReadSequence(0, 0); return err }(),
		"ReadOutput":   func() error { _, err := w.m.ReadOutput(0); return err }(),
	}
	_, calls["Attend"] = w.m.Attend(0, q)
	for name, err := range calls {
		require.ErrorIs(t, err, vk.ErrDeviceLost, "%s after the device was lost", name)
	}
	require.NoError(t, w.m.Release())
	require.ErrorIs(t, w.m.Release(), vk.ErrReleased)
	// vktest releases the device when the subtest ends and fails it if
	// anything is left alive.
}

func math32bits(x []float32) []uint32 {
	out := make([]uint32, len(x))
	for i, v := range x {
		out[i] = math.Float32bits(v)
	}
	return out
}

func firstDiff(a, b []float32) string {
	for i := range min(len(a), len(b)) {
		if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
			return fmt.Sprintf("element %d: %v, want %v", i, b[i], a[i])
		}
	}
	return fmt.Sprintf("lengths %d and %d", len(b), len(a))
}
