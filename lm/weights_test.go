package lm

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// modelFile is the project's model, relative to this package.
var modelFile = filepath.Join("..", "testdata", "model", "model-int8.safetensors")

var (
	weightsOnce sync.Once
	weightsVal  *Weights
	weightsErr  error
)

// testWeights loads the model once for all tests.
func testWeights(t testing.TB) *Weights {
	t.Helper()
	weightsOnce.Do(func() { weightsVal, weightsErr = LoadWeights(modelFile) })
	require.NoError(t, weightsErr)
	return weightsVal
}

func TestLoadWeights(t *testing.T) {
	w := testWeights(t)
	require.Equal(t, DefaultConfig(), w.Config)
	c := w.Config
	require.Len(t, w.Emb, c.Vocab*c.Dim)
	require.Len(t, w.Head, c.Vocab*c.Dim)
	require.Len(t, w.Nf, c.Dim)
	require.Len(t, w.Layers, c.Layers)
	for _, l := range w.Layers {
		require.Len(t, l.Wq, c.Dim*c.Dim)
		require.Len(t, l.Wk, c.KVHeads*c.HeadDim*c.Dim)
		require.Len(t, l.Wv, c.KVHeads*c.HeadDim*c.Dim)
		require.Len(t, l.Wo, c.Dim*c.Dim)
		require.Len(t, l.W1, c.Hidden*c.Dim)
		require.Len(t, l.W3, c.Hidden*c.Dim)
		require.Len(t, l.W2, c.Dim*c.Hidden)
		require.Len(t, l.N1, c.Dim)
		require.Len(t, l.N2, c.Dim)
	}
	// Dequantization: every row of a matrix is a multiple of its scale.
	raw, err := os.ReadFile(modelFile)
	require.NoError(t, err)
	st, err := parseSafetensors(bytes.NewReader(raw))
	require.NoError(t, err)
	q, err := st.tensor("blocks.3.w2.weight", "I8", c.Dim, c.Hidden)
	require.NoError(t, err)
	scale, err := st.f32("blocks.3.w2.scale", c.Dim)
	require.NoError(t, err)
	for _, i := range []int{0, 1, 777, c.Dim*c.Hidden - 1} {
		require.Equal(t, float32(int8(q[i]))*scale[i/c.Hidden], w.Layers[3].W2[i])
	}
}

// header splits a safetensors file into its header and its data.
func header(t *testing.T, raw []byte) (map[string]any, []byte) {
	t.Helper()
	n := binary.LittleEndian.Uint64(raw)
	var h map[string]any
	require.NoError(t, json.Unmarshal(raw[8:8+n], &h))
	return h, raw[8+n:]
}

// file joins a header and data into a safetensors file.
func file(t *testing.T, h map[string]any, data []byte) []byte {
	t.Helper()
	hj, err := json.Marshal(h)
	require.NoError(t, err)
	out := binary.LittleEndian.AppendUint64(nil, uint64(len(hj)))
	return append(append(out, hj...), data...)
}

