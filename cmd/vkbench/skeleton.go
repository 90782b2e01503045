package main

import (
	"fmt"
	"os"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/vksparse/vksparse/evaluate"
	"github.com/vksparse/vksparse/vk"
)

// skeletonCase is one case of `vkbench probe -step`: a step's dependent
// dispatches, each reading its own bytes.
type skeletonCase struct {
	Name  string    `json:"name"`
	Stage []float64 `json:"stage_mb"`
}

// skeletonResult is the fastest chain of a skeleton case for one way of
// placing its buffers: the whole step's median and each stage's.
type skeletonResult struct {
	Name       string    `json:"name"`
	Placement  string    `json:"placement"` // "same": every step reads the same buffers; "rotated": copies that L2 cannot hold between two reads
	Groups     int       `json:"groups"`
	StageMB    []float64 `json:"stage_mb"`
	StageUs    []float64 `json:"stage_median_us"`
	MedianUs   float64   `json:"median_us"`
	GBps       float64   `json:"read_gb_per_s"`
	Dispatches int       `json:"dispatches"`
}

// parseSkeleton parses NAME=MB,MB,...;NAME=... (a missing name becomes the
// case's index).
func parseSkeleton(spec string) ([]skeletonCase, error) {
	var cases []skeletonCase
	for i, part := range strings.Split(spec, ";") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		name, list := fmt.Sprint(i), part
		if k := strings.IndexByte(part, '='); k >= 0 {
			name, list = strings.TrimSpace(part[:k]), part[k+1:]
		}
		mb, err := floats(list)
		if err != nil {
			return nil, fmt.Errorf("case %s: %v", name, err)
		}
		for _, m := range mb {
			if !(m > 0 && m <= 1<<16) {
				return nil, fmt.Errorf("case %s: a stage reads %v MB, want more than 0 and at most 65 536", name, m)
			}
		}
		cases = append(cases, skeletonCase{Name: name, Stage: mb})
	}
	if len(cases) == 0 {
		return nil, fmt.Errorf("no cases")
	}
	return cases, nil
}

// rotatedBytes is how much a skeleton's rotated copies hold in all, at
// least: five times the H100's 50 MB L2, so that a buffer is gone from it
// before it is read again.
const rotatedBytes = 256 << 20

// probeStep times skeleton steps: for each case, chains of dependent
// dispatches of the read probe (compute barriers between them, as a sparse
// step records its stages), stage i streaming its MB from a buffer of its
// own, back to back in one submission with a timestamp after every stage.
// Such a step does nothing but read its bytes contiguously, so no step that
// must read as much in as many dispatches can be faster on the device.
func probeStep(spec, groupList string, reps int, jsonPath, command string) error {
	cases, err := parseSkeleton(spec)
	if err != nil {
		return fmt.Errorf("-step: %v", err)
	}
	groups, err := ints(groupList)
	if err != nil {
		return fmt.Errorf("-step-groups: %v", err)
	}
	dev, pipe, err := openReadProbe()
	if err != nil {
		return err
	}
	defer dev.Release()
	defer pipe.Release()
	most := 0
	for _, g := range groups {
		most = max(most, g)
	}
	dst, err := dev.NewBuffer(uint64(most)*256*4, vk.DeviceLocal)
	if err != nil {
		return err
	}
	defer dst.Release()
	cmd, err := dev.NewCommands()
	if err != nil {
		return err
	}
	defer cmd.Release()
	const warmup = 5
	var results []skeletonResult
	var rows [][]string
	prog := &progress{total: len(cases) * 2 * len(groups)}
	defer prog.finish()
	for ci, sc := range cases {
		for pi, placement := range []string{"same", "rotated"} {
			warm := skeletonWarm(dev.Info(), ci == 0 && pi == 0)
			best, err := timeSkeleton(dev, pipe, cmd, dst, sc, placement, groups, warm, warmup, reps, prog)
			if err != nil {
				return fmt.Errorf("case %s: %w", sc.Name, err)
			}
			results = append(results, best)
			stages := make([]string, len(best.StageUs))
			for i, us := range best.StageUs {
				stages[i] = fmt.Sprintf("%.1f", us)
			}
			total := 0.0
			for _, m := range best.StageMB {
				total += m
			}
			rows = append(rows, []string{best.Name, placement, fmt.Sprint(best.Dispatches), fmt.Sprintf("%.1f", total), fmt.Sprint(best.Groups), fmt.Sprintf("%.1f", best.MedianUs), strings.Join(stages, " / "), fmt.Sprintf("%.0f", best.GBps)})
		}
	}
	prog.finish()
	table(os.Stdout, []string{"case", "buffers", "dispatches", "MB", "groups", "median µs", "stages µs", "GB/s"}, rows)
	if jsonPath != "" {
		return writeJSON(jsonPath, command, dev.Info(), results)
	}
	return nil
}

