package decode

import (
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestReadmeEmbeddingIsTheExample checks that the README's embedding
// snippet is the body of ExampleModel, one tab less indented.
func TestReadmeEmbeddingIsTheExample(t *testing.T) {
	readme, err := os.ReadFile("../README.md")
	require.NoError(t, err)
	src, err := os.ReadFile("example_test.go")
	require.NoError(t, err)
	_, section, ok := strings.Cut(string(readme), "\n## Embedding\n")
	require.True(t, ok, "the README has an Embedding section")
	_, snippet, ok := strings.Cut(section, "```go\n")
	require.True(t, ok, "the Embedding section has a Go snippet")
	snippet, _, ok = strings.Cut(snippet, "```\n")
	require.True(t, ok)
	_, body, ok := strings.Cut(string(src), "func ExampleModel() {\n")
	require.True(t, ok)
	body, _, ok = strings.Cut(body, "\n}\n")
	require.True(t, ok)
	lines := strings.Split(body, "\n")
	for i, l := range lines {
		lines[i] = strings.TrimPrefix(l, "\t")
	}
	require.Equal(t, strings.Join(lines, "\n")+"\n", snippet, "README.md's embedding snippet and decode/example_test.go's ExampleModel")
}
