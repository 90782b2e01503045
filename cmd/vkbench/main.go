// Command vkbench measures vksparse's kernels on a Vulkan device.
//
//	vkbench devices                 list every Vulkan device and its facts
//	vkbench attn [flags]            time dense decode attention
//	vkbench probe [flags]           measure read bandwidth
//	vkbench tactic [flags]          measure Tactic's selection fidelity (CPU)
//
// VKSPARSE_DEVICE picks the device (index or name substring) and
// VKSPARSE_VALIDATE=1 turns on the validation layer.
package main

import (
	"fmt"
	"os"
)

const usage = `usage: vkbench <command> [flags]

commands:
  devices   list every Vulkan device with the facts kernels need
  attn      time dense decode attention (run "vkbench attn -h" for flags)
  probe     measure the device's read bandwidth, the ceiling for attention
  tactic    measure how well Tactic's selection reaches the target mass
            (float64 reference on the CPU; "vkbench tactic -h" for flags)
`

func main() {
	if len(os.Args) < 2 {
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "devices":
		err = devices(os.Args[2:])
	case "attn":
		err = attn(os.Args[2:])
	case "probe":
		err = probe(os.Args[2:])
	case "tactic":
		err = tactic(os.Args[2:])
	case "-h", "--help", "help":
		fmt.Print(usage)
		return
	default:
		fmt.Fprintf(os.Stderr, "vkbench: unknown command %q\n%s", os.Args[1], usage)
		os.Exit(2)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "vkbench: %v\n", err)
		os.Exit(1)
	}
}
