package trace

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"io"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"testing"

	"github.com/x448/float16"
)

// small returns a valid trace of 2 KV heads, 4 query heads, 8 dims, 5
// tokens and 2 queries.
func small() *Trace {
	t := &Trace{KVHeads: 2, QHeads: 4, HeadDim: 8, Tokens: 5, QPos: []int32{2, 4}, Scale: 0.25, Meta: map[string]string{"model": "test"}}
	for i := 0; i < t.KVHeads*t.Tokens*t.HeadDim; i++ {
		t.K = append(t.K, uint16(float16.Fromfloat32(float32(i%7)-3)))
		t.V = append(t.V, uint16(float16.Fromfloat32(float32(i%5)/4)))
	}
	for i := 0; i < len(t.QPos)*t.QHeads*t.HeadDim; i++ {
		t.Q = append(t.Q, float32(i%9)-4.5)
	}
	return t
}

func encode(tb testing.TB, t *Trace) []byte {
	var b bytes.Buffer
	if err := Encode(&b, t); err != nil {
		tb.Fatal(err)
	}
	return b.Bytes()
}

type rawTensor struct {
	name, dtype string
	shape       []int
	data        []byte
}

// file lays out tensors as a safetensors file, without any checks, so that
// tests can build files Encode would refuse to write.
func file(meta map[string]string, tensors ...rawTensor) []byte {
	header := map[string]any{}
	if meta != nil {
		header["__metadata__"] = meta
	}
	var data []byte
	for _, t := range tensors {
		header[t.name] = map[string]any{"dtype": t.dtype, "shape": t.shape, "data_offsets": []int{len(data), len(data) + len(t.data)}}
		data = append(data, t.data...)
	}
	hdr, _ := json.Marshal(header)
	out := binary.LittleEndian.AppendUint64(nil, uint64(len(hdr)))
	return append(append(out, hdr...), data...)
}

// halfQueries is small() with its queries stored as F16, as the captured
// traces store them.
func halfQueries() []byte {
	t := small()
	le := binary.LittleEndian
	var k, v, q, p []byte
	for i := range t.K {
		k = le.AppendUint16(k, t.K[i])
		v = le.AppendUint16(v, t.V[i])
	}
	for _, x := range t.Q {
		q = le.AppendUint16(q, uint16(float16.Fromfloat32(x)))
	}
	for _, x := range t.QPos {
		p = le.AppendUint32(p, uint32(x))
	}
	return file(map[string]string{"scale": "0.125"},
		rawTensor{"k", "F16", []int{2, 5, 8}, k},
		rawTensor{"v", "F16", []int{2, 5, 8}, v},
		rawTensor{"q", "F16", []int{2, 4, 8}, q},
		rawTensor{"q_pos", "I32", []int{2}, p})
}

func TestEncodeDecode(t *testing.T) {
	want := small()
	got, err := Decode(bytes.NewReader(encode(t, want)))
	if err != nil {
		t.Fatal(err)
	}
	want.Meta["scale"] = "0.25"
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("round trip changed the trace:\n got %+v\nwant %+v", got, want)
	}

	path := filepath.Join(t.TempDir(), "t.safetensors")
	if err := Write(path, small()); err != nil {
		t.Fatal(err)
	}
	fromFile, err := Read(path)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(fromFile, want) {
		t.Fatal("Write then Read changed the trace")
	}

	h, err := Decode(bytes.NewReader(halfQueries()))
	if err != nil {
		t.Fatal(err)
	}
	if h.Scale != 0.125 || !reflect.DeepEqual(h.Q, small().Q) {
		t.Fatalf("F16 queries read as %v (scale %v)", h.Q, h.Scale)
	}
}

