package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/vksparse/vksparse/vk"
)

func devices(args []string) error {
	fs := flag.NewFlagSet("devices", flag.ExitOnError)
	jsonPath := fs.String("json", "", "also write the list as JSON to this file")
	fs.Parse(args)
	if err := checkOutputs(output{"json", *jsonPath}); err != nil {
		return err
	}
	infos, err := vk.Devices()
	if err != nil {
		return err
	}
	if len(infos) == 0 {
		return vk.ErrNoDevice
	}
	yes := map[bool]string{true: "yes", false: "no"}
	dot := map[[2]bool]string{{true, true}: "fast", {true, false}: "yes", {false, false}: "no"}
	var rows [][]string
	for _, i := range infos {
		rows = append(rows, []string{
			fmt.Sprint(i.Index), i.Name, i.Type, i.Vendor, i.Driver, i.APIVersion,
			fmt.Sprint(i.SubgroupSize), fmt.Sprint(i.MaxWorkgroupInvocations), fmt.Sprintf("%d KiB", i.SharedMemoryBytes>>10),
			mib(i.MaxStorageBufferRange), mib(i.MaxAllocation), yes[i.Storage16Bit] + "/" + yes[i.Float16],
			yes[i.CooperativeMatrixNV], dot[[2]bool{i.IntegerDot, i.IntegerDotFast}], fmt.Sprintf("%.3g", i.TimestampPeriodNs),
		})
	}
	table(os.Stdout, []string{"#", "name", "type", "vendor", "driver", "vulkan", "subgroup", "max wg", "shared", "max range", "max alloc", "16-bit storage/fp16", "coopmat NV", "int8 dot", "ns/tick"}, rows)
	if *jsonPath != "" {
		return writeJSON(*jsonPath, "devices", vk.Info{}, infos)
	}
	return nil
}
