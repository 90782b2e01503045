package evaluate

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestDeviceTestsListed checks that the tests of this package that open a
// device (through vktest) are exactly those the Taskfile lists in
// EVALUATE_DEVICE_TESTS: CI's second renderer runs only those of this
// package, the others being float64 studies on the CPU that the first
// pass has run. A helper that opens a device fails the check too, since
// the tests that call it would not be told apart.
func TestDeviceTestsListed(t *testing.T) {
	files, err := filepath.Glob("*_test.go")
	require.NoError(t, err)
	require.NotEmpty(t, files)
	fset := token.NewFileSet()
	var opening []string
	for _, name := range files {
		f, err := parser.ParseFile(fset, name, nil, 0)
		require.NoError(t, err)
		for _, d := range f.Decls {
			fn, ok := d.(*ast.FuncDecl)
			if !ok {
				continue
			}
			uses := false
			ast.Inspect(fn, func(n ast.Node) bool {
				if sel, ok := n.(*ast.SelectorExpr); ok {
					if id, ok := sel.X.(*ast.Ident); ok && id.Name == "vktest" {
						uses = true
					}
				}
				return !uses
			})
			if uses {
				require.True(t, strings.HasPrefix(fn.Name.Name, "Test"), "%s: %s opens a device outside a test", name, fn.Name.Name)
				opening = append(opening, fn.Name.Name)
			}
		}
	}
	taskfile, err := os.ReadFile(filepath.Join("..", "Taskfile.yml"))
	require.NoError(t, err)
	var listed []string
	for _, line := range strings.Split(string(taskfile), "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "EVALUATE_DEVICE_TESTS:"); ok {
			for _, name := range strings.Split(v, "|") {
				listed = append(listed, strings.TrimSpace(name))
			}
		}
	}
	slices.Sort(opening)
	slices.Sort(listed)
	require.NotEmpty(t, opening, "no test opens a device: the parse missed them")
	require.Equal(t, opening, listed, "the tests that open a device, against the Taskfile's EVALUATE_DEVICE_TESTS")
}
