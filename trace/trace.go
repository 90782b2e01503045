// Package trace reads and writes attention traces: the keys, values and
// decode queries of one attention layer, captured from a model, in the
// safetensors layout below.
//
// A trace file is a safetensors file (8-byte little-endian header length,
// a JSON header, then raw little-endian data) holding four tensors:
//
//	k      F16  [kv_heads, tokens, head_dim]   keys after RoPE
//	v      F16  [kv_heads, tokens, head_dim]   values
//	q      F16 or F32 [queries, q_heads, head_dim]  queries after RoPE
//	q_pos  I32  [queries]   query i attends keys 0..q_pos[i] inclusive
//
// Query head h uses KV head h / (q_heads/kv_heads). The attention scale is
// 1/sqrt(head_dim) unless the header's __metadata__ sets "scale". Any other
// __metadata__ entries are kept as free-form strings. To evaluate your own
// model, dump one layer's post-RoPE keys, values and a few decode queries in
// this layout and pass the file to vkbench --trace.
//
// Read and Decode accept arbitrary bytes: a malformed or hostile file gives
// an error, never a panic or an allocation larger than the input.
package trace

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"sort"
	"strconv"

	"github.com/x448/float16"
)

// Trace is one layer's attention inputs.
type Trace struct {
	KVHeads, QHeads, HeadDim, Tokens int
	// K and V hold fp16 bit patterns in [KVHeads][Tokens][HeadDim] order.
	K, V []uint16
	// Q holds the decode queries in [Queries][QHeads][HeadDim] order.
	Q []float32
	// QPos[i] is the position of query i; it attends keys 0..QPos[i].
	QPos []int32
	// Scale multiplies q·k before the softmax (1/sqrt(HeadDim) by default).
	Scale float64
	// Meta holds the header's free-form metadata.
	Meta map[string]string
}

// Queries returns the number of decode queries.
func (t *Trace) Queries() int { return len(t.QPos) }

// Query returns query i's vectors, [QHeads][HeadDim].
func (t *Trace) Query(i int) []float32 {
	n := t.QHeads * t.HeadDim
	return t.Q[i*n : (i+1)*n]
}

// product returns the product of dims, or false when a dim is negative or
// the product overflows an int.
func product(dims ...int) (int, bool) {
	p := 1
	for _, d := range dims {
		if d < 0 || (d > 0 && p > math.MaxInt/d) {
			return 0, false
		}
		p *= d
	}
	return p, true
}

// Validate checks that the shapes agree with each other, that the scale is
// a positive number and that every key, value and query is finite.
func (t *Trace) Validate() error {
	kvElems, kvOK := product(t.KVHeads, t.Tokens, t.HeadDim)
	qElems, qOK := product(len(t.QPos), t.QHeads, t.HeadDim)
	switch {
	case t.KVHeads <= 0 || t.QHeads <= 0 || t.HeadDim <= 0 || t.Tokens <= 0:
		return fmt.Errorf("trace: non-positive shape kv_heads=%d q_heads=%d head_dim=%d tokens=%d", t.KVHeads, t.QHeads, t.HeadDim, t.Tokens)
	case t.QHeads%t.KVHeads != 0:
		return fmt.Errorf("trace: q_heads %d is not a multiple of kv_heads %d", t.QHeads, t.KVHeads)
	case !kvOK || len(t.K) != kvElems || len(t.V) != len(t.K):
		return fmt.Errorf("trace: k has %d and v %d elements, want %d heads × %d tokens × %d", len(t.K), len(t.V), t.KVHeads, t.Tokens, t.HeadDim)
	case !qOK || len(t.Q) != qElems:
		return fmt.Errorf("trace: q has %d elements, want %d queries × %d heads × %d", len(t.Q), len(t.QPos), t.QHeads, t.HeadDim)
	case !(t.Scale > 0) || math.IsInf(t.Scale, 0):
		return fmt.Errorf("trace: scale %v is not a positive number", t.Scale)
	}
	for i, p := range t.QPos {
		if p < 0 || int(p) >= t.Tokens {
			return fmt.Errorf("trace: q_pos[%d] = %d outside [0, %d)", i, p, t.Tokens)
		}
	}
	for _, x := range []struct {
		name string
		h    []uint16
	}{{"k", t.K}, {"v", t.V}} {
		for i, h := range x.h {
			if f := float16.Frombits(h); f.IsNaN() || f.IsInf(0) {
				return fmt.Errorf("trace: %s[%d] is %v", x.name, i, f.Float32())
			}
		}
	}
	for i, f := range t.Q {
		if math.IsNaN(float64(f)) || math.IsInf(float64(f), 0) {
			return fmt.Errorf("trace: q[%d] is %v", i, f)
		}
	}
	return nil
}

