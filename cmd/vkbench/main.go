// Command vkbench measures vksparse's kernels on a Vulkan device.
//
//	vkbench devices                 list every Vulkan device and its facts
//	vkbench attn [flags]            time dense decode attention
//	vkbench probe [flags]           measure read bandwidth
//	vkbench cluster [flags]         time K-means clustering of a layer
//	vkbench tactic [flags]          Tactic decode steps on the GPU: times and fidelity
//	vkbench fidelity [flags]        Tactic's selection by the float64 reference (CPU)
//	vkbench compare [flags]         every policy: GPU step times, then fidelity at matched budgets
//	vkbench kernels [flags]         the compiler's statistics of every step kernel (registers, memory)
//	vkbench generate [flags]        the project's model decoding through the library: what each policy layout costs its output
//	vkbench stack [flags]           attention per decoded token across a whole model: dense against DELTA's layout
//	vkbench soak [flags]            a long random run of decode models checked against a float64 model
//	vkbench crossover [flags]       per policy, the length from which its step costs less than dense attention
//
// The global flag -progress=auto|always|never (before the command) says
// whether to draw progress lines on stderr; auto, the default, draws them
// only when stderr is a terminal, so logs and pipes stay clean.
//
// VKSPARSE_DEVICE picks the device (index or name substring) and
// VKSPARSE_VALIDATE=1 turns on the validation layer.
package main

import (
	"flag"
	"fmt"
	"os"
)

const usage = `usage: vkbench [-progress=auto|always|never] <command> [flags]

commands:
  devices   list every Vulkan device with the facts kernels need
  attn      time dense decode attention (run "vkbench attn -h" for flags)
  probe     measure the device's read bandwidth, the ceiling for attention
  cluster   time K-means clustering of a layer's keys (Tactic's prefill)
  tactic    run Tactic decode steps on the GPU beside dense attention:
            stage times, speed-up, fidelity ("vkbench tactic -h" for flags)
  fidelity  how well Tactic's selection reaches the target mass, by the
            float64 reference on the CPU ("vkbench fidelity -h" for flags)
  compare   every policy on the same layer: step times beside dense
            attention on the GPU, then fidelity at matched budgets by the
            float64 reference on the CPU: tokens, mass, success, error
            ("vkbench compare -h" for flags)
  kernels   the driver's compiler statistics of every decode-step kernel
            (registers, shared and local memory), where the driver
            reports them ("vkbench kernels -h" for flags)
  generate  the project's byte-level model decoding a document through the
            library: per policy layout, bits per byte, KL against dense,
            top-1 agreement, speculative acceptance, tokens attended and
            attention time; -whole prefills the whole document, -prompt
            generates text greedily ("vkbench generate -h" for flags)
  stack     attention per decoded token across a whole model (32 layers of
            131 072 tokens by default), layer by layer and in one pass,
            dense against DELTA's layout, and which part bounds DELTA
            ("vkbench stack -h" for flags)
  soak      a long random run of decode models (prefills, appends, attends,
            frees) checked against a float64 model: caches, outputs,
            validation errors, device memory ("vkbench soak -h" for flags)
  crossover per policy and layer shape, the shortest length at which the
            policy's step costs less than dense attention by the device's
            cost model, where decode's dense fallback hands the layer to
            the policy ("vkbench crossover -h" for flags)

global flags:
  -progress auto|always|never
            draw progress lines on stderr: auto (default) only when stderr
            is a terminal
`

func main() {
	flag.Usage = func() { fmt.Fprint(os.Stderr, usage) }
	mode := flag.String("progress", "auto", "draw progress lines: auto (when stderr is a terminal), always or never")
	flag.Parse()
	var err error
	if showProgress, err = progressMode(*mode, isTerminal(os.Stderr)); err != nil {
		fmt.Fprintf(os.Stderr, "vkbench: %v\n", err)
		os.Exit(2)
	}
	args := flag.Args()
	if len(args) < 1 {
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	switch args[0] {
	case "devices":
		err = devices(args[1:])
	case "attn":
		err = attn(args[1:])
	case "probe":
		err = probe(args[1:])
	case "cluster":
		err = cluster(args[1:])
	case "tactic":
		err = tactic(args[1:])
	case "fidelity":
		err = fidelity(args[1:])
	case "compare":
		err = compare(args[1:])
	case "kernels":
		err = kernels(args[1:])
	case "generate":
		err = generate(args[1:])
	case "stack":
		err = stack(args[1:])
	case "soak":
		err = soakCmd(args[1:])
	case "crossover":
		err = crossover(args[1:])
	case "help":
		fmt.Print(usage)
		return
	default:
		fmt.Fprintf(os.Stderr, "vkbench: unknown command %q\n%s", args[0], usage)
		os.Exit(2)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "vkbench: %v\n", err)
		os.Exit(1)
	}
}
