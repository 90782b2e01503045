package lm

import (
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/vk"
)

// blockAttention is a prefill's attention, a chunk of chunkRows positions
// at a time: the GPU attends every query of the chunk over the positions
// before the chunk (one dense plan per layer over that layer's scratch
// cache, repeated once per row of the chunk), the CPU attends the causal
// block within the chunk, and the two merge exactly through the GPU's
// log-sum-exp (sparse.DensePlan.LogSumExp):
//
//	a = (e^(L−M)·a_past + e^(m−M)·o_block) / (e^(L−M) + e^(m−M)·l_block)
//
// with L the log-sum-exp of the scores before the chunk, m, l and o_block
// the block's maximum score, Σ e^(s−m) and Σ e^(s−m)·v, M = max(L, m).
// The chunk's keys and values then extend each layer's scratch cache.
type blockAttention struct {
	dense  *sparse.Dense
	caches []*kvcache.Layer    // per layer: the prompt's keys and values so far
	plans  []*sparse.DensePlan // per layer: caches[l] chunkRows times
	ws     *sparse.Workspace   // the plans' partials, shared
	times  PrefillTimes        // of the prompt since the last reset
}

// PrefillTimes is where a prefill's wall time went.
type PrefillTimes struct {
	Total time.Duration `json:"total"`
	// GPU is the attention over the positions before each chunk: queries
	// up, the plans run, outputs and log-sum-exps back.
	GPU time.Duration `json:"gpu"`
	// Block is the causal blocks on the CPU, Store the chunks' keys and
	// values written to the scratch caches.
	Block time.Duration `json:"block"`
	Store time.Duration `json:"store"`
}

// newBlockAttention allocates scratch caches of capacity tokens for every
// layer of c, and their plans.
func newBlockAttention(dev *vk.Device, c Config, capacity int) (*blockAttention, error) {
	b := &blockAttention{ws: sparse.NewWorkspace(dev)}
	var err error
	b.dense, err = sparse.NewDense(dev, sparse.Heads{Query: c.Heads, KV: c.KVHeads, Dim: c.HeadDim})
	for l := 0; l < c.Layers && err == nil; l++ {
		var cache *kvcache.Layer
		if cache, err = kvcache.NewLayer(dev, c.KVHeads, c.HeadDim, capacity); err != nil {
			break
		}
		b.caches = append(b.caches, cache)
		seqs := make([]*kvcache.Layer, blockRows)
		for i := range seqs {
			seqs[i] = cache
		}
		var plan *sparse.DensePlan
		if plan, err = b.dense.PlanChunks(seqs, blockChunks); err == nil {
			b.plans = append(b.plans, plan)
			err = plan.Share(b.ws, 0)
		}
	}
	if err != nil {
		return nil, errors.Join(err, b.release())
	}
	return b, nil
}

// release frees the plans, the workspace, the caches and the kernels.
func (b *blockAttention) release() error {
	var errs []error
	for _, p := range b.plans {
		errs = append(errs, p.Release())
	}
	if b.ws != nil {
		errs = append(errs, b.ws.Release())
	}
	for _, c := range b.caches {
		errs = append(errs, c.Release())
	}
	if b.dense != nil {
		errs = append(errs, b.dense.Release())
	}
	b.plans, b.ws, b.caches, b.dense = nil, nil, nil, nil
	return errors.Join(errs...)
}

// reset empties every layer's scratch cache for a new prompt.
func (b *blockAttention) reset() error {
	b.times = PrefillTimes{}
	var errs []error
	for _, c := range b.caches {
		errs = append(errs, c.Truncate(0))
	}
	return errors.Join(errs...)
}

// blockRows is the positions one GPU attention of a prefill takes at once
// (its plans repeat a layer's cache that many times), and blockChunks the
// chunks each of them is split into at most.
const (
	blockRows   = 128
	blockChunks = 16
)

// attend is an attendFunc: it sets s.a for the rows of s at positions t0,
// t0+1, … of layer l (keys and values are [KVHeads][n][HeadDim], filled up
// to the last row's position), blockRows rows at a time, and extends the
// layer's scratch cache by each block's keys and values.
func (b *blockAttention) attend(c Config, n int) attendFunc {
	hd, qh := c.HeadDim, c.Heads*c.HeadDim
	scale := 1 / math.Sqrt(float64(hd))
	padded := make([]float32, blockRows*qh)
	return func(l int, s *work, t0 int, keys, values []float32) error {
		for b0 := 0; b0 < s.rows; b0 += blockRows {
			if err := b.block(c, l, s, t0, b0, min(s.rows, b0+blockRows), n, keys, values, padded, scale); err != nil {
				return err
			}
		}
		return nil
	}
}

