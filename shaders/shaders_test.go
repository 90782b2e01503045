package shaders

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func digest(t *testing.T, path string) string {
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

// TestManifestCurrent fails when a source changed without `go generate`, or
// a committed .spv is not the one generated from its source.
func TestManifestCurrent(t *testing.T) {
	f, err := os.Open("manifest.txt")
	require.NoError(t, err)
	defer f.Close()
	listed := map[string]bool{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		require.Len(t, fields, 3, "manifest line %q", sc.Text())
		src := fields[2]
		listed[src] = true
		require.Equal(t, fields[0], digest(t, src), "%s changed since its SPIR-V was generated: run go generate ./shaders", src)
		require.Equal(t, fields[1], digest(t, strings.TrimSuffix(src, ".comp")+".spv"), "%s's .spv differs from the generated one: run go generate ./shaders", src)
	}
	require.NoError(t, sc.Err())
	sources, err := filepath.Glob("*.comp")
	require.NoError(t, err)
	require.NotEmpty(t, sources)
	for _, s := range sources {
		require.True(t, listed[s], "%s has no SPIR-V in the manifest: run go generate ./shaders", s)
	}
}

// tool returns the path of a shader tool, skipping when it is absent unless
// VKSPARSE_REQUIRE_TOOLS is set (as in CI), where absence fails.
func tool(t *testing.T, name string) string {
	p, err := exec.LookPath(name)
	if err != nil {
		if os.Getenv("VKSPARSE_REQUIRE_TOOLS") != "" {
			t.Fatalf("%s not installed but VKSPARSE_REQUIRE_TOOLS is set", name)
		}
		t.Skipf("%s not installed: cannot recompile shaders here", name)
	}
	return p
}

// TestSPIRVRebuilds recompiles every source and compares with the committed
// SPIR-V (when the same compiler version is present), and validates it.
func TestSPIRVRebuilds(t *testing.T) {
	glslc := tool(t, "glslc")
	val := tool(t, "spirv-val")
	version, err := exec.Command(glslc, "--version").Output()
	require.NoError(t, err)
	want, err := os.ReadFile("compiler.txt")
	require.NoError(t, err)
	sameCompiler := strings.SplitN(string(version), "\n", 2)[0] == strings.TrimSpace(string(want))
	sources, _ := filepath.Glob("*.comp")
	dir := t.TempDir()
	for _, src := range sources {
		spv := strings.TrimSuffix(src, ".comp") + ".spv"
		out := filepath.Join(dir, spv)
		msg, err := exec.Command(glslc, "-O", "--target-env=vulkan1.1", "-o", out, src).CombinedOutput()
		require.NoError(t, err, "glslc %s: %s", src, msg)
		msg, err = exec.Command(val, "--target-env", "vulkan1.1", spv).CombinedOutput()
		require.NoError(t, err, "committed %s does not pass spirv-val: %s", spv, msg)
		if sameCompiler {
			got, _ := os.ReadFile(out)
			committed, _ := os.ReadFile(spv)
			require.True(t, bytes.Equal(got, committed), "%s is stale: run go generate ./shaders", spv)
		}
	}
	if !sameCompiler {
		t.Logf("glslc differs from the one that generated the SPIR-V (%s); compared digests only", strings.TrimSpace(string(want)))
	}
}

func TestSPIRVLookup(t *testing.T) {
	b, err := SPIRV("attend_partial")
	require.NoError(t, err)
	require.Equal(t, []byte{0x03, 0x02, 0x23, 0x07}, b[:4], "SPIR-V magic number")
	_, err = SPIRV("no_such_kernel")
	require.Error(t, err)
}
