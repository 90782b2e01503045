package main

import (
	"flag"
	"fmt"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/vksparse/vksparse/shaders"
	"github.com/vksparse/vksparse/vk"
)

// probeResult is one row of `vkbench probe`: how fast the device reads a
// buffer, the ceiling that attention's GB/s is measured against.
type probeResult struct {
	Bytes    uint64  `json:"bytes"`
	MedianUs float64 `json:"median_us"`
	GBps     float64 `json:"read_gb_per_s"`
}

func probe(args []string) error {
	fs := flag.NewFlagSet("probe", flag.ExitOnError)
	sizes := fs.String("mib", "64,256,1024", "buffer sizes in MiB (comma-separated)")
	reps := fs.Int("reps", 50, "timed runs per size")
	groups := fs.Int("groups", 4096, "workgroups of 256 threads")
	jsonPath := fs.String("json", "", "write results as JSON to this file")
	chain := fs.String("chain", "", "instead: time chains of this many small dependent dispatches (comma-separated), the cost a pipeline stage pays before its work")
	step := fs.String("step", "", "instead: time skeleton steps, dependent dispatches that only stream the given MB each; cases NAME=MB,MB,... separated by ';'")
	stepGroups := fs.String("step-groups", "264,528,1056,2112,4224", "workgroups of 256 threads tried for every -step case (the fastest is reported)")
	fs.Parse(args)
	if err := checkOutputs(output{"json", *jsonPath}); err != nil {
		return err
	}
	if *chain != "" {
		return probeChain(*chain, *reps, *groups, *jsonPath)
	}
	if *step != "" {
		return probeStep(*step, *stepGroups, *reps, *jsonPath, "probe "+strings.Join(args, " "))
	}
	mibs, err := ints(*sizes)
	if err != nil {
		return fmt.Errorf("-mib: %v", err)
	}
	dev, pipe, err := openReadProbe()
	if err != nil {
		return err
	}
	defer dev.Release()
	defer pipe.Release()
	dst, err := dev.NewBuffer(uint64(*groups)*256*4, vk.DeviceLocal)
	if err != nil {
		return err
	}
	defer dst.Release()
	stamps, err := dev.NewTimestamps(2)
	if err != nil {
		return err
	}
	defer stamps.Release()
	var results []probeResult
	var rows [][]string
	for _, m := range mibs {
		bytes := uint64(m) << 20
		if bytes > dev.Info().MaxStorageBufferRange {
			return fmt.Errorf("%d MiB exceeds the device's storage-buffer range", m)
		}
		src, err := dev.NewBuffer(bytes, vk.DeviceLocal)
		if err != nil {
			return err
		}
		bind, err := pipe.Bind(src.All(), dst.All())
		if err != nil {
			src.Release()
			return err
		}
		var times []float64
		for i := 0; i < 5+*reps; i++ {
			err = dev.Run(func(c *vk.Commands) {
				c.Reset(stamps)
				c.Timestamp(stamps, 0)
				c.Dispatch(pipe, bind, []uint32{uint32(bytes / 16)}, uint32(*groups), 1, 1)
				c.Timestamp(stamps, 1)
			})
			if err != nil {
				break
			}
			el, e := stamps.Elapsed(0, 1)
			if err = e; err != nil {
				break
			}
			if i >= 5 {
				times = append(times, float64(el.Nanoseconds())/1e3)
			}
		}
		bind.Release()
		src.Release()
		if err != nil {
			return err
		}
		sort.Float64s(times)
		r := probeResult{Bytes: bytes, MedianUs: times[len(times)/2]}
		r.GBps = float64(bytes) / (r.MedianUs * 1e3)
		results = append(results, r)
		rows = append(rows, []string{fmt.Sprint(m), fmt.Sprintf("%.1f", r.MedianUs), fmt.Sprintf("%.0f", r.GBps)})
	}
	table(os.Stdout, []string{"MiB", "median µs", "read GB/s"}, rows)
	if *jsonPath != "" {
		return writeJSON(*jsonPath, "probe", dev.Info(), results)
	}
	return nil
}

// chainResult is one row of `vkbench probe -chain`: a chain of dependent
// small dispatches, each reading a 1 MiB buffer, separated by barriers.
type chainResult struct {
	Dispatches int     `json:"dispatches"`
	Groups     int     `json:"groups"`
	Barrier    string  `json:"barrier"` // "full" (shader and transfer) or "compute"
	MedianUs   float64 `json:"median_us"`
	PerStageUs float64 `json:"per_dispatch_us"`
}

