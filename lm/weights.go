// Package lm runs the project's byte-level transformer: its int8 weights
// (safetensors), a CPU forward pass in float32 with a float64 reference,
// a Runner whose attention runs on the GPU through a decode.Model, and
// what a policy costs the model's next-byte distributions (Costs).
package lm

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"sort"
	"strings"
)

// Config is the model's geometry.
type Config struct {
	Vocab     int     // bytes: 256
	Dim       int     // model width d
	Layers    int     // transformer blocks
	Heads     int     // query heads
	KVHeads   int     // key and value heads; query head h uses KV head h / (Heads/KVHeads)
	HeadDim   int     // per head
	Hidden    int     // MLP width
	RopeTheta float64 // RoPE base θ
	Eps       float32 // RMSNorm ε
}

// DefaultConfig is the geometry the weights file holds.
func DefaultConfig() Config {
	return Config{Vocab: 256, Dim: 512, Layers: 6, Heads: 8, KVHeads: 2, HeadDim: 64, Hidden: 1408, RopeTheta: 100000, Eps: 1.1920929e-07}
}

// Layer is one transformer block's weights. Matrices are [out][in]
// row-major: y = x Wᵀ.
type Layer struct {
	N1, N2     []float32 // RMSNorm weights, [Dim]
	Wq, Wo     []float32 // [Dim][Dim]
	Wk, Wv     []float32 // [KVHeads·HeadDim][Dim]
	W1, W3, W2 []float32 // [Hidden][Dim], [Hidden][Dim], [Dim][Hidden]
}

// Weights is the whole model, dequantized to float32.
type Weights struct {
	Config Config
	Emb    []float32 // [Vocab][Dim], row = byte
	Layers []Layer
	Nf     []float32 // final RMSNorm, [Dim]
	Head   []float32 // [Vocab][Dim]
}

// LoadWeights reads a safetensors file of the model (see ReadWeights).
func LoadWeights(path string) (*Weights, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("lm: %w", err)
	}
	defer f.Close()
	w, err := ReadWeights(f)
	if err != nil {
		return nil, fmt.Errorf("%w (%s)", err, path)
	}
	return w, nil
}

// maxHeader bounds the JSON header a file may declare.
const maxHeader = 1 << 24

// tensorInfo is one entry of a safetensors header.
type tensorInfo struct {
	DType   string  `json:"dtype"`
	Shape   []int64 `json:"shape"`
	Offsets []int64 `json:"data_offsets"`
}

// safetensors is a parsed file: its tensors and the data they index.
type safetensors struct {
	tensors  map[string]tensorInfo
	metadata map[string]string
	data     []byte
}

// dtypeSize is the size in bytes of the element types the model uses.
var dtypeSize = map[string]int64{"I8": 1, "U8": 1, "F16": 2, "BF16": 2, "I16": 2, "F32": 4, "I32": 4, "F64": 8, "I64": 8}

// parseSafetensors reads a whole safetensors stream and checks that every
// tensor's offsets lie within the data, match its dtype and shape, and do
// not overlap.
func parseSafetensors(r io.Reader) (*safetensors, error) {
	var size [8]byte
	if _, err := io.ReadFull(r, size[:]); err != nil {
		return nil, fmt.Errorf("lm: reading the safetensors header length: %w", err)
	}
	n := binary.LittleEndian.Uint64(size[:])
	if n == 0 || n > maxHeader {
		return nil, fmt.Errorf("lm: safetensors header of %d bytes (want 1 to %d)", n, maxHeader)
	}
	header := make([]byte, n)
	if _, err := io.ReadFull(r, header); err != nil {
		return nil, fmt.Errorf("lm: reading the %d-byte safetensors header: %w", n, err)
	}
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(header, &raw); err != nil {
		return nil, fmt.Errorf("lm: safetensors header is not a JSON object: %w", err)
	}
	st := &safetensors{tensors: map[string]tensorInfo{}}
	for name, msg := range raw {
		if name == "__metadata__" {
			if err := json.Unmarshal(msg, &st.metadata); err != nil {
				return nil, fmt.Errorf("lm: safetensors __metadata__ is not an object of strings: %w", err)
			}
			continue
		}
		var ti tensorInfo
		dec := json.NewDecoder(bytes.NewReader(msg))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&ti); err != nil {
			return nil, fmt.Errorf("lm: tensor %q: bad header entry: %w", name, err)
		}
		st.tensors[name] = ti
	}
	data, err := io.ReadAll(r)
	if err != nil {
		return nil, fmt.Errorf("lm: reading the tensor data: %w", err)
	}
	st.data = data
	type span struct {
		name       string
		begin, end int64
	}
	spans := make([]span, 0, len(st.tensors))
	for name, ti := range st.tensors {
		es, ok := dtypeSize[ti.DType]
		if !ok {
			return nil, fmt.Errorf("lm: tensor %q has unknown dtype %q", name, ti.DType)
		}
		if len(ti.Offsets) != 2 {
			return nil, fmt.Errorf("lm: tensor %q has %d data offsets, want 2", name, len(ti.Offsets))
		}
		count := int64(1)
		for _, d := range ti.Shape {
			if d < 0 || (d > 0 && count > math.MaxInt32/d) {
				return nil, fmt.Errorf("lm: tensor %q has shape %v", name, ti.Shape)
			}
			count *= d
		}
		b, e := ti.Offsets[0], ti.Offsets[1]
		if b < 0 || e < b || e > int64(len(data)) {
			return nil, fmt.Errorf("lm: tensor %q has data offsets [%d, %d) outside the %d bytes of data (truncated file?)", name, b, e, len(data))
		}
		if e-b != count*es {
			return nil, fmt.Errorf("lm: tensor %q: %s %v needs %d bytes, its offsets [%d, %d) hold %d", name, ti.DType, ti.Shape, count*es, b, e, e-b)
		}
		spans = append(spans, span{name, b, e})
	}
	sort.Slice(spans, func(i, j int) bool { return spans[i].begin < spans[j].begin })
	end := int64(0)
	for i, s := range spans {
		if i > 0 && s.begin < end {
			p := spans[i-1]
			return nil, fmt.Errorf("lm: tensors %q [%d, %d) and %q [%d, %d) overlap", p.name, p.begin, p.end, s.name, s.begin, s.end)
		}
		if s.begin > end {
			return nil, fmt.Errorf("lm: bytes [%d, %d) of the data belong to no tensor (before %q)", end, s.begin, s.name)
		}
		end = s.end
	}
	if end != int64(len(data)) {
		return nil, fmt.Errorf("lm: the tensors index %d bytes of data, the file holds %d", end, len(data))
	}
	return st, nil
}

