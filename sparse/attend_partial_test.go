package sparse

import (
	"bytes"
	"encoding/binary"
	"math"
	"os"
	"reflect"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/vk"
)

// glslDecl is one declaration of a kernel's interface: a specialization
// constant, a push-constant member or a buffer, with its id (constant_id
// or binding; a member's place in its block) and its type (the block's
// name for a buffer).
type glslDecl struct {
	id         int
	typ, name  string
	declaredAs string
}

var (
	glslComment  = regexp.MustCompile(`(?s)//[^\n]*|/\*.*?\*/`)
	glslConstant = regexp.MustCompile(`layout\s*\(\s*constant_id\s*=\s*(\d+)\s*\)\s*const\s+(\w+)\s+(\w+)`)
	glslPush     = regexp.MustCompile(`(?s)layout\s*\(\s*push_constant\s*\)\s*uniform\s+\w+\s*\{(.*?)\}`)
	glslBuffer   = regexp.MustCompile(`layout\s*\(\s*std430\s*,\s*binding\s*=\s*(\d+)\s*\)[^{;]*\bbuffer\s+(\w+)`)
)

// parseKernelInterface reads a GLSL compute kernel's specialization
// constants (in constant_id order), push-constant members (in block
// order) and buffers (in binding order).
func parseKernelInterface(t *testing.T, src string) (constants, push, buffers []glslDecl) {
	t.Helper()
	src = glslComment.ReplaceAllString(src, "")
	atoi := func(s string) int {
		n, err := strconv.Atoi(s)
		require.NoError(t, err)
		return n
	}
	for _, m := range glslConstant.FindAllStringSubmatch(src, -1) {
		constants = append(constants, glslDecl{id: atoi(m[1]), typ: m[2], name: m[3], declaredAs: m[0]})
	}
	sort.SliceStable(constants, func(i, j int) bool { return constants[i].id < constants[j].id })
	blocks := glslPush.FindAllStringSubmatch(src, -1)
	require.Len(t, blocks, 1, "one push_constant block")
	for _, stmt := range strings.Split(blocks[0][1], ";") {
		fields := strings.Fields(strings.ReplaceAll(stmt, ",", " "))
		if len(fields) == 0 {
			continue
		}
		require.GreaterOrEqual(t, len(fields), 2, "push member %q", stmt)
		for _, name := range fields[1:] {
			push = append(push, glslDecl{id: len(push), typ: fields[0], name: name, declaredAs: strings.TrimSpace(stmt)})
		}
	}
	for _, m := range glslBuffer.FindAllStringSubmatch(src, -1) {
		buffers = append(buffers, glslDecl{id: atoi(m[1]), typ: "buffer", name: m[2], declaredAs: m[0]})
	}
	sort.SliceStable(buffers, func(i, j int) bool { return buffers[i].id < buffers[j].id })
	return constants, push, buffers
}

// requireDenseIDs checks that decls' ids are 0, 1, … in order (no gap, no
// id declared twice).
func requireDenseIDs(t *testing.T, decls []glslDecl, what string) {
	t.Helper()
	for i, d := range decls {
		require.Equal(t, i, d.id, "%s %d: %s", what, i, d.declaredAs)
	}
}

// goFieldKinds are the Go kinds that encode each GLSL scalar type, a word
// each; a uint may also be four bytes of a byte array.
var goFieldKinds = map[string][]reflect.Kind{"uint": {reflect.Uint32, reflect.Array}, "float": {reflect.Float32}, "int": {reflect.Int32}}

// requireWordsMatch checks a struct of word-sized fields against the
// kernel's declarations: its glsl tags name the declarations in order
// (one tag may name several members a field fills, as "a,b"), each field's
// type fits its declarations' and is their size, and encode puts every
// field, little-endian, in its declarations' words and nowhere else.
func requireWordsMatch(t *testing.T, typ reflect.Type, decls []glslDecl, encode func(reflect.Value) []uint32) {
	t.Helper()
	var declared, names []string
	for _, d := range decls {
		declared = append(declared, d.name)
	}
	for i := range typ.NumField() {
		tag, ok := typ.Field(i).Tag.Lookup("glsl")
		require.True(t, ok, "%s.%s has no glsl tag", typ.Name(), typ.Field(i).Name)
		names = append(names, strings.Split(tag, ",")...)
	}
	require.Equal(t, declared, names, "%s's fields against the shader's declarations", typ.Name())

	next := 0 // the first declaration of field i
	for i := range typ.NumField() {
		f := typ.Field(i)
		members := strings.Split(f.Tag.Get("glsl"), ",")
		require.Equal(t, 4*len(members), binary.Size(reflect.Zero(f.Type).Interface()), "%s.%s's bytes for %v", typ.Name(), f.Name, members)
		for _, d := range decls[next : next+len(members)] {
			require.Contains(t, goFieldKinds[d.typ], f.Type.Kind(), "%s.%s (%s) encodes %s", typ.Name(), f.Name, f.Type, d.declaredAs)
			if f.Type.Kind() == reflect.Array {
				require.Equal(t, reflect.Uint8, f.Type.Elem().Kind(), "%s.%s packs bytes", typ.Name(), f.Name)
			}
		}

		// Field i alone set to distinct bytes lands in its words.
		v := reflect.New(typ).Elem()
		setMarker(v.Field(i), i)
		var raw bytes.Buffer
		require.NoError(t, binary.Write(&raw, binary.LittleEndian, v.Field(i).Interface()))
		want := make([]uint32, len(decls))
		for k := range members {
			want[next+k] = binary.LittleEndian.Uint32(raw.Bytes()[4*k:])
		}
		require.Equal(t, want, encode(v), "%s.%s encoded alone", typ.Name(), f.Name)
		next += len(members)
	}
}