// probeChain times chains of k dependent dispatches of the read probe over
// 1 MiB, with the full barrier and with a compute-only barrier between
// them, back to back in one submission as the sparse pipelines run.
func probeChain(list string, reps, groups int, jsonPath string) error {
	ks, err := ints(list)
	if err != nil {
		return fmt.Errorf("-chain: %v", err)
	}
	dev, pipe, err := openReadProbe()
	if err != nil {
		return err
	}
	defer dev.Release()
	defer pipe.Release()
	const bytes = 1 << 20
	src, err := dev.NewBuffer(bytes, vk.DeviceLocal)
	if err != nil {
		return err
	}
	defer src.Release()
	dst, err := dev.NewBuffer(uint64(groups)*256*4, vk.DeviceLocal)
	if err != nil {
		return err
	}
	defer dst.Release()
	bind, err := pipe.Bind(src.All(), dst.All())
	if err != nil {
		return err
	}
	defer bind.Release()
	cmd, err := dev.NewCommands()
	if err != nil {
		return err
	}
	defer cmd.Release()
	var results []chainResult
	var rows [][]string
	for _, barrier := range []string{"full", "compute"} {
		for _, k := range ks {
			times, err := chainTimes(dev, cmd, pipe, bind, []uint32{bytes / 16}, k, groups, barrier == "full", 5, reps)
			if err != nil {
				return err
			}
			r := chainResult{Dispatches: k, Groups: groups, Barrier: barrier, MedianUs: float64(times[len(times)/2].Nanoseconds()) / 1e3}
			r.PerStageUs = r.MedianUs / float64(k)
			results = append(results, r)
			rows = append(rows, []string{barrier, fmt.Sprint(k), fmt.Sprint(groups), fmt.Sprintf("%.2f", r.MedianUs), fmt.Sprintf("%.2f", r.PerStageUs)})
		}
	}
	table(os.Stdout, []string{"barrier", "dispatches", "groups", "median µs", "µs each"}, rows)
	if jsonPath != "" {
		return writeJSON(jsonPath, "probe", dev.Info(), results)
	}
	return nil
}

// openReadProbe opens the device the environment picks and builds the
// read-bandwidth kernel on it (readProbe).
func openReadProbe() (*vk.Device, *vk.Pipeline, error) {
	dev, err := openDevice()
	if err != nil {
		return nil, nil, err
	}
	pipe, err := readProbe(dev)
	if err != nil {
		dev.Release()
		return nil, nil, err
	}
	return dev, pipe, nil
}

// readProbe builds the read-bandwidth kernel on dev, on workgroups of 256.
func readProbe(dev *vk.Device) (*vk.Pipeline, error) {
	code, err := shaders.SPIRV("read_probe")
	if err != nil {
		return nil, err
	}
	return dev.NewPipeline(vk.Kernel{Name: "read_probe", SPIRV: code, Bindings: 2, PushWords: 1, Specialization: []uint32{256}})
}

// chainTimes records, in one submission of cmd, warmup+reps chains of k
// dispatches of pipe over bind (push, groups workgroups), each after a
// barrier (one that also orders transfers where full, else compute only),
// a timestamp after each chain, and returns the timed chains' GPU times,
// sorted.
func chainTimes(dev *vk.Device, cmd *vk.Commands, pipe *vk.Pipeline, bind *vk.Binding, push []uint32, k, groups int, full bool, warmup, reps int) ([]time.Duration, error) {
	stamps, err := dev.NewTimestamps(warmup + reps + 1)
	if err != nil {
		return nil, err
	}
	defer stamps.Release()
	if err := cmd.Begin(); err != nil {
		return nil, err
	}
	cmd.Reset(stamps)
	cmd.Timestamp(stamps, 0)
	for r := 0; r < warmup+reps; r++ {
		for i := 0; i < k; i++ {
			if full {
				cmd.Barrier()
			} else {
				cmd.ComputeBarrier()
			}
			cmd.Dispatch(pipe, bind, push, uint32(groups), 1, 1)
		}
		cmd.Timestamp(stamps, r+1)
	}
	if err := cmd.End(); err != nil {
		return nil, err
	}
	if err := cmd.Submit(); err != nil {
		return nil, err
	}
	d, err := stamps.Durations(warmup + reps + 1)
	if err != nil {
		return nil, err
	}
	times := d[1+warmup:]
	sort.Slice(times, func(i, j int) bool { return times[i] < times[j] })
	return times, nil
}
