package main

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"runtime/pprof"
	"sort"
	"time"

	"github.com/vksparse/vksparse/soak"
	"github.com/vksparse/vksparse/sparse"
)

// soakCmd runs `vkbench soak`: a long random run of decode.Models checked
// against a float64 model (package soak).
func soakCmd(args []string) error {
	fs := flag.NewFlagSet("soak", flag.ExitOnError)
	def := soak.DefaultConfig(3000, 1)
	steps := fs.Int("steps", def.Steps, "random operations to run")
	seed := fs.Int64("seed", def.Seed, "seed of the operations, keys, values and queries")
	every := fs.Int("check-every", 100, "a full check (caches read back, every layer attended and compared) every this many steps")
	slots := fs.Int("slots", def.Slots, "sequence slots of each model")
	layers := fs.Int("layers", def.Layers, "layers of each model (the policies fill them, one model per that many)")
	qHeads := fs.Int("heads", def.Heads.Query, "query heads")
	kvHeads := fs.Int("kv-heads", def.Heads.KV, "KV heads")
	dim := fs.Int("dim", def.Heads.Dim, "head dimension")
	capacity := fs.Int("capacity", def.Capacity, "tokens per sequence")
	maxPrefill := fs.Int("max-prefill", 0, "longest prefill drawn (0: half the capacity)")
	duration := fs.Duration("duration", 0, "end the soak at the first step past this wall time (0: run every step)")
	jsonPath := fs.String("json", "", "write the report as JSON to this file")
	profile := fs.String("cpuprofile", "", "write a CPU profile of the soak (go tool pprof) to this file")
	fs.Parse(args)
	if err := checkOutputs(output{"json", *jsonPath}, output{"cpuprofile", *profile}); err != nil {
		return err
	}
	cfg := soak.Config{
		Heads: sparse.Heads{Query: *qHeads, KV: *kvHeads, Dim: *dim}, Layers: *layers, Slots: *slots,
		Capacity: *capacity, MaxPrefill: *maxPrefill, Policies: soak.DefaultPolicies(*capacity),
		Steps: *steps, Seed: *seed, CheckEvery: *every, Duration: *duration,
	}
	if *steps < 1 {
		return fmt.Errorf("-steps %d: want at least 1", *steps)
	}
	if err := cfg.Validate(); err != nil {
		return err
	}
	dev, err := openDevice()
	if err != nil {
		return err
	}
	defer dev.Release()
	if *profile != "" {
		f, err := os.Create(*profile)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	prog := &progress{total: *steps}
	start := time.Now()
	draw := max(1, *steps/1000)
	rep, err := soak.Run(dev, cfg, func(done, total int) {
		if done%draw == 0 || done == total {
			prog.done = done - 1
			prog.step(fmt.Sprintf("%.0f steps/s", float64(done)/time.Since(start).Seconds()))
		}
	})
	prog.finish()
	printSoak(rep)
	if *jsonPath != "" { // what ran, also when a check failed
		err = errors.Join(err, writeJSON(*jsonPath, "soak "+fmt.Sprint(args), dev.Info(), rep))
	}
	return err
}

// printSoak prints a soak's report: the run, the operations, the device
// memory and each policy's worst error.
func printSoak(rep soak.Report) {
	fmt.Printf("%d steps (seed %d) over %d models in %.1f s: %.0f steps/s; %d checks, %d tokens appended, %d reclustering boundaries crossed\n",
		rep.Steps, rep.Seed, rep.Models, rep.WallSeconds, rep.StepsPerSec, rep.Checks, rep.Appended, rep.Reclusters)
	if rep.Validating {
		fmt.Printf("validation errors: %d\n", rep.ValidationErrors)
	} else {
		fmt.Println("validation layer off (VKSPARSE_VALIDATE=1 turns it on)")
	}
	var kinds []string
	for k := range rep.Operations {
		kinds = append(kinds, k)
	}
	sort.Strings(kinds)
	var ops [][]string
	for _, k := range kinds {
		ops = append(ops, []string{k, fmt.Sprint(rep.Operations[k])})
	}
	fmt.Println()
	table(os.Stdout, []string{"operation", "steps"}, ops)
	fmt.Println()
	table(os.Stdout, []string{"device memory", "bytes"}, [][]string{
		{"constructed", fmt.Sprint(rep.ConstructedBytes)},
		{"idle after warm-up", fmt.Sprint(rep.WarmBytes)},
		{"peak", fmt.Sprint(rep.PeakBytes)},
		{"idle at the end", fmt.Sprint(rep.FinalBytes)},
		{"after release", fmt.Sprint(rep.ReleasedBytes)},
	})
	fmt.Println()
	var rows [][]string
	for _, p := range rep.Policies {
		rows = append(rows, []string{p.Name, fmt.Sprint(p.Mass), fmt.Sprint(p.Heads), fmt.Sprintf("%.3g", p.WorstRelative), fmt.Sprintf("%.3g", p.WorstShare)})
	}
	table(os.Stdout, []string{"policy", "mass", "heads checked", "worst rel. error vs dense", "worst share of tolerance"}, rows)
}