type tensorHeader struct {
	DType   string `json:"dtype"`
	Shape   []int  `json:"shape"`
	Offsets [2]int `json:"data_offsets"`
}

const maxHeaderBytes = 100 << 20

// Read loads a trace file.
func Read(path string) (*Trace, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("trace: %w", err)
	}
	defer f.Close()
	return decode(f, path)
}

// Decode reads a trace from r (the bytes of a trace file).
func Decode(r io.Reader) (*Trace, error) { return decode(r, "input") }

// decode reads a trace from f, naming it path in errors.
func decode(f io.Reader, path string) (*Trace, error) {
	var hlen uint64
	if err := binary.Read(f, binary.LittleEndian, &hlen); err != nil {
		return nil, fmt.Errorf("trace: %s: reading header length: %w", path, err)
	}
	if hlen == 0 || hlen > maxHeaderBytes {
		return nil, fmt.Errorf("trace: %s: header length %d is not plausible", path, hlen)
	}
	// Read what is there rather than allocating the claimed length up
	// front: a short file cannot make us allocate 100 MiB.
	hdr, err := io.ReadAll(io.LimitReader(f, int64(hlen)))
	if err != nil {
		return nil, fmt.Errorf("trace: %s: reading header: %w", path, err)
	}
	if uint64(len(hdr)) != hlen {
		return nil, fmt.Errorf("trace: %s: reading header: %w (%d of %d bytes)", path, io.ErrUnexpectedEOF, len(hdr), hlen)
	}
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(hdr, &raw); err != nil {
		return nil, fmt.Errorf("trace: %s: header is not JSON: %w", path, err)
	}
	data, err := io.ReadAll(f)
	if err != nil {
		return nil, fmt.Errorf("trace: %s: reading data: %w", path, err)
	}
	t := &Trace{Meta: map[string]string{}}
	if m, ok := raw["__metadata__"]; ok {
		if err := json.Unmarshal(m, &t.Meta); err != nil {
			return nil, fmt.Errorf("trace: %s: __metadata__: %w", path, err)
		}
	}
	tensor := func(name string, rank int) (tensorHeader, []byte, error) {
		var th tensorHeader
		r, ok := raw[name]
		if !ok {
			return th, nil, fmt.Errorf("trace: %s: no tensor %q", path, name)
		}
		if err := json.Unmarshal(r, &th); err != nil {
			return th, nil, fmt.Errorf("trace: %s: tensor %q: %w", path, name, err)
		}
		if len(th.Shape) != rank {
			return th, nil, fmt.Errorf("trace: %s: tensor %q has rank %d, want %d", path, name, len(th.Shape), rank)
		}
		if th.Offsets[0] < 0 || th.Offsets[1] < th.Offsets[0] || th.Offsets[1] > len(data) {
			return th, nil, fmt.Errorf("trace: %s: tensor %q data offsets %v outside %d bytes", path, name, th.Offsets, len(data))
		}
		width := map[string]int{"F16": 2, "F32": 4, "I32": 4}[th.DType]
		if width == 0 {
			return th, nil, fmt.Errorf("trace: %s: tensor %q has unsupported dtype %s", path, name, th.DType)
		}
		b := data[th.Offsets[0]:th.Offsets[1]]
		elems, ok := product(th.Shape...)
		if !ok || elems > len(b)/width {
			return th, nil, fmt.Errorf("trace: %s: tensor %q of shape %v and %s does not fit its %d bytes", path, name, th.Shape, th.DType, len(b))
		}
		if len(b) != elems*width {
			return th, nil, fmt.Errorf("trace: %s: tensor %q holds %d bytes, shape %v of %s needs %d", path, name, len(b), th.Shape, th.DType, elems*width)
		}
		return th, b, nil
	}
	kh, kb, err := tensor("k", 3)
	if err != nil {
		return nil, err
	}
	vh, vb, err := tensor("v", 3)
	if err != nil {
		return nil, err
	}
	qh, qb, err := tensor("q", 3)
	if err != nil {
		return nil, err
	}
	ph, pb, err := tensor("q_pos", 1)
	if err != nil {
		return nil, err
	}
	if kh.DType != "F16" || vh.DType != "F16" || ph.DType != "I32" {
		return nil, fmt.Errorf("trace: %s: want k, v F16 and q_pos I32, got %s, %s, %s", path, kh.DType, vh.DType, ph.DType)
	}
	if fmt.Sprint(kh.Shape) != fmt.Sprint(vh.Shape) {
		return nil, fmt.Errorf("trace: %s: k shape %v differs from v shape %v", path, kh.Shape, vh.Shape)
	}
	t.KVHeads, t.Tokens, t.HeadDim = kh.Shape[0], kh.Shape[1], kh.Shape[2]
	t.QHeads = qh.Shape[1]
	if qh.Shape[2] != t.HeadDim || qh.Shape[0] != ph.Shape[0] {
		return nil, fmt.Errorf("trace: %s: q shape %v does not fit k %v and q_pos %v", path, qh.Shape, kh.Shape, ph.Shape)
	}
	t.K = halves(kb)
	t.V = halves(vb)
	switch qh.DType {
	case "F16":
		for _, h := range halves(qb) {
			t.Q = append(t.Q, float16.Frombits(h).Float32())
		}
	case "F32":
		for i := 0; i < len(qb); i += 4 {
			t.Q = append(t.Q, math.Float32frombits(binary.LittleEndian.Uint32(qb[i:])))
		}
	default:
		return nil, fmt.Errorf("trace: %s: q has dtype %s, want F16 or F32", path, qh.DType)
	}
	for i := 0; i < len(pb); i += 4 {
		t.QPos = append(t.QPos, int32(binary.LittleEndian.Uint32(pb[i:])))
	}
	t.Scale = 1 / math.Sqrt(float64(t.HeadDim))
	if s, ok := t.Meta["scale"]; ok {
		v, err := strconv.ParseFloat(s, 64)
		if err != nil || !(v > 0) || math.IsInf(v, 0) {
			return nil, fmt.Errorf("trace: %s: metadata scale %q is not a positive number", path, s)
		}
		t.Scale = v
	}
	if err := t.Validate(); err != nil {
		return nil, fmt.Errorf("%w (%s)", err, path)
	}
	return t, nil
}