// setMarker sets v, a word-sized field or a byte array, to a value whose
// bytes are all non-zero and that depends on i.
func setMarker(v reflect.Value, i int) {
	switch v.Kind() {
	case reflect.Uint32:
		v.SetUint(0x81828300 + uint64(i) + 1)
	case reflect.Int32:
		v.SetInt(-0x01020300 - int64(i))
	case reflect.Float32:
		v.SetFloat(float64(math.Float32frombits(0x3f818200 + uint32(i) + 1)))
	case reflect.Array:
		for j := range v.Len() {
			v.Index(j).SetUint(uint64(0x40 + 8*j + i%8))
		}
	default:
		panic("setMarker: field of kind " + v.Kind().String())
	}
}

// TestAttendPartialInterface checks partialSpec, partialPush and
// partialBuffers against attend_partial's source: the same names in the
// same order (constant_id and binding ids 0, 1, …), of the same sizes,
// each field encoded into its own word.
func TestAttendPartialInterface(t *testing.T) {
	src, err := os.ReadFile("../shaders/attend_partial.comp")
	require.NoError(t, err)
	constants, push, buffers := parseKernelInterface(t, string(src))
	require.NotEmpty(t, constants)
	require.NotEmpty(t, push)
	require.NotEmpty(t, buffers)
	requireDenseIDs(t, constants, "constant_id")
	requireDenseIDs(t, buffers, "binding")

	requireWordsMatch(t, reflect.TypeFor[partialSpec](), constants, func(v reflect.Value) []uint32 {
		return v.Interface().(partialSpec).words()
	})
	requireWordsMatch(t, reflect.TypeFor[partialPush](), push, func(v reflect.Value) []uint32 {
		return v.Interface().(partialPush).words()
	})
	require.Equal(t, partialPushWords, len(push), "partialPushWords")

	// Buffers: field i alone set lands in binding i; the others get the
	// stand-in.
	typ := reflect.TypeFor[partialBuffers]()
	require.Equal(t, len(buffers), typ.NumField(), "partialBuffers' fields against the shader's bindings")
	require.Equal(t, partialBindings, len(buffers), "partialBindings")
	unused := vk.Range{Offset: 1}
	for i, b := range buffers {
		f := typ.Field(i)
		require.Equal(t, b.name, f.Tag.Get("glsl"), "partialBuffers.%s against %s", f.Name, b.declaredAs)
		require.Equal(t, reflect.TypeFor[vk.Range](), f.Type, "partialBuffers.%s", f.Name)
		set := vk.Range{Buffer: &vk.Buffer{}, Offset: 2}
		var bufs partialBuffers
		reflect.ValueOf(&bufs).Elem().Field(i).Set(reflect.ValueOf(set))
		got := bufs.ranges(unused)
		require.Len(t, got, len(buffers))
		for j, r := range got {
			if j == i {
				require.Equal(t, set, r, "partialBuffers.%s in binding %d", f.Name, j)
			} else {
				require.Equal(t, unused, r, "binding %d with only partialBuffers.%s set", j, f.Name)
			}
		}
	}
}

// TestParseKernelInterface checks the parser on a kernel of each kind of
// declaration, comments and lists of members included.
func TestParseKernelInterface(t *testing.T) {
	src := `
layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint B = 2; // layout(constant_id = 7) const uint X = 1;
layout(constant_id = 0) const float A = 1.0;
/* layout(std430, binding = 3) buffer Hidden { uint h[]; }; */
layout(std430, binding = 1) restrict readonly buffer Second { uint s[]; };
layout(std430, binding = 0) coherent buffer First { vec2 f[]; };
layout(push_constant) uniform Push {
	uint n;  // a comment; with a semicolon
	float scale;
	uint lo, hi;
} pc;
`
	constants, push, buffers := parseKernelInterface(t, src)
	require.Equal(t, []glslDecl{{0, "float", "A", ""}, {1, "uint", "B", ""}}, clearDeclaredAs(constants))
	require.Equal(t, []glslDecl{{0, "uint", "n", ""}, {1, "float", "scale", ""}, {2, "uint", "lo", ""}, {3, "uint", "hi", ""}}, clearDeclaredAs(push))
	require.Equal(t, []glslDecl{{0, "buffer", "First", ""}, {1, "buffer", "Second", ""}}, clearDeclaredAs(buffers))
}

func clearDeclaredAs(decls []glslDecl) []glslDecl {
	out := make([]glslDecl, len(decls))
	for i, d := range decls {
		d.declaredAs = ""
		out[i] = d
	}
	return out
}