// tensor returns a tensor's bytes after checking its dtype and shape.
func (st *safetensors) tensor(name, dtype string, shape ...int) ([]byte, error) {
	ti, ok := st.tensors[name]
	if !ok {
		return nil, fmt.Errorf("lm: tensor %q is missing", name)
	}
	if ti.DType != dtype {
		return nil, fmt.Errorf("lm: tensor %q is %s, want %s", name, ti.DType, dtype)
	}
	same := len(ti.Shape) == len(shape)
	for i := 0; same && i < len(shape); i++ {
		same = ti.Shape[i] == int64(shape[i])
	}
	if !same {
		return nil, fmt.Errorf("lm: tensor %q has shape %v, want %v", name, ti.Shape, shape)
	}
	return st.data[ti.Offsets[0]:ti.Offsets[1]], nil
}

// float32s decodes little-endian float32 values.
func float32s(b []byte) []float32 {
	out := make([]float32, len(b)/4)
	for i := range out {
		out[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
	}
	return out
}

// f32 returns an F32 tensor of the given shape whose values are all finite.
func (st *safetensors) f32(name string, shape ...int) ([]float32, error) {
	b, err := st.tensor(name, "F32", shape...)
	if err != nil {
		return nil, err
	}
	x := float32s(b)
	for i, v := range x {
		if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) {
			return nil, fmt.Errorf("lm: tensor %q value %d is %v", name, i, v)
		}
	}
	return x, nil
}

// matrix dequantizes NAME.weight (I8 [out][in]) with NAME.scale (F32
// [out]): w[r][c] = q[r][c] · scale[r].
func (st *safetensors) matrix(name string, out, in int) ([]float32, error) {
	q, err := st.tensor(name+".weight", "I8", out, in)
	if err != nil {
		return nil, err
	}
	scale, err := st.f32(name+".scale", out)
	if err != nil {
		return nil, err
	}
	w := make([]float32, out*in)
	for r := 0; r < out; r++ {
		s := scale[r]
		row, qr := w[r*in:(r+1)*in], q[r*in:(r+1)*in]
		for c := range row {
			row[c] = float32(int8(qr[c])) * s
		}
	}
	return w, nil
}

// metaConfig is the config the exporter writes into __metadata__.
type metaConfig struct {
	Vocab  *int     `json:"vocab"`
	D      *int     `json:"d"`
	Layers *int     `json:"layers"`
	Hq     *int     `json:"hq"`
	Hkv    *int     `json:"hkv"`
	Dh     *int     `json:"dh"`
	Mlp    *int     `json:"mlp"`
	Theta  *float64 `json:"theta"`
}

