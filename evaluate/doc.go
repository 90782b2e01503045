// Package evaluate measures sparse-attention policies on traces and
// generated workloads: selection fidelity against the exact oracles and
// step time on the GPU.
//
// Tactic measures Tactic's selection with the float64 references of
// package sparse (sparse.TacticDecodeRef, sparse.FidelityOracle) over a
// trace's decode queries; TacticTrace runs the GPU step
// (sparse.TacticStep, sparse.TacticBatch) over a trace's decode tail,
// measuring its fidelity and timing it against dense attention.
// StepTraffic counts what a Tactic step must read, from the float64
// selection, and the bound that sets on its speed-up over dense attention.
// The metrics themselves (sparse.Fidelity, sparse.TopPCount,
// sparse.ClusterTopPCount, sparse.RelativeError) are defined in package
// sparse; an application links sparse alone.
//
// The tests here read the real traces from testdata/traces at the
// repository root, or from the folder $VKSPARSE_TRACES names.
package evaluate