// skeletonWarm returns how long a skeleton's chain runs untimed before it
// is timed on a device: a second for a device's first skeleton, as the
// steps it is compared with are warmed, and 200 ms for each later one
// (none on a CPU renderer). Unwarmed, the skeletons timed after a run's
// steps took up to 2.7 times as long as in a run of one length, and the
// first of them 2.4 times as long after 200 ms (H100, 2026-12-07; the cause
// not known: clocks or buffers read for the first time).
func skeletonWarm(info vk.Info, first bool) time.Duration {
	switch {
	case info.Type == "cpu":
		return 0
	case first:
		return time.Second
	}
	return 200 * time.Millisecond
}

// timeSkeleton times one case with its buffers placed as placement says,
// for every workgroup count, and returns the fastest. The chain first runs
// untimed for warm (and warmup runs ahead of each timed submission).
func timeSkeleton(dev *vk.Device, pipe *vk.Pipeline, cmd *vk.Commands, dst *vk.Buffer, sc skeletonCase, placement string, groups []int, warm time.Duration, warmup, reps int, prog *progress) (skeletonResult, error) {
	var words []uint32
	stepBytes := uint64(0)
	for _, mb := range sc.Stage {
		w := uint32(mb * 1e6 / 16)
		words = append(words, max(w, 1))
		stepBytes += uint64(max(w, 1)) * 16
	}
	copies := 1
	if placement == "rotated" {
		copies = int((rotatedBytes + stepBytes - 1) / stepBytes)
		copies = max(copies, 2)
	}
	limit := dev.Info().MaxStorageBufferRange
	var bufs []*vk.Buffer
	var binds [][]*vk.Binding
	defer func() {
		for _, bs := range binds {
			for _, b := range bs {
				b.Release()
			}
		}
		for _, b := range bufs {
			b.Release()
		}
	}()
	for c := 0; c < copies; c++ {
		var bs []*vk.Binding
		for _, w := range words {
			if uint64(w)*16 > limit {
				return skeletonResult{}, fmt.Errorf("a stage of %d bytes exceeds the device's storage-buffer range", uint64(w)*16)
			}
			b, err := dev.NewBuffer(uint64(w)*16, vk.DeviceLocal)
			if err != nil {
				return skeletonResult{}, err
			}
			bufs = append(bufs, b)
			bind, err := pipe.Bind(b.All(), dst.All())
			if err != nil {
				return skeletonResult{}, err
			}
			bs = append(bs, bind)
		}
		binds = append(binds, bs)
	}
	ns := len(words)
	stamps, err := dev.NewTimestamps((warmup+reps)*ns + 1)
	if err != nil {
		return skeletonResult{}, err
	}
	defer stamps.Release()
	// run records and submits warmup + reps chains of g workgroups a dispatch.
	run := func(g int) error {
		if err := cmd.Begin(); err != nil {
			return err
		}
		cmd.Reset(stamps)
		cmd.Timestamp(stamps, 0)
		for r := 0; r < warmup+reps; r++ {
			for i, w := range words {
				cmd.ComputeBarrier()
				cmd.Dispatch(pipe, binds[r%copies][i], []uint32{w}, uint32(g), 1, 1)
				cmd.Timestamp(stamps, r*ns+i+1)
			}
		}
		if err := cmd.End(); err != nil {
			return err
		}
		return cmd.Submit()
	}
	for start := time.Now(); time.Since(start) < warm; {
		if err := run(groups[0]); err != nil {
			return skeletonResult{}, err
		}
	}
	var best skeletonResult
	for _, g := range groups {
		prog.step(fmt.Sprintf("skeleton %s, %s buffers, %d workgroups", sc.Name, placement, g))
		if err := run(g); err != nil {
			return skeletonResult{}, err
		}
		d, err := stamps.Durations((warmup+reps)*ns + 1)
		if err != nil {
			return skeletonResult{}, err
		}
		per := make([][]float64, ns)
		var totals []float64
		for r := warmup; r < warmup+reps; r++ {
			t := 0.0
			for i := 0; i < ns; i++ {
				us := float64(d[r*ns+i+1].Nanoseconds()) / 1e3
				per[i] = append(per[i], us)
				t += us
			}
			totals = append(totals, t)
		}
		res := skeletonResult{Name: sc.Name, Placement: placement, Groups: g, StageMB: sc.Stage, MedianUs: medianOf(totals), Dispatches: ns}
		for i := range per {
			res.StageUs = append(res.StageUs, medianOf(per[i]))
		}
		res.GBps = float64(stepBytes) / (res.MedianUs * 1e3)
		if best.Groups == 0 || res.MedianUs < best.MedianUs {
			best = res
		}
	}
	return best, nil
}