func TestReadWeightsRejectsBadFiles(t *testing.T) {
	raw, err := os.ReadFile(modelFile)
	require.NoError(t, err)
	hn := int(binary.LittleEndian.Uint64(raw))

	// edit returns the file with its header changed by f (on a copy).
	edit := func(f func(h map[string]any, data []byte) []byte) []byte {
		h, data := header(t, raw)
		data = append([]byte(nil), data...)
		if d := f(h, data); d != nil {
			data = d
		}
		return file(t, h, data)
	}
	entry := func(h map[string]any, name string) map[string]any { return h[name].(map[string]any) }
	offsets := func(h map[string]any, name string) (int, int) {
		o := entry(h, name)["data_offsets"].([]any)
		return int(o[0].(float64)), int(o[1].(float64))
	}
	// The real file still reads after a round trip through edit.
	_, err = ReadWeights(bytes.NewReader(edit(func(map[string]any, []byte) []byte { return nil })))
	require.NoError(t, err)

	cases := []struct {
		name, want string
		file       []byte
	}{
		{"empty", "header length", nil},
		{"cut in the length", "header length", raw[:5]},
		{"cut in the header", "header", raw[:8+hn/2]},
		{"cut in the data", "outside", raw[:8+hn+1000]},
		{"cut one byte short", "outside", raw[:len(raw)-1]},
		{"a byte past the data", "the file holds", append(append([]byte(nil), raw...), 0)},
		{"huge header length", "header of", binary.LittleEndian.AppendUint64(nil, 1<<40)},
		{"header not JSON", "not a JSON object", append(binary.LittleEndian.AppendUint64(nil, 9), []byte("{not json")...)},
		{"header a JSON array", "not a JSON object", append(binary.LittleEndian.AppendUint64(nil, 2), []byte("[]")...)},
		{"unknown field", "bad header entry", edit(func(h map[string]any, _ []byte) []byte {
			entry(h, "nf.weight")["strides"] = []int{1}
			return nil
		})},
		{"metadata not strings", "__metadata__", edit(func(h map[string]any, _ []byte) []byte {
			h["__metadata__"] = map[string]any{"config": 3}
			return nil
		})},
		{"missing tensor", `"nf.weight" is missing`, edit(func(h map[string]any, _ []byte) []byte {
			h["nf.renamed"] = h["nf.weight"]
			delete(h, "nf.weight")
			return nil
		})},
		{"wrong dtype", "is U8, want I8", edit(func(h map[string]any, _ []byte) []byte {
			entry(h, "blocks.0.wq.weight")["dtype"] = "U8"
			return nil
		})},
		{"wrong dtype and size", "needs", edit(func(h map[string]any, _ []byte) []byte {
			entry(h, "blocks.2.wk.scale")["dtype"] = "F16"
			return nil
		})},
		{"unknown dtype", "unknown dtype", edit(func(h map[string]any, _ []byte) []byte {
			entry(h, "head.scale")["dtype"] = "F12"
			return nil
		})},
		{"wrong shape", "has shape [64 1024], want [128 512]", edit(func(h map[string]any, _ []byte) []byte {
			entry(h, "blocks.5.wv.weight")["shape"] = []int{64, 1024}
			return nil
		})},
		{"negative shape", "has shape", edit(func(h map[string]any, _ []byte) []byte {
			entry(h, "blocks.5.wv.weight")["shape"] = []int{-128, -512}
			return nil
		})},
		{"offsets out of range", "outside", edit(func(h map[string]any, data []byte) []byte {
			b, e := offsets(h, "nf.weight")
			entry(h, "nf.weight")["data_offsets"] = []int{b + len(data), e + len(data)}
			return nil
		})},
		{"overlapping tensors", "overlap", edit(func(h map[string]any, _ []byte) []byte {
			entry(h, "blocks.1.n2.weight")["data_offsets"] = entry(h, "blocks.1.n1.weight")["data_offsets"]
			return nil
		})},
		{"one offset", "data offsets", edit(func(h map[string]any, _ []byte) []byte {
			entry(h, "nf.weight")["data_offsets"] = []int{0}
			return nil
		})},
		{"NaN scale", "is NaN", edit(func(h map[string]any, data []byte) []byte {
			b, _ := offsets(h, "blocks.4.w1.scale")
			binary.LittleEndian.PutUint32(data[b+40:], math.Float32bits(float32(math.NaN())))
			return data
		})},
		{"infinite norm weight", "is +Inf", edit(func(h map[string]any, data []byte) []byte {
			b, _ := offsets(h, "blocks.0.n1.weight")
			binary.LittleEndian.PutUint32(data[b:], math.Float32bits(float32(math.Inf(1))))
			return data
		})},
		{"metadata config disagrees", "d = 256, want 512", edit(func(h map[string]any, _ []byte) []byte {
			meta := h["__metadata__"].(map[string]any)
			meta["config"] = strings.Replace(meta["config"].(string), `"d": 512`, `"d": 256`, 1)
			return nil
		})},
		{"metadata config not JSON", "metadata config", edit(func(h map[string]any, _ []byte) []byte {
			h["__metadata__"].(map[string]any)["config"] = "{"
			return nil
		})},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			w, err := ReadWeights(bytes.NewReader(c.file))
			require.Error(t, err)
			require.Nil(t, w)
			require.Contains(t, err.Error(), c.want)
		})
	}
	_, err = LoadWeights(filepath.Join(t.TempDir(), "none.safetensors"))
	require.Error(t, err)
}

// TestMetadataConfig checks what the real file's metadata holds.
func TestMetadataConfig(t *testing.T) {
	raw, err := os.ReadFile(modelFile)
	require.NoError(t, err)
	h, _ := header(t, raw)
	var mc map[string]float64
	require.NoError(t, json.Unmarshal([]byte(h["__metadata__"].(map[string]any)["config"].(string)), &mc))
	c := DefaultConfig()
	require.Equal(t, map[string]float64{"vocab": float64(c.Vocab), "d": float64(c.Dim), "layers": float64(c.Layers), "hq": float64(c.Heads),
		"hkv": float64(c.KVHeads), "dh": float64(c.HeadDim), "mlp": float64(c.Hidden), "theta": c.RopeTheta}, mc)
}
