package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/vksparse/vksparse/vk"
)

func TestProgressMode(t *testing.T) {
	for _, c := range []struct {
		mode     string
		terminal bool
		want     bool
	}{
		{"auto", true, true},
		{"auto", false, false},
		{"always", false, true},
		{"never", true, false},
	} {
		got, err := progressMode(c.mode, c.terminal)
		if err != nil || got != c.want {
			t.Errorf("progressMode(%q, %v) = %v, %v; want %v", c.mode, c.terminal, got, err, c.want)
		}
	}
	if _, err := progressMode("sometimes", true); err == nil {
		t.Error("progressMode accepted an unknown mode")
	}
}

func TestIsTerminalFalseForFilesAndPipes(t *testing.T) {
	f, err := os.Create(filepath.Join(t.TempDir(), "log"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if isTerminal(f) {
		t.Error("a regular file counts as a terminal")
	}
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	if isTerminal(w) {
		t.Error("a pipe counts as a terminal")
	}
}

// TestWriteJSONNamesFilesByBase checks that the command a result records
// names the files it was given by absolute paths (alone or in a
// comma-separated list) by their base only.
func TestWriteJSONNamesFilesByBase(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "r.json")
	plot := filepath.Join(dir, "sub", "p.png")
	traces := filepath.Join(dir, "t1.safetensors") + "," + filepath.Join(dir, "t2.safetensors")
	if err := writeJSON(out, "vkbench generate -json "+out+" -plot "+plot+" -trace "+traces+" -layouts a; b", vk.Info{}, 1); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	var rep struct{ Command string }
	if err := json.Unmarshal(b, &rep); err != nil {
		t.Fatal(err)
	}
	if want := "vkbench generate -json r.json -plot p.png -trace t1.safetensors,t2.safetensors -layouts a; b"; rep.Command != want {
		t.Errorf("command %q, want %q", rep.Command, want)
	}
}