// TestDecodeRejects checks that malformed files give errors (the fuzz
// target below checks that nothing panics).
func TestDecodeRejects(t *testing.T) {
	good := encode(t, small())
	bad := map[string][]byte{
		"empty":          nil,
		"short length":   good[:4],
		"no header":      good[:8],
		"cut header":     good[:20],
		"cut data":       good[:len(good)-1],
		"huge header":    binary.LittleEndian.AppendUint64(nil, 1<<40),
		"claimed header": append(binary.LittleEndian.AppendUint64(nil, 50<<20), '{'),
		"not json":       append(binary.LittleEndian.AppendUint64(nil, 3), "abc"...),
		"no tensors":     append(binary.LittleEndian.AppendUint64(nil, 2), "{}"...),
		// 2^32 × 2^32 × 1 wraps to 0 elements in 64 bits.
		"overflowing shape": file(nil,
			rawTensor{"k", "F16", []int{1 << 32, 1 << 32, 1}, nil},
			rawTensor{"v", "F16", []int{1 << 32, 1 << 32, 1}, nil},
			rawTensor{"q", "F16", []int{0, 1 << 32, 1}, nil},
			rawTensor{"q_pos", "I32", []int{0}, nil}),
		"negative shape": file(nil,
			rawTensor{"k", "F16", []int{-1, -2, 2}, make([]byte, 8)},
			rawTensor{"v", "F16", []int{-1, -2, 2}, make([]byte, 8)},
			rawTensor{"q", "F16", []int{0, 1, 2}, nil},
			rawTensor{"q_pos", "I32", []int{0}, nil}),
		"infinite scale": file(map[string]string{"scale": "+Inf"},
			rawTensor{"k", "F16", []int{1, 1, 1}, []byte{0, 0x3c}},
			rawTensor{"v", "F16", []int{1, 1, 1}, []byte{0, 0x3c}},
			rawTensor{"q", "F16", []int{1, 1, 1}, []byte{0, 0x3c}},
			rawTensor{"q_pos", "I32", []int{1}, []byte{0, 0, 0, 0}}),
		"NaN key": file(nil,
			rawTensor{"k", "F16", []int{1, 1, 1}, []byte{0, 0x7e}},
			rawTensor{"v", "F16", []int{1, 1, 1}, []byte{0, 0x3c}},
			rawTensor{"q", "F16", []int{1, 1, 1}, []byte{0, 0x3c}},
			rawTensor{"q_pos", "I32", []int{1}, []byte{0, 0, 0, 0}}),
		"position past the keys": file(nil,
			rawTensor{"k", "F16", []int{1, 1, 1}, []byte{0, 0x3c}},
			rawTensor{"v", "F16", []int{1, 1, 1}, []byte{0, 0x3c}},
			rawTensor{"q", "F16", []int{1, 1, 1}, []byte{0, 0x3c}},
			rawTensor{"q_pos", "I32", []int{1}, []byte{1, 0, 0, 0}}),
	}
	for name, b := range bad {
		if tr, err := Decode(bytes.NewReader(b)); err == nil {
			t.Errorf("%s: decoded as %+v", name, tr)
		}
	}
}

// TestRealTraces reads the captured traces in testdata, when present.
func TestRealTraces(t *testing.T) {
	for _, layer := range []string{"L1", "L4"} {
		path := filepath.Join("..", "testdata", "traces", "trace-shared_http_serve_test-"+layer+".safetensors")
		if _, err := os.Stat(path); err != nil {
			t.Skipf("%s: %v", path, err)
		}
		tr, err := Read(path)
		if err != nil {
			t.Fatal(err)
		}
		if tr.KVHeads != 2 || tr.QHeads != 8 || tr.HeadDim != 64 || tr.Tokens != 16384 || tr.Queries() != 64 || tr.Scale != 0.125 {
			t.Fatalf("%s: %d KV heads, %d query heads, dim %d, %d tokens, %d queries, scale %v", layer, tr.KVHeads, tr.QHeads, tr.HeadDim, tr.Tokens, tr.Queries(), tr.Scale)
		}
	}
}

// FuzzRead feeds arbitrary bytes to the reader: it must return a valid
// trace or an error, never panic, and a trace it accepts must come back
// unchanged from Encode.
func FuzzRead(f *testing.F) {
	good := encode(f, small())
	f.Add(good)
	f.Add(halfQueries())
	f.Add(good[:len(good)/2])
	f.Add(good[:12])
	f.Add([]byte{})
	f.Add(binary.LittleEndian.AppendUint64(nil, 1<<40))
	f.Add(file(nil, rawTensor{"k", "F16", []int{1 << 32, 1 << 32, 1}, nil}))
	// The header of a captured trace (its data cut off).
	if b, err := os.ReadFile(filepath.Join("..", "testdata", "traces", "trace-shared_http_serve_test-L4.safetensors")); err == nil {
		f.Add(b[:2048])
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		tr, err := Decode(bytes.NewReader(b))
		if err != nil {
			if tr != nil {
				t.Fatal("a trace returned with an error")
			}
			return
		}
		if err := tr.Validate(); err != nil {
			t.Fatalf("Decode accepted a trace Validate refuses: %v", err)
		}
		for i := 0; i < tr.Queries(); i++ {
			_ = tr.Query(i)
		}
		var out bytes.Buffer
		if err := Encode(&out, tr); err != nil {
			t.Fatalf("Encode refused a decoded trace: %v", err)
		}
		again, err := Decode(io.Reader(&out))
		if err != nil {
			t.Fatalf("re-decoding: %v", err)
		}
		if again.Scale != tr.Scale {
			t.Fatalf("scale %v became %v", tr.Scale, again.Scale)
		}
		tr.Meta["scale"] = strconv.FormatFloat(tr.Scale, 'g', -1, 64)
		sameQ := len(tr.Q) == len(again.Q)
		for i := 0; sameQ && i < len(tr.Q); i++ {
			sameQ = math.Float32bits(tr.Q[i]) == math.Float32bits(again.Q[i])
		}
		if !sameQ || !reflect.DeepEqual(tr.K, again.K) || !reflect.DeepEqual(tr.V, again.V) || !reflect.DeepEqual(tr.QPos, again.QPos) ||
			!reflect.DeepEqual(tr.Meta, again.Meta) || tr.KVHeads != again.KVHeads || tr.QHeads != again.QHeads || tr.HeadDim != again.HeadDim || tr.Tokens != again.Tokens {
			t.Fatal("Encode then Decode changed the trace")
		}
	})
}
