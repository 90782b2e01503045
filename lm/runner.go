package lm

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/vksparse/vksparse/decode"
	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/vk"
)

// chunkRows is how many positions a prefill computes at once: it bounds
// the activations a prefill holds, whatever the prompt's length.
const chunkRows = 512

// Options tunes a Runner.
type Options struct {
	// CPUPrefill makes Prefill attend on the CPU (exact, float32, over
	// the same fp16 keys and values) instead of on the GPU: for checks,
	// and for devices whose memory cannot hold the GPU prefill's scratch
	// caches.
	CPUPrefill bool
	// Products says where the prefill computes its matrix products (the
	// decode steps, a row per sequence, compute theirs on the host).
	Products Products
}

// Runner runs the model with the matrix products on the CPU (float32) and
// every layer's attention on the GPU: decoding through a decode.Model,
// which holds the sequences' keys (after RoPE) and values in fp16, and
// prefilling through its own dense attention (blockAttention). Its
// methods are safe for concurrent use (they are serialized); use the
// decode.Model only through the Runner while it runs.
type Runner struct {
	mu       sync.Mutex
	w        *Weights
	m        *decode.Model   // the caller's
	block    *blockAttention // Prefill's attention on the GPU; nil with CPUPrefill
	gpu      *gpuProducts    // Prefill's products on the GPU; nil on the host
	released bool
}

// NewRunner returns a Runner of the weights w over m, whose geometry must
// be the model's (Heads, KVHeads, HeadDim, Layers); m may attend densely
// or sparsely, and stays the caller's to release. Unless opts.CPUPrefill,
// the Runner allocates on dev a scratch cache of m's capacity per layer
// and the plans that attend it, for Prefill: Release frees them.
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
	if opts.CPUPrefill {
		return r, nil
	}
	var err error
	if r.block, err = newBlockAttention(dev, c, mc.Capacity); err != nil {
		return nil, fmt.Errorf("lm: the prefill's attention: %w", err)
	}
	if opts.Products == ProductsGPU || (opts.Products == ProductsAuto && dev.Info().Type != "cpu") {
		if r.gpu, err = newGPUProducts(dev, w, chunkRows); err != nil {
			return nil, errors.Join(err, r.block.release())
		}
	}
	return r, nil
}

// Release frees the Runner's scratch caches and plans (not the caller's
// decode.Model); the Runner is then unusable.
func (r *Runner) Release() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.released {
		return vk.ErrReleased
	}
	r.released = true
	var errs []error
	if r.block != nil {
		errs = append(errs, r.block.release())
	}
	if r.gpu != nil {
		errs = append(errs, r.gpu.release())
	}
	r.block, r.gpu = nil, nil
	return errors.Join(errs...)
}

// LastPrefillTimes returns where the last Encode or Prefill's time went
// (zero with CPUPrefill).
func (r *Runner) LastPrefillTimes() PrefillTimes {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.block == nil {
		return PrefillTimes{}
	}
	return r.block.times
}

// products returns where the prefill computes its matrix products.
func (r *Runner) products() productFunc {
	if r.gpu != nil {
		return r.gpu.mul
	}
	return cpuProducts
}

// Prompt is a prompt run through the model with dense attention: its
// logits at every position and every layer's keys and values, which Store
// puts in a slot, of this Runner's decode.Model or of another Runner's of
// the same weights.
type Prompt struct {
	n            int
	logits       []float32  // [n][Vocab]
	keys, values [][]uint16 // per layer, [KVHeads][n][HeadDim] fp16
}

// Len returns the prompt's length in bytes.
func (p *Prompt) Len() int { return p.n }

// Logits returns the logits at every position, [Len][Vocab]: logits[t]
// predicts byte t+1.
func (p *Prompt) Logits() []float32 { return p.logits }

// Encode runs prompt through the model with dense attention (on the GPU
// unless the Runner was made with CPUPrefill) and returns it with every
// layer's keys and values. The prompt must fit the decode.Model's
// capacity.
func (r *Runner) Encode(prompt []byte) (*Prompt, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.released {
		return nil, fmt.Errorf("lm: Encode: %w", vk.ErrReleased)
	}
	return r.encode(prompt)
}

