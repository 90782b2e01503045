package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/vksparse/vksparse/trace"
	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/workload"
)

// table prints rows aligned under a header.
func table(w io.Writer, header []string, rows [][]string) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, strings.Join(header, "\t")+"\t")
	for _, r := range rows {
		fmt.Fprintln(tw, strings.Join(r, "\t")+"\t")
	}
	tw.Flush()
}

// report is what --json writes: the device, the date and the rows.
type report struct {
	Tool    string  `json:"tool"`
	Command string  `json:"command"`
	Date    string  `json:"date"`
	Device  vk.Info `json:"device"`
	Results any     `json:"results"`
}

// writeJSON writes a report of results to path; its command names the file
// by its base name only, so that results carry no directories of the
// machine they ran on.
func writeJSON(path, command string, info vk.Info, results any) error {
	// Files named by absolute paths are named by their base: where a run
	// kept them is nobody else's business.
	fields := strings.Fields(command)
	for i, f := range fields {
		parts := strings.Split(f, ",") // a list of files, say
		for j, p := range parts {
			if p == path || filepath.IsAbs(p) {
				parts[j] = filepath.Base(p)
			}
		}
		fields[i] = strings.Join(parts, ",")
	}
	command = strings.Join(fields, " ")
	b, err := json.MarshalIndent(report{Tool: "vkbench", Command: command, Date: time.Now().UTC().Format(time.RFC3339), Device: info, Results: results}, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}

// layers returns the trace at tracePath (named by its file's name), or
// else one generated layer of the named kinds per context length in ns,
// with their names.
func layers(tracePath, ns, kinds string, qHeads, kvHeads, dim int, seed int64) ([]*trace.Trace, []string, error) {
	if tracePath != "" {
		t, err := trace.Read(tracePath)
		if err != nil {
			return nil, nil, err
		}
		return []*trace.Trace{t}, []string{filepath.Base(tracePath)}, nil
	}
	nList, err := ints(ns)
	if err != nil {
		return nil, nil, fmt.Errorf("-n: %v", err)
	}
	var traces []*trace.Trace
	var names []string
	for _, n := range nList {
		cfg, err := workload.NamedConfig(kinds, n, qHeads, kvHeads, dim)
		if err != nil {
			return nil, nil, fmt.Errorf("-kinds: %v", err)
		}
		cfg.Seed = seed
		t, err := workload.Generate(cfg)
		if err != nil {
			return nil, nil, err
		}
		traces, names = append(traces, t), append(names, fmt.Sprintf("workload n=%d %s", n, kinds))
	}
	return traces, names, nil
}

// ints parses a comma-separated list of positive integers.
func ints(s string) ([]int, error) { return intsFrom(s, 1) }

// intsFrom parses a comma-separated list of integers of at least least.
func intsFrom(s string, least int) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		v, err := strconv.Atoi(f)
		if err != nil || v < least {
			return nil, fmt.Errorf("%q is not an integer of at least %d", f, least)
		}
		out = append(out, v)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("empty list")
	}
	return out, nil
}

// floats parses a comma-separated list of numbers.
func floats(s string) ([]float64, error) {
	var out []float64
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		v, err := strconv.ParseFloat(f, 64)
		if err != nil {
			return nil, fmt.Errorf("%q is not a number", f)
		}
		out = append(out, v)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("empty list")
	}
	return out, nil
}

// showProgress says whether progress lines are drawn; main sets it from
// the -progress flag (by default: only when stderr is a terminal).
var showProgress bool

// progressMode turns the -progress flag's value into whether to draw
// progress, given whether stderr is a terminal.
func progressMode(mode string, terminal bool) (bool, error) {
	switch mode {
	case "auto":
		return terminal, nil
	case "always":
		return true, nil
	case "never":
		return false, nil
	}
	return false, fmt.Errorf("-progress must be auto, always or never, not %q", mode)
}

// isTerminal reports whether f is a character device (a terminal, not a
// pipe or a file).
func isTerminal(f *os.File) bool {
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}

// progress writes a one-line status to stderr, overwritten by the next,
// when showProgress is set; otherwise it only counts.
type progress struct {
	total, done int
	start       time.Time
	drawn       bool
}

func (p *progress) step(what string) {
	p.done++
	if p.start.IsZero() {
		p.start = time.Now()
	}
	if !showProgress {
		return
	}
	p.drawn = true
	fmt.Fprintf(os.Stderr, "\r\033[K[%d/%d %s] %s", p.done, p.total, time.Since(p.start).Round(time.Second), what)
}

// finish clears the status line, if one was drawn.
func (p *progress) finish() {
	if p.drawn {
		fmt.Fprint(os.Stderr, "\r\033[K")
		p.drawn = false
	}
}

func mib(b uint64) string { return fmt.Sprintf("%d MiB", b>>20) }

// openDevice opens the device the environment picks and names it.
func openDevice() (*vk.Device, error) {
	dev, err := vk.Open(vk.OptionsFromEnv())
	if err != nil {
		return nil, err
	}
	info := dev.Info()
	fmt.Printf("device: %s (%s), driver %s\n", info.Name, info.Type, info.Driver)
	return dev, nil
}