// block attends rows [b0, b1) of s (positions t0+b0, …) of layer l: the
// GPU over the positions before t0+b0, the CPU the causal block, merged;
// then it extends the layer's scratch cache by the block's keys and values.
func (b *blockAttention) block(c Config, l int, s *work, t0, b0, b1, n int, keys, values, padded []float32, scale float64) error {
	hd, qh := c.HeadDim, c.Heads*c.HeadDim
	cache, start, rows := b.caches[l], t0+b0, b1-b0
	if cache.Len() != start {
		return fmt.Errorf("lm: prefill layer %d holds %d tokens before the block at %d", l, cache.Len(), start)
	}
	// The GPU attends the block's queries over the positions before it
	// while the CPU attends the causal block; they merge row by row.
	var past, lse []float32
	var gpuErr error
	gpuDone := make(chan struct{})
	go func() {
		defer close(gpuDone)
		if start == 0 {
			return
		}
		clock := time.Now()
		copy(padded, s.q[b0*qh:b1*qh])
		clear(padded[rows*qh:])
		if past, gpuErr = b.plans[l].Attend(padded); gpuErr == nil {
			lse, gpuErr = b.plans[l].LogSumExp()
		}
		b.times.GPU += time.Since(clock)
	}()
	clock := time.Now()
	// The causal block, rows spread over the cores: its maximum, sum and
	// unnormalised output per row and head.
	parts := make([]blockPart, rows*c.Heads)
	forRows(rows, func(r int) {
		blockRow(c, s, b0+r, r, start, n, keys, values, scale, parts[r*c.Heads:(r+1)*c.Heads])
	})
	b.times.Block += time.Since(clock)
	<-gpuDone
	if gpuErr != nil {
		return fmt.Errorf("lm: prefill attention of layer %d at %d: %w", l, start, gpuErr)
	}
	clock = time.Now()
	for r := 0; r < rows; r++ {
		for h := 0; h < c.Heads; h++ {
			p := &parts[r*c.Heads+h]
			out := s.a[(b0+r)*qh+h*hd : (b0+r)*qh+(h+1)*hd]
			if past == nil {
				for i := range out {
					out[i] = float32(p.o[i] / p.l)
				}
				continue
			}
			L := float64(lse[r*c.Heads+h])
			M := math.Max(L, p.m)
			wp, wb := math.Exp(L-M), math.Exp(p.m-M)
			den := wp + wb*p.l
			for i := range out {
				out[i] = float32((wp*float64(past[r*qh+h*hd+i]) + wb*p.o[i]) / den)
			}
		}
	}
	defer func() { b.times.Store += time.Since(clock) }()
	// The block's keys and values, [KVHeads][rows][HeadDim], to the cache.
	kh := make([]uint16, c.KVHeads*rows*hd)
	vh := make([]uint16, len(kh))
	for g := 0; g < c.KVHeads; g++ {
		for r := 0; r < rows; r++ {
			from, to := ((b0+r)*c.KVHeads+g)*hd, (g*rows+r)*hd
			copy(kh[to:to+hd], s.kh[from:from+hd])
			copy(vh[to:to+hd], s.vh[from:from+hd])
		}
	}
	if err := cache.Extend(kh, vh, rows); err != nil {
		return fmt.Errorf("lm: prefill layer %d at %d: %w", l, start, err)
	}
	return nil
}

// blockPart is the causal block's attention of one row and head: its
// maximum score m, l = Σ e^(s−m) and o = Σ e^(s−m)·v.
type blockPart struct {
	m, l float64
	o    []float64
}

// blockRow computes parts[h] for every head h of row r of s, row pr of its
// block (position start+pr): attention over the causal block [start,
// start+pr].
func blockRow(c Config, s *work, r, pr, start, n int, keys, values []float32, scale float64, parts []blockPart) {
	hd, group, qh := c.HeadDim, c.Heads/c.KVHeads, c.Heads*c.HeadDim
	t0, t := start, start+pr
	score := make([]float64, pr+1)
	for h := 0; h < c.Heads; h++ {
		g := h / group
		q := s.q[r*qh+h*hd : r*qh+(h+1)*hd]
		m := math.Inf(-1)
		for j := t0; j <= t; j++ {
			k := keys[(g*n+j)*hd : (g*n+j+1)*hd]
			var d float64
			for i, x := range q {
				d += float64(x) * float64(k[i])
			}
			score[j-t0] = d * scale
			m = math.Max(m, score[j-t0])
		}
		acc := make([]float64, hd)
		sum := 0.0
		for j := t0; j <= t; j++ {
			e := math.Exp(score[j-t0] - m)
			sum += e
			for i, x := range values[(g*n+j)*hd : (g*n+j+1)*hd] {
				acc[i] += e * float64(x)
			}
		}
		parts[h] = blockPart{m: m, l: sum, o: acc}
	}
}