func (r *Runner) encode(prompt []byte) (*Prompt, error) {
	n := len(prompt)
	switch mc := r.m.Config(); {
	case n == 0:
		return nil, fmt.Errorf("lm: a prefill of an empty prompt")
	case n > mc.Capacity:
		return nil, fmt.Errorf("lm: prompt of %d bytes beyond the decode.Model's capacity of %d tokens", n, mc.Capacity)
	}
	attend := r.w.cpuAttend(n)
	if r.block != nil {
		if err := r.block.reset(); err != nil {
			return nil, err
		}
		attend = r.block.attend(r.w.Config, n)
	}
	start := time.Now()
	logits, keys, values, err := r.w.forward(prompt, chunkRows, attend, r.products())
	if err != nil {
		return nil, err
	}
	if r.block != nil {
		r.block.times.Total = time.Since(start)
	}
	p := &Prompt{n: n, logits: logits, keys: make([][]uint16, len(keys)), values: make([][]uint16, len(keys))}
	for l := range keys {
		// The values came from fp16: converting them back is exact.
		if p.keys[l], err = kvcache.ToHalves(keys[l]); err == nil {
			p.values[l], err = kvcache.ToHalves(values[l])
		}
		if err != nil {
			return nil, fmt.Errorf("lm: layer %d: %w", l, err)
		}
		keys[l], values[l] = nil, nil
	}
	return p, nil
}

// Store puts an encoded prompt's keys and values of every layer in slot of
// the Runner's decode.Model (decode.Model.Prefill), which makes the slot
// active for Step. The slot must be idle; a prompt too short for a
// layer's policy is refused (decode.Model.Prefill says why), leaving the
// slot idle.
func (r *Runner) Store(slot int, p *Prompt) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.released {
		return fmt.Errorf("lm: Store: %w", vk.ErrReleased)
	}
	return r.store(slot, p)
}

func (r *Runner) store(slot int, p *Prompt) error {
	mc := r.m.Config()
	switch {
	case p == nil || len(p.keys) != mc.Layers:
		return fmt.Errorf("lm: Store of a prompt not encoded for %d layers", mc.Layers)
	case p.Len() > mc.Capacity:
		return fmt.Errorf("lm: prompt of %d bytes beyond the decode.Model's capacity of %d tokens", p.Len(), mc.Capacity)
	case slot < 0 || slot >= mc.Slots:
		return fmt.Errorf("lm: slot %d outside [0, %d)", slot, mc.Slots)
	case !slices.Contains(r.m.Idle(), slot):
		return fmt.Errorf("lm: slot %d already holds a sequence: Free it first", slot)
	}
	for l := range p.keys {
		if err := r.m.Prefill(slot, l, p.keys[l], p.values[l], p.Len()); err != nil {
			if l > 0 {
				err = errors.Join(err, r.m.Free(slot))
			}
			return fmt.Errorf("lm: storing the prompt's layer %d (nothing stored): %w", l, err)
		}
	}
	return nil
}

// Prefill runs prompt through the model with dense attention and returns
// the logits at every position, [len(prompt)][Vocab]: logits[t] predicts
// prompt[t+1]; it then stores the prompt's keys and values in slot (Encode
// then Store). The slot must be idle and the prompt no longer than the
// model's capacity; both are checked first.
func (r *Runner) Prefill(slot int, prompt []byte) ([]float32, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.released {
		return nil, fmt.Errorf("lm: Prefill: %w", vk.ErrReleased)
	}
	mc := r.m.Config()
	switch {
	case slot < 0 || slot >= mc.Slots:
		return nil, fmt.Errorf("lm: slot %d outside [0, %d)", slot, mc.Slots)
	case !slices.Contains(r.m.Idle(), slot):
		return nil, fmt.Errorf("lm: slot %d already holds a sequence: Free it first", slot)
	}
	p, err := r.encode(prompt)
	if err != nil {
		return nil, err
	}
	return p.logits, r.store(slot, p)
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
		if err := w.finish(l, s); err != nil {
			return nil, err
		}
	}
	if err := w.head(s); err != nil {
		return nil, err
	}
	return s.logits, nil
}
