// Package sparse computes decode attention on the GPU: dense attention and
// the sparse selection policies, over KV caches from package kvcache. Every
// kernel has a float64 reference here that states its exact computation.
//
// The references (functions ending in Ref) define exactly what a policy
// computes, including tie-breaking and rounding choices, so that a GPU
// implementation can be written against them and compared with them. They
// favour clarity over speed, but every step is expressible as parallel work
// (per token, per cluster, or a prefix scan followed by a bisection).
// Fidelity, FidelityRef and FidelityOracle measure a selection against the
// exact softmax and dense attention; package evaluate runs them, and the
// GPU steps, over traces and generated workloads.
//
// Package sparsetest is the conformance suite every step passes (output
// written and matching its reference, counters at rest, determinism,
// refused input, batches, release): a new policy gets its GPU tests by
// describing its constructor and its reference in a sparsetest.Policy.
//
// Matrices are row-major []float64; a key or value matrix of n tokens and
// head dimension d has n*d elements and token t is row t. Token ids are
// int32 row indices into such a matrix.
//
// # Concurrency
//
// The references and the fidelity functions are pure and safe for
// concurrent use. A Dense holds compiled kernels only: once built (and its
// ChunkTokens set), several goroutines may make plans from it at once. A
// plan (DensePlan), a TacticStep, a TacticDecoder and a KMeans hold their
// own buffers and scratch between calls and belong to one goroutine at a
// time; different ones, even over one vk.Device, may run in different
// goroutines at once (the device locks its queue). A kvcache.Layer locks
// its own calls, but a plan reads the layer on the GPU without that lock:
// do not refill or truncate a layer while another goroutine attends over
// it. Give each goroutine its own objects, or serialize the calls.
//
// # Limits
//
// Queries (length, NaN, Inf), the target mass P, TacticFit and
// TacticDecoderOptions are checked before anything is written or
// dispatched, and so are the device's limits when plans and clusterings
// bind their buffers: a buffer beyond maxStorageBufferRange or the
// largest allocation is vk.ErrUnsupported, memory running out
// vk.ErrOutOfMemory (test with errors.Is).
package sparse
