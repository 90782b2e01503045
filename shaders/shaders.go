// Package shaders holds the project's GLSL compute kernels and their
// SPIR-V, compiled by `go generate ./shaders` (glslc and spirv-val) and
// embedded into the binary.
package shaders

import (
	"embed"
	"fmt"
)

//go:generate sh generate.sh

//go:embed *.spv
var spirv embed.FS

// SPIRV returns the compiled kernel name (the source file's base name).
func SPIRV(name string) ([]byte, error) {
	b, err := spirv.ReadFile(name + ".spv")
	if err != nil {
		return nil, fmt.Errorf("shaders: no kernel %q: %w", name, err)
	}
	return b, nil
}
