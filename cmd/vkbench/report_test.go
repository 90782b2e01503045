package main

import (
	"os"
	"path/filepath"
	"testing"
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
