// Package sparse computes decode attention on the GPU: dense attention and
// the sparse selection policies, over KV caches from package kvcache. Every
// kernel has a float64 reference here that states its exact computation.
//
// The references (functions ending in Ref) define exactly what a policy
// computes, including tie-breaking and rounding choices, so that a GPU
// implementation can be written against them and compared with them. They
// favour clarity over speed, but every step is expressible as parallel work
// (per token, per cluster, or a prefix scan followed by a bisection).
//
// Matrices are row-major []float64; a key or value matrix of n tokens and
// head dimension d has n*d elements and token t is row t. Token ids are
// int32 row indices into such a matrix.
package sparse
