// Package decode holds a whole model's decode state on the GPU: the KV
// caches of L layers for B sequence slots, and the attention of a layer's
// queries for every active sequence at once, each layer under its own
// policy.
//
// A Model is built for a geometry (sparse.Heads), a number of layers,
// slots and tokens per sequence, and a policy per layer (Config.Policy
// for every layer, or Config.Layout, one per layer): Dense, Tactic,
// DoubleP, Quest, StreamingLLM, H2O, or the oracles for measurement, each
// with its options; a mixed layout (dense layers 0–1, Double-P after, say)
// is one Config. DeltaLayout gives DELTA's layout: dense warm-up layers,
// Δ-layers that attend densely and pick pages, and layers that attend the
// pick of the Δ-layer before them in the same step (attend the layers in
// order). LuKA's layers (LuKA, or LuKALayout's modes with H2O as the lined
// layers) keep summaries of each slot's older tokens, made at the prefill
// and every Every appended tokens, and attend them with the raw tokens,
// refining some into their tokens. A slot is idle until each of its layers is prefilled
// (Prefill; under a clustered policy each layer is then clustered past its
// sinks and stored in cluster order, as sparse.NewTacticDecoder does); it
// is then active: Append or AppendAll add a token's keys and values (under
// a clustered policy every Recluster appended tokens are clustered and
// join the layer's index), and Attend, or SetQuery and Record into the
// caller's command buffer, attend a layer's queries for all active slots,
// in ascending slot order (Active). Free makes the slot idle again, ready
// for another sequence's prefill; Slot tells what a slot holds, partly
// prefilled ones included.
//
// # Batches
//
// A layer's attention is one batch over the active slots: Tactic runs one
// sparse.TacticBatch per layer, every other sparse policy one sparse.Batch
// of its steps (LuKA its slots' sparse.LuKAStep), and dense attention one
// sparse.DensePlan; each stage is dispatched for every sequence, then one
// barrier for the whole batch. Every sequence's step writes its output
// into its place in the layer's output buffer (Output).
// Every layer's kernels are compiled once for the model (its sparse.Dense
// holds them), and the partial results of every layer's attention share
// one workspace, a region per slot (sparse.Workspace). The batches are built at a layer's first
// SetQuery (or Attend) and rebuilt after the set of active slots changes
// (a slot becomes active or is freed), after a clustered layer's index
// grows under a policy other than Tactic (whose steps move onto the new
// index), and after a positional policy's sequence gathers Recluster
// tokens past the index its batch built. Attended reports the rows each
// sequence's last step read.
//
// # Dense fallback
//
// A layer under Tactic, Double-P, Quest, StreamingLLM or H2O attends a
// sequence densely whenever the policy's step over it would cost more than
// dense attention (Config.Fallback, or a policy's WithFallback:
// FallbackAuto, the default; FallbackNever runs the policy always,
// FallbackAlways attends densely always). Each of the two is priced by
// a cost model: its dependent dispatches times a floor per dispatch plus
// the bytes it reads over a bandwidth (Policy.Cost; dense attention is
// one dispatch reading every key and value). On a GPU the layer's models
// are measured on the policy's own kernels and on dense attention's, at
// the model's geometry (MeasureSteps: each timed over random keys at two
// lengths, and fitted; once per device, policy and process), since a
// stage's kernels run far from the device's bandwidth where its work is
// small or latency-bound. Elsewhere (a software renderer, Config.Costs
// given, Config.Measure MeasureNever, or a capacity below
// MinMeasureTokens) both are priced by one model of the device
// (Config.Costs, else sparse.Calibrate's). A clustered policy's cost
// counts the share of its index its last step took (0 before its first
// step, so it runs once and is then weighed by what it read). Both are
// priced for one sequence alone, or with Config.PriceBatch for its part
// of a batch of that many, whose sequences share each dispatch (measured
// in such a batch, or the device's floor divided among them). The choice
// is made per sequence, from that sequence's own tokens, index and last
// step, when the layer's batch is built and again at every SetQuery; a
// change of any sequence's choice builds the layer's batch again, as a
// change of the active slots does. The policy's batch attends the
// sequences that keep it, and a dense plan each the others, all writing
// into the layer's output. Choices reports each slot's choice and costs.
// A sequence attended densely gets dense attention's output, bit for bit.
// Since a sequence's choice depends on nothing else in the batch, batch
// invariance holds under FallbackNever and FallbackAlways, and under
// FallbackAuto for sequences attended densely and for the clustered
// policies, whose steps attend the same whenever their batch is built;
// a positional policy's batch built again at a batch-mate's change of
// choice indexes its sequences anew (H2O restarts its accumulation).
// Costs are measured anew in each process: give Config.Costs (and
// MeasureNever) where choices near a crossover must repeat across runs.
// The oracles, DELTA and LuKA never fall back.
//
// # Concurrency
//
// A Model's methods are safe for concurrent use: a mutex serializes them,
// so that a call sees the model as the previous call left it. Commands
// that Record puts in the caller's command buffer run later, when the
// caller submits them, and use the layer's batch as it was recorded:
// until that submission has completed, change nothing in the model
// (Prefill, Append, AppendAll, Free, Release) and do not call SetQuery,
// Attend or Record for that layer.
//
// # Errors
//
// Every argument (slots and layers in range, shapes, NaN or Inf in keys,
// values or queries, a slot not prefilled or freed, a sequence beyond the
// capacity) is checked before anything is written or dispatched; a
// refused call leaves the model as it was. When the device fails part way
// (running out of memory, say) the call says what it left: a prefill is
// undone; a token whose tail clustering fails stays stored, its tail
// attended in full until the clustering succeeds at a later append.
package decode