func halves(b []byte) []uint16 {
	out := make([]uint16, len(b)/2)
	for i := range out {
		out[i] = binary.LittleEndian.Uint16(b[2*i:])
	}
	return out
}

// Write stores t as a trace file (q as F32, so nothing is lost).
func Write(path string, t *Trace) error {
	if err := t.Validate(); err != nil {
		return err
	}
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("trace: %w", err)
	}
	w := bufio.NewWriterSize(f, 1<<20)
	if err := Encode(w, t); err != nil {
		f.Close()
		return err
	}
	if err := w.Flush(); err != nil {
		f.Close()
		return fmt.Errorf("trace: %w", err)
	}
	return f.Close()
}

// Encode writes t to w in the layout of a trace file (q as F32).
func Encode(w io.Writer, t *Trace) error {
	if err := t.Validate(); err != nil {
		return err
	}
	type entry struct {
		name  string
		dtype string
		shape []int
		data  []byte
	}
	le := binary.LittleEndian
	k := make([]byte, 2*len(t.K))
	v := make([]byte, 2*len(t.V))
	for i := range t.K {
		le.PutUint16(k[2*i:], t.K[i])
		le.PutUint16(v[2*i:], t.V[i])
	}
	q := make([]byte, 4*len(t.Q))
	for i, x := range t.Q {
		le.PutUint32(q[4*i:], math.Float32bits(x))
	}
	p := make([]byte, 4*len(t.QPos))
	for i, x := range t.QPos {
		le.PutUint32(p[4*i:], uint32(x))
	}
	entries := []entry{
		{"q_pos", "I32", []int{len(t.QPos)}, p},
		{"k", "F16", []int{t.KVHeads, t.Tokens, t.HeadDim}, k},
		{"q", "F32", []int{len(t.QPos), t.QHeads, t.HeadDim}, q},
		{"v", "F16", []int{t.KVHeads, t.Tokens, t.HeadDim}, v},
	}
	header := map[string]any{}
	meta := map[string]string{}
	for key, val := range t.Meta {
		meta[key] = val
	}
	meta["scale"] = strconv.FormatFloat(t.Scale, 'g', -1, 64)
	header["__metadata__"] = meta
	off := 0
	sort.Slice(entries, func(i, j int) bool { return entries[i].name < entries[j].name })
	for _, e := range entries {
		header[e.name] = tensorHeader{DType: e.dtype, Shape: e.shape, Offsets: [2]int{off, off + len(e.data)}}
		off += len(e.data)
	}
	hdr, err := json.Marshal(header)
	if err != nil {
		return fmt.Errorf("trace: %w", err)
	}
	for len(hdr)%8 != 0 {
		hdr = append(hdr, ' ')
	}
	if err := binary.Write(w, le, uint64(len(hdr))); err != nil {
		return fmt.Errorf("trace: %w", err)
	}
	if _, err := w.Write(hdr); err != nil {
		return fmt.Errorf("trace: %w", err)
	}
	for _, e := range entries {
		if _, err := w.Write(e.data); err != nil {
			return fmt.Errorf("trace: %w", err)
		}
	}
	return nil
}
