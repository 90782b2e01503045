package main

import (
	"flag"
	"fmt"
	"os"
	"slices"

	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/vk"
)

// kernels prints the compiler statistics of every decode-step kernel, one
// row per kernel and one column per statistic the driver names.
func kernels(args []string) error {
	fs := flag.NewFlagSet("kernels", flag.ExitOnError)
	qHeads := fs.Int("heads", 32, "query heads")
	kvHeads := fs.Int("kv-heads", 8, "KV heads")
	dim := fs.Int("dim", 128, "head dimension")
	jsonPath := fs.String("json", "", "also write the statistics as JSON to this file")
	fs.Parse(args)
	if err := checkOutputs(output{"json", *jsonPath}); err != nil {
		return err
	}
	opts := vk.OptionsFromEnv()
	opts.Statistics = true
	dev, err := vk.Open(opts)
	if err != nil {
		return err
	}
	defer dev.Release()
	info := dev.Info()
	if !info.ExecutableStatistics {
		return fmt.Errorf("%w: %s (%s) does not report its compiler's statistics (VK_KHR_pipeline_executable_properties)", vk.ErrUnsupported, info.Name, info.Driver)
	}
	dense, err := sparse.NewDense(dev, sparse.Heads{Query: *qHeads, KV: *kvHeads, Dim: *dim})
	if err != nil {
		return err
	}
	defer dense.Release()
	stats, err := sparse.StepKernelStatistics(dense)
	if err != nil {
		return err
	}
	// Columns: the statistics' names in the order the driver first gives them.
	var names []string
	for _, k := range stats {
		for _, s := range k.Statistics {
			if !slices.Contains(names, s.Name) {
				names = append(names, s.Name)
			}
		}
	}
	var rows [][]string
	for _, k := range stats {
		row := []string{k.Kernel}
		for _, n := range names {
			v := "-"
			for _, s := range k.Statistics {
				if s.Name == n {
					v = s.Value
				}
			}
			row = append(row, v)
		}
		rows = append(rows, row)
	}
	fmt.Printf("%s, %s: Hq %d, Hkv %d, D %d\n", info.Name, info.Driver, *qHeads, *kvHeads, *dim)
	table(os.Stdout, append([]string{"kernel"}, names...), rows)
	if *jsonPath != "" {
		return writeJSON(*jsonPath, "kernels "+fmt.Sprint(args), info, stats)
	}
	return nil
}