// checkMetadata compares the file's __metadata__ config, when it has
// one, with cfg.
func (st *safetensors) checkMetadata(cfg Config) error {
	s, ok := st.metadata["config"]
	if !ok {
		return nil
	}
	var mc metaConfig
	if err := json.Unmarshal([]byte(s), &mc); err != nil {
		return fmt.Errorf("lm: the metadata config is not JSON: %w", err)
	}
	var errs []string
	checkInt := func(key string, got *int, want int) {
		if got != nil && *got != want {
			errs = append(errs, fmt.Sprintf("%s = %d, want %d", key, *got, want))
		}
	}
	checkInt("vocab", mc.Vocab, cfg.Vocab)
	checkInt("d", mc.D, cfg.Dim)
	checkInt("layers", mc.Layers, cfg.Layers)
	checkInt("hq", mc.Hq, cfg.Heads)
	checkInt("hkv", mc.Hkv, cfg.KVHeads)
	checkInt("dh", mc.Dh, cfg.HeadDim)
	checkInt("mlp", mc.Mlp, cfg.Hidden)
	if mc.Theta != nil && *mc.Theta != cfg.RopeTheta {
		errs = append(errs, fmt.Sprintf("theta = %v, want %v", *mc.Theta, cfg.RopeTheta))
	}
	if len(errs) > 0 {
		return fmt.Errorf("lm: the metadata config disagrees with the model: %s", strings.Join(errs, ", "))
	}
	return nil
}

// ReadWeights reads the model from a safetensors stream: every matrix
// NAME.weight I8 [out][in] with NAME.scale F32 [out], dequantized to
// float32 (w[r][c] = q[r][c] · scale[r]), and the F32 RMSNorm weights.
// It checks the file's structure, every tensor's dtype and shape against
// DefaultConfig, that scales and norm weights are finite, and that the
// metadata config, if any, agrees.
func ReadWeights(r io.Reader) (*Weights, error) {
	st, err := parseSafetensors(r)
	if err != nil {
		return nil, err
	}
	cfg := DefaultConfig()
	if err := st.checkMetadata(cfg); err != nil {
		return nil, err
	}
	w := &Weights{Config: cfg, Layers: make([]Layer, cfg.Layers)}
	d, kv := cfg.Dim, cfg.KVHeads*cfg.HeadDim
	var errs []error
	f := func(dst *[]float32) func([]float32, error) {
		return func(x []float32, err error) {
			*dst = x
			errs = append(errs, err)
		}
	}
	f(&w.Emb)(st.matrix("emb", cfg.Vocab, d))
	f(&w.Head)(st.matrix("head", cfg.Vocab, d))
	f(&w.Nf)(st.f32("nf.weight", d))
	for i := range w.Layers {
		l, p := &w.Layers[i], fmt.Sprintf("blocks.%d.", i)
		f(&l.N1)(st.f32(p+"n1.weight", d))
		f(&l.N2)(st.f32(p+"n2.weight", d))
		f(&l.Wq)(st.matrix(p+"wq", d, d))
		f(&l.Wk)(st.matrix(p+"wk", kv, d))
		f(&l.Wv)(st.matrix(p+"wv", kv, d))
		f(&l.Wo)(st.matrix(p+"wo", d, d))
		f(&l.W1)(st.matrix(p+"w1", cfg.Hidden, d))
		f(&l.W3)(st.matrix(p+"w3", cfg.Hidden, d))
		f(&l.W2)(st.matrix(p+"w2", d, cfg.Hidden))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return w, nil
}

// validate checks that the configuration is one the forward pass can
// run and that every tensor has its size.
func (w *Weights) validate() error {
	c := w.Config
	if c.Vocab != 256 || c.Dim <= 0 || c.Layers <= 0 || c.Heads <= 0 || c.KVHeads <= 0 || c.Heads%c.KVHeads != 0 ||
		c.HeadDim <= 0 || c.HeadDim%2 != 0 || c.Hidden <= 0 || !(c.RopeTheta > 0) || !(c.Eps >= 0) || len(w.Layers) != c.Layers {
		return fmt.Errorf("lm: weights of an unusable configuration %+v with %d layers", c, len(w.Layers))
	}
	d, qd, kv := c.Dim, c.Heads*c.HeadDim, c.KVHeads*c.HeadDim
	type tensor struct {
		name string
		x    []float32
		size int
	}
	all := []tensor{{"emb", w.Emb, c.Vocab * d}, {"head", w.Head, c.Vocab * d}, {"nf", w.Nf, d}}
	for i, l := range w.Layers {
		p := fmt.Sprintf("blocks.%d.", i)
		all = append(all, tensor{p + "n1", l.N1, d}, tensor{p + "n2", l.N2, d}, tensor{p + "wq", l.Wq, qd * d},
			tensor{p + "wk", l.Wk, kv * d}, tensor{p + "wv", l.Wv, kv * d}, tensor{p + "wo", l.Wo, d * qd},
			tensor{p + "w1", l.W1, c.Hidden * d}, tensor{p + "w3", l.W3, c.Hidden * d}, tensor{p + "w2", l.W2, d * c.Hidden})
	}
	for _, t := range all {
		if len(t.x) != t.size {
			return fmt.Errorf("lm: %s has %d values, want %d", t.name, len(t.x), t.size)
		}
	}
	return nil
}
