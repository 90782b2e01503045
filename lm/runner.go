package lm

import (
	"errors"
	"fmt"
	"slices"
	"sync"

	"github.com/vksparse/vksparse/decode"
	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/vk"
)

// chunkRows is how many positions a prefill computes at once: it bounds
// the activations a prefill holds, whatever the prompt's length.
const chunkRows = 128

// Options tunes a Runner.
type Options struct {
	// CPUPrefill makes Prefill attend on the CPU (exact, float32, over
	// the same fp16 keys and values) instead of on the GPU through the
	// Runner's own dense decode.Model, one position at a time. The GPU
	// way runs len(prompt) × Layers attention dispatches, each over its
	// whole prefix: on software renderers (SwiftShader, lavapipe) a
	// prompt of thousands of bytes takes minutes that way and seconds on
	// the CPU.
	CPUPrefill bool
}

// Runner runs the model with the matrix products on the CPU (float32) and
// every layer's attention on the GPU through a decode.Model, which holds
// the sequences' keys (after RoPE) and values in fp16. Its methods are
// safe for concurrent use (they are serialized); use the decode.Model
// only through the Runner while it runs.
type Runner struct {
	mu       sync.Mutex
	w        *Weights
	m        *decode.Model // the caller's
	scratch  *decode.Model // dense, one slot: Prefill's attention on the GPU
	released bool
}

// NewRunner returns a Runner of the weights w over m, whose geometry must
// be the model's (Heads, KVHeads, HeadDim, Layers); m may attend densely
// or sparsely, and stays the caller's to release. Unless opts.CPUPrefill,
// the Runner allocates a dense decode.Model of one slot of m's capacity on
// dev for Prefill's attention: Release frees it.
func NewRunner(dev *vk.Device, w *Weights, m *decode.Model, opts Options) (*Runner, error) {
	if w == nil || m == nil {
		return nil, fmt.Errorf("lm: NewRunner needs weights and a decode.Model")
	}
	if err := w.validate(); err != nil {
		return nil, err
	}
	c, mc := w.Config, m.Config()
	want := sparse.Heads{Query: c.Heads, KV: c.KVHeads, Dim: c.HeadDim}
	if mc.Heads != want || mc.Layers != c.Layers {
		return nil, fmt.Errorf("lm: the decode.Model has %d layers of %+v, the weights %d layers of %+v", mc.Layers, mc.Heads, c.Layers, want)
	}
	r := &Runner{w: w, m: m}
	if !opts.CPUPrefill {
		var err error
		r.scratch, err = decode.New(dev, decode.Config{Heads: want, Layers: c.Layers, Slots: 1, Capacity: mc.Capacity})
		if err != nil {
			return nil, fmt.Errorf("lm: the prefill's attention: %w", err)
		}
	}
	return r, nil
}

// Release frees the Runner's own decode.Model (not the caller's); the
// Runner is then unusable.
func (r *Runner) Release() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.released {
		return vk.ErrReleased
	}
	r.released = true
	if r.scratch == nil {
		return nil
	}
	err := r.scratch.Release()
	r.scratch = nil
	return err
}

// Prefill runs prompt through the model with dense attention and returns
// the logits at every position, [len(prompt)][Vocab]: logits[t] predicts
// prompt[t+1]. It then stores the prompt's keys and values of every layer
// in slot of the caller's decode.Model (decode.Model.Prefill), which makes
// the slot active for Step. The slot must be idle and the prompt no
// longer than the model's capacity; a prompt too short for a layer's
// policy (decode.Model.Prefill says) is refused after the forward pass,
// leaving the slot idle. Its memory grows linearly with the prompt:
// chunkRows positions' activations and every layer's keys and values.
func (r *Runner) Prefill(slot int, prompt []byte) ([]float32, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.released {
		return nil, fmt.Errorf("lm: Prefill: %w", vk.ErrReleased)
	}
	mc := r.m.Config()
	n := len(prompt)
	switch {
	case n == 0:
		return nil, fmt.Errorf("lm: Prefill of an empty prompt")
	case n > mc.Capacity:
		return nil, fmt.Errorf("lm: prompt of %d bytes beyond the decode.Model's capacity of %d tokens", n, mc.Capacity)
	case slot < 0 || slot >= mc.Slots:
		return nil, fmt.Errorf("lm: slot %d outside [0, %d)", slot, mc.Slots)
	case !slices.Contains(r.m.Idle(), slot):
		return nil, fmt.Errorf("lm: slot %d already holds a sequence: Free it first", slot)
	}
	var (
		logits       []float32
		keys, values [][]float32
		err          error
	)
	if r.scratch == nil {
		logits, keys, values, err = r.w.forward(prompt, chunkRows, r.w.cpuAttend(n))
	} else {
		logits, keys, values, err = r.gpuPrefill(prompt)
	}
	if err != nil {
		return nil, err
	}
	for l := range keys {
		// The values came from fp16: converting them back is exact.
		k, err := kvcache.ToHalves(keys[l])
		var v []uint16
		if err == nil {
			v, err = kvcache.ToHalves(values[l])
		}
		keys[l], values[l] = nil, nil
		if err == nil {
			err = r.m.Prefill(slot, l, k, v, n)
		}
		if err != nil {
			if l > 0 {
				err = errors.Join(err, r.m.Free(slot))
			}
			return nil, fmt.Errorf("lm: storing the prompt's layer %d (nothing stored): %w", l, err)
		}
	}
	return logits, nil
}

