// Package decode holds a whole model's decode state on the GPU: the KV
// caches of L layers for B sequence slots, and the attention of a layer's
// queries for every active sequence at once, dense or with Tactic.
//
// A Model is built for a geometry (sparse.Heads), a number of layers,
// slots and tokens per sequence, and a Policy: Dense, or Tactic at a
// target mass P with its options (sparse.TacticDecoderOptions: sinks,
// recluster interval, K-means options, fit). A slot is idle until each of
// its layers is prefilled (Prefill; with Tactic each layer is then
// clustered past its sinks and stored in cluster order, as
// sparse.NewTacticDecoder does); it is then active: Append or AppendAll
// add a token's keys and values (with Tactic, every Recluster appended
// tokens are clustered and join the layer's index), and Attend, or
// SetQuery and Record into the caller's command buffer, attend a layer's
// queries for all active slots, in ascending slot order (Active). Free
// makes the slot idle again, ready for another sequence's prefill.
//
// # Batches
//
// A layer's attention is one batch over the active slots: Tactic runs one
// sparse.TacticBatch per layer (each stage dispatched for every sequence,
// then one barrier for the whole batch), dense attention one
// sparse.DensePlan per layer. The batches are built at a layer's first
// SetQuery (or Attend) and rebuilt after the set of active slots changes
// (a slot becomes active or is freed); between such changes appends only
// move a Tactic step onto its layer's new index when a tail joins it.
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
