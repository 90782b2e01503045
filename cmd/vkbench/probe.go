package main

import (
	"flag"
	"fmt"
	"os"
	"sort"

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
	fs.Parse(args)
	mibs, err := ints(*sizes)
	if err != nil {
		return fmt.Errorf("-mib: %v", err)
	}
	dev, err := openDevice()
	if err != nil {
		return err
	}
	defer dev.Release()
	code, err := shaders.SPIRV("read_probe")
	if err != nil {
		return err
	}
	pipe, err := dev.NewPipeline(vk.Kernel{Name: "read_probe", SPIRV: code, Bindings: 2, PushWords: 1, Specialization: []uint32{256}})
	if err != nil {
		return err
	}
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