// gpuPrefill is forward attending through the scratch model: position 0
// alone first, whose attention over one token is its value, prefilled
// into every layer; then each position's keys and values appended and its
// queries attended. The scratch slot is freed when it returns.
func (r *Runner) gpuPrefill(prompt []byte) (logits []float32, keys, values [][]float32, err error) {
	defer func() {
		if !slices.Contains(r.scratch.Idle(), 0) {
			err = errors.Join(err, r.scratch.Free(0))
		}
	}()
	c := r.w.Config
	kv, qh := c.KVHeads*c.HeadDim, c.Heads*c.HeadDim
	cpu := r.w.cpuAttend(len(prompt))
	return r.w.forward(prompt, 1, func(l int, s *work, t0 int, keys, values []float32) error {
		if t0 == 0 {
			if err := r.scratch.Prefill(0, l, s.kh[:kv], s.vh[:kv], 1); err != nil {
				return fmt.Errorf("lm: prefill attention: %w", err)
			}
			return cpu(l, s, t0, keys, values)
		}
		for i := 0; i < s.rows; i++ {
			if err := r.scratch.Append(0, l, s.kh[i*kv:(i+1)*kv], s.vh[i*kv:(i+1)*kv]); err != nil {
				return fmt.Errorf("lm: prefill attention at position %d: %w", t0+i, err)
			}
			a, err := r.scratch.Attend(l, s.q[i*qh:(i+1)*qh])
			if err != nil {
				return fmt.Errorf("lm: prefill attention at position %d: %w", t0+i, err)
			}
			copy(s.a[i*qh:(i+1)*qh], a)
		}
		return nil
	})
}

// Step runs one token of each active sequence of the caller's
// decode.Model (tokens[i] is the next byte of slot Active()[i]) through
// the model: per layer it appends the tokens' keys and values to their
// slots and attends the queries of all of them with the model's policy.
// It returns the logits, [len(tokens)][Vocab] in Active order. A token's
// position is the number of tokens its slot holds (decode.Model.Len).
// Arguments and room in every slot are checked before anything is
// stored; a failure part way (of the device, or keys beyond fp16's range)
// leaves the tokens appended to the layers before it.
func (r *Runner) Step(tokens []byte) ([]float32, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.released {
		return nil, fmt.Errorf("lm: Step: %w", vk.ErrReleased)
	}
	active := r.m.Active()
	c, mc := r.w.Config, r.m.Config()
	if len(active) == 0 {
		return nil, fmt.Errorf("lm: Step with no active sequence: Prefill a slot first")
	}
	if len(tokens) != len(active) {
		return nil, fmt.Errorf("lm: Step of %d tokens for %d active sequences (slots %v)", len(tokens), len(active), active)
	}
	pos := make([]int, len(active))
	for i, slot := range active {
		pos[i] = r.m.Len(slot, 0)
		for l := 1; l < c.Layers; l++ {
			if n := r.m.Len(slot, l); n != pos[i] {
				return nil, fmt.Errorf("lm: slot %d holds %d tokens in layer 0 and %d in layer %d", slot, pos[i], n, l)
			}
		}
		if pos[i] >= mc.Capacity {
			return nil, fmt.Errorf("lm: slot %d is full (%d tokens, the capacity)", slot, pos[i])
		}
	}
	w, kv, qh := r.w, c.KVHeads*c.HeadDim, c.Heads*c.HeadDim
	s := newWork(c, len(tokens))
	w.embed(s, tokens)
	for l := range w.Layers {
		if err := w.qkv(l, s, pos); err != nil {
			return nil, err
		}
		for i, slot := range active {
			if err := r.m.Append(slot, l, s.kh[i*kv:(i+1)*kv], s.vh[i*kv:(i+1)*kv]); err != nil {
				return nil, fmt.Errorf("lm: Step: %w", err)
			}
		}
		a, err := r.m.Attend(l, s.q[:len(tokens)*qh])
		if err != nil {
			return nil, fmt.Errorf("lm: Step: %w", err)
		}
		copy(s.a, a)
		w.finish(l, s)
	}
	w.head(s)
	return s.logits, nil
}
