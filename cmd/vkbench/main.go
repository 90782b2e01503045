// Command vkbench measures vksparse's kernels on a Vulkan device.
//
//	vkbench devices                 list every Vulkan device and its facts
//	vkbench attn [flags]            time dense decode attention
//	vkbench probe [flags]           measure read bandwidth
//	vkbench cluster [flags]         time K-means clustering of a layer
//	vkbench tactic [flags]          Tactic decode steps on the GPU: times and fidelity
//	vkbench fidelity [flags]        Tactic's selection by the float64 reference (CPU)
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
  cluster   time K-means clustering of a layer's keys (Tactic's prefill)
  tactic    run Tactic decode steps on the GPU beside dense attention:
            stage times, speed-up, fidelity ("vkbench tactic -h" for flags)
  fidelity  how well Tactic's selection reaches the target mass, by the
            float64 reference on the CPU ("vkbench fidelity -h" for flags)
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
	case "cluster":
		err = cluster(os.Args[2:])
	case "tactic":
		err = tactic(os.Args[2:])
	case "fidelity":
		err = fidelity(os.Args[2:])
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