// medianOf returns the median of xs (the upper one of an even count).
func medianOf(xs []float64) float64 {
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	return s[len(s)/2]
}

// skeletonTimer times the skeletons of steps (evaluate.Skeleton) with the
// read probe, as `vkbench probe -step` does with buffers read in the same
// place every step (as the timed steps read the same layer every step).
type skeletonTimer struct {
	dev    *vk.Device
	pipe   *vk.Pipeline
	cmd    *vk.Commands
	dst    *vk.Buffer
	groups []int
	reps   int
	warmed bool // whether a skeleton has been timed
}

// skeletonGroups returns the workgroup counts a skeleton is tried with on
// a device: those of `probe -step` on a GPU, a few on a CPU renderer.
func skeletonGroups(info vk.Info) []int {
	if info.Type == "cpu" {
		return []int{4, 16}
	}
	return []int{264, 528, 1056, 2112, 4224}
}

// newSkeletonTimer builds the read probe on dev; each skeleton is timed
// over reps runs.
func newSkeletonTimer(dev *vk.Device, reps int) (*skeletonTimer, error) {
	t := &skeletonTimer{dev: dev, groups: skeletonGroups(dev.Info()), reps: reps}
	var err error
	if t.pipe, err = readProbe(dev); err != nil {
		return nil, err
	}
	if t.dst, err = dev.NewBuffer(uint64(slices.Max(t.groups))*256*4, vk.DeviceLocal); err == nil {
		t.cmd, err = dev.NewCommands()
	}
	if err != nil {
		t.release()
		return nil, err
	}
	return t, nil
}

// time times sk, the skeleton of a step whose median is stepUs, and
// records the times in it (evaluate.Skeleton.Timed). A nil sk is left.
func (t *skeletonTimer) time(name string, sk *evaluate.Skeleton, stepUs float64) error {
	if sk == nil {
		return nil
	}
	if len(sk.Bytes) == 0 {
		return fmt.Errorf("skeleton of %s: no stages", name)
	}
	res, err := timeSkeleton(t.dev, t.pipe, t.cmd, t.dst, skeletonCase{Name: name, Stage: sk.MB()}, "same", t.groups, skeletonWarm(t.dev.Info(), !t.warmed), 5, t.reps, &progress{})
	t.warmed = true
	if err != nil {
		return fmt.Errorf("skeleton of %s: %w", name, err)
	}
	sk.Timed(res.StageUs, res.MedianUs, stepUs)
	return nil
}

func (t *skeletonTimer) release() {
	if t.cmd != nil {
		t.cmd.Release()
	}
	if t.dst != nil {
		t.dst.Release()
	}
	if t.pipe != nil {
		t.pipe.Release()
	}
}

// skeletonCells returns a skeleton's figures for a table: its µs, its
// stages' MB (named, in order) and the step over it ("—" where there is none).
func skeletonCells(sk *evaluate.Skeleton) (us, mb, over string) {
	if sk == nil || sk.Us <= 0 {
		return "—", "—", "—"
	}
	parts := make([]string, len(sk.Bytes))
	for i, m := range sk.MB() {
		parts[i] = fmt.Sprintf("%s %.2f", sk.Stages[i], m)
	}
	return fmt.Sprintf("%.1f", sk.Us), strings.Join(parts, " "), fmt.Sprintf("%.2f×", sk.StepOver)
}
