package lm

import (
	"errors"
	"fmt"
	"math"
	"runtime"
	"sync"

	"github.com/x448/float16"
	"gonum.org/v1/gonum/blas"
	"gonum.org/v1/gonum/blas/blas32"

	"github.com/vksparse/vksparse/kvcache"
)

// productFunc sets y = x wᵀ (x [rows][in], w one of the model's weight
// matrices [out][in], y [rows][out]): matmulT, or on the GPU.
type productFunc func(y, x []float32, rows, in int, w []float32, out int) error

// cpuProducts is a productFunc on the CPU.
func cpuProducts(y, x []float32, rows, in int, w []float32, out int) error {
	matmulT(y, x, rows, in, w, out)
	return nil
}

// matmulT sets y = x wᵀ: x is [rows][in], w [out][in] and y [rows][out],
// all row-major float32. gonum's SGEMM splits large products among
// goroutines (one per core).
func matmulT(y, x []float32, rows, in int, w []float32, out int) {
	blas32.Gemm(blas.NoTrans, blas.Trans, 1,
		blas32.General{Rows: rows, Cols: in, Stride: in, Data: x[:rows*in]},
		blas32.General{Rows: out, Cols: in, Stride: in, Data: w[:out*in]},
		0, blas32.General{Rows: rows, Cols: out, Stride: out, Data: y[:rows*out]})
}

// forRows calls fn(r) for r in [0, n), the rows dealt out in turn to
// GOMAXPROCS goroutines (in place when there are few), so that rows whose
// cost grows with r still spread evenly.
func forRows(n int, fn func(r int)) {
	workers := min(n/8, runtime.GOMAXPROCS(0))
	if workers <= 1 {
		for r := 0; r < n; r++ {
			fn(r)
		}
		return
	}
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for r := w; r < n; r += workers {
				fn(r)
			}
		}(w)
	}
	wg.Wait()
}

// rmsnorm sets dst = x / sqrt(mean(x²) + eps) ⊙ w for one row (the mean
// accumulated in float64).
func rmsnorm(dst, x, w []float32, eps float32) {
	var ss float64
	for _, v := range x {
		ss += float64(v) * float64(v)
	}
	r := float32(1 / math.Sqrt(float64(float32(ss/float64(len(x)))+eps)))
	w = w[:len(x)]
	dst = dst[:len(x)]
	for i, v := range x {
		dst[i] = v * r * w[i]
	}
}

// ropeAngle is the angle by which RoPE rotates pair i at position pos:
// pos · θ^(−2i/dim), in float64 (Reference's).
func ropeAngle(pos, i, dim int, theta float64) float64 {
	return float64(pos) * math.Pow(theta, -float64(2*i)/float64(dim))
}

// rope rotates, in each of the heads of x ([heads][dim]), every pair
// (x[2i], x[2i+1]) by the angle pos · θ^(−2i/dim): (a cos − b sin,
// a sin + b cos). It computes in float32 as PyTorch does from a float32
// frequency table: f = 1 / θ^(2i/dim), angle = pos · f, its cosine and
// sine, and the rotation, each rounded to float32. (At position p the
// angle is off the exact one by up to p·2⁻²⁴ radians; matching PyTorch's
// rounding brings the logits of the first 2 048 bytes of the test
// document from 4e-4 to 3e-5 of PyTorch's in float32.)
func rope(x []float32, heads, dim, pos int, theta float64) {
	for i := 0; i < dim/2; i++ {
		f := 1 / float32(math.Pow(theta, float64(float32(2*i)/float32(dim))))
		s64, c64 := math.Sincos(float64(float32(pos) * f))
		s, c := float32(s64), float32(c64)
		for h := 0; h < heads; h++ {
			p := x[h*dim+2*i : h*dim+2*i+2]
			a, b := p[0], p[1]
			p[0], p[1] = a*c-b*s, a*s+b*c
		}
	}
}

// silu is x·sigmoid(x).
func silu(x float32) float32 { return float32(float64(x) / (1 + math.Exp(-float64(x)))) }

// work is the activations of a chunk of rows (tokens) in float32.
type work struct {
	rows   int
	x, h   []float32 // residual stream and its norm, [rows][Dim]
	q      []float32 // queries, RoPE applied, [rows][Heads][HeadDim]
	k, v   []float32 // [rows][KVHeads][HeadDim]
	a      []float32 // attention output, [rows][Heads][HeadDim]
	o      []float32 // [rows][Dim]
	g1, g3 []float32 // [rows][Hidden]
	kh, vh []uint16  // k and v in fp16, [rows][KVHeads][HeadDim]
	mm     productFunc
	logits []float32 // [rows][Vocab]
}

// newWork allocates activations for up to rows rows.
func newWork(c Config, rows int) *work {
	kv := c.KVHeads * c.HeadDim
	return &work{
		x: make([]float32, rows*c.Dim), h: make([]float32, rows*c.Dim),
		q: make([]float32, rows*c.Heads*c.HeadDim), a: make([]float32, rows*c.Heads*c.HeadDim),
		k: make([]float32, rows*kv), v: make([]float32, rows*kv),
		o:  make([]float32, rows*c.Dim),
		g1: make([]float32, rows*c.Hidden), g3: make([]float32, rows*c.Hidden),
		logits: make([]float32, rows*c.Vocab),
		mm:     cpuProducts,
	}
}

// embed starts rows from tokens: x[r] = Emb[tokens[r]].
func (w *Weights) embed(s *work, tokens []byte) {
	d := w.Config.Dim
	s.rows = len(tokens)
	for r, t := range tokens {
		copy(s.x[r*d:(r+1)*d], w.Emb[int(t)*d:(int(t)+1)*d])
	}
}

// qkv computes layer l's queries, keys and values of the rows at
// positions pos: h = rmsnorm(x, N1), q = h Wqᵀ, k = h Wkᵀ, v = h Wvᵀ,
// RoPE on q and k; kh and vh hold k and v rounded to fp16.
func (w *Weights) qkv(l int, s *work, pos []int) error {
	c, ly := w.Config, &w.Layers[l]
	d, kv, n := c.Dim, c.KVHeads*c.HeadDim, s.rows
	forRows(n, func(r int) { rmsnorm(s.h[r*d:(r+1)*d], s.x[r*d:(r+1)*d], ly.N1, c.Eps) })
	if err := errors.Join(
		s.mm(s.q, s.h, n, d, ly.Wq, c.Heads*c.HeadDim),
		s.mm(s.k, s.h, n, d, ly.Wk, kv),
		s.mm(s.v, s.h, n, d, ly.Wv, kv)); err != nil {
		return fmt.Errorf("lm: layer %d: %w", l, err)
	}
	forRows(n, func(r int) {
		rope(s.q[r*c.Heads*c.HeadDim:(r+1)*c.Heads*c.HeadDim], c.Heads, c.HeadDim, pos[r], c.RopeTheta)
		rope(s.k[r*kv:(r+1)*kv], c.KVHeads, c.HeadDim, pos[r], c.RopeTheta)
	})
	if cap(s.kh) < n*kv {
		s.kh, s.vh = make([]uint16, n*kv), make([]uint16, n*kv)
	}
	s.kh, s.vh = s.kh[:n*kv], s.vh[:n*kv]
	errs := make([]error, n)
	forRows(n, func(r int) {
		k, err := kvcache.ToHalves(s.k[r*kv : (r+1)*kv])
		if err != nil {
			errs[r] = fmt.Errorf("lm: layer %d keys at row %d: %w", l, r, err)
			return
		}
		v, err := kvcache.ToHalves(s.v[r*kv : (r+1)*kv])
		if err != nil {
			errs[r] = fmt.Errorf("lm: layer %d values at row %d: %w", l, r, err)
			return
		}
		copy(s.kh[r*kv:], k)
		copy(s.vh[r*kv:], v)
	})
	return errors.Join(errs...)
}

// finish completes layer l once s.a holds the attention output:
// x += a Woᵀ, then x += (silu(g W1ᵀ) ⊙ g W3ᵀ) W2ᵀ with g = rmsnorm(x, N2).
func (w *Weights) finish(l int, s *work) error {
	c, ly := w.Config, &w.Layers[l]
	d, n, hd := c.Dim, s.rows, c.Hidden
	if err := s.mm(s.o, s.a, n, c.Heads*c.HeadDim, ly.Wo, d); err != nil {
		return fmt.Errorf("lm: layer %d: %w", l, err)
	}
	forRows(n, func(r int) {
		x := s.x[r*d : (r+1)*d]
		for i, v := range s.o[r*d : (r+1)*d] {
			x[i] += v
		}
		rmsnorm(s.h[r*d:(r+1)*d], x, ly.N2, c.Eps)
	})
	if err := errors.Join(s.mm(s.g1, s.h, n, d, ly.W1, hd), s.mm(s.g3, s.h, n, d, ly.W3, hd)); err != nil {
		return fmt.Errorf("lm: layer %d: %w", l, err)
	}
	forRows(n, func(r int) {
		g3 := s.g3[r*hd : (r+1)*hd]
		for i, v := range s.g1[r*hd : (r+1)*hd] {
			g3[i] *= silu(v)
		}
	})
	if err := s.mm(s.o, s.g3[:n*hd], n, hd, ly.W2, d); err != nil {
		return fmt.Errorf("lm: layer %d: %w", l, err)
	}
	forRows(n, func(r int) {
		x := s.x[r*d : (r+1)*d]
		for i, v := range s.o[r*d : (r+1)*d] {
			x[i] += v
		}
	})
	return nil
}

// head sets s.logits = rmsnorm(x, Nf) Headᵀ for the rows.
func (w *Weights) head(s *work) error {
	c, d, n := w.Config, w.Config.Dim, s.rows
	forRows(n, func(r int) { rmsnorm(s.h[r*d:(r+1)*d], s.x[r*d:(r+1)*d], w.Nf, c.Eps) })
	return s.mm(s.logits, s.h, n, d, w.Head, c.Vocab)
}

// halvesToFloat32 decodes fp16 bit patterns.
func halvesToFloat32(dst []float32, h []uint16) {
	for i, x := range h {
		dst[i] = float16.Frombits(x).Float32()
	}
}

// matmul sets y = a b: a is [rows][inner], b [inner][cols] and y
// [rows][cols], row-major float32.
func matmul(y, a []float32, rows, inner int, b []float32, cols int) {
	blas32.Gemm(blas.NoTrans, blas.NoTrans, 1,
		blas32.General{Rows: rows, Cols: inner, Stride: inner, Data: a[:rows*inner]},
		blas32.General{Rows: inner, Cols: cols, Stride: cols, Data: b[:inner*cols]},
		0, blas32.General{Rows: rows, Cols: cols, Stride: cols, Data: y[:rows*cols]})
}

// attendRows is how many positions attendCPU scores at once.
const attendRows = 16

// attention is exact causal attention on the CPU in float32.
type attention struct {
	q, s, o []float32 // one KV head's queries, scores and outputs for attendRows positions
}

// attend sets s.a for the rows of s at positions t0, t0+1, …: query head
// h of the row at position t attends, with scale 1/√HeadDim and its
// softmax shifted by its maximum, the keys and values of KV head
// h / (Heads/KVHeads) at positions 0 … t. keys and values are
// [KVHeads][n][HeadDim] and hold at least the positions up to the last
// row's.
func (at *attention) attend(c Config, s *work, t0 int, keys, values []float32, n int) {
	hd, group := c.HeadDim, c.Heads/c.KVHeads
	scale := float32(1 / math.Sqrt(float64(hd)))
	for r0 := 0; r0 < s.rows; r0 += attendRows {
		r1 := min(s.rows, r0+attendRows)
		qr := (r1 - r0) * group // query rows: (row, head of the group)
		t1 := t0 + r1           // positions any of these rows reads
		if need := qr * t1; len(at.s) < need {
			at.s = make([]float32, need)
		}
		if need := attendRows * group * hd; len(at.q) < need {
			at.q, at.o = make([]float32, need), make([]float32, need)
		}
		for g := 0; g < c.KVHeads; g++ {
			for r := r0; r < r1; r++ {
				base := (r*c.Heads + g*group) * hd
				copy(at.q[(r-r0)*group*hd:(r-r0+1)*group*hd], s.q[base:base+group*hd])
			}
			kg, vg := keys[g*n*hd:(g*n+t1)*hd], values[g*n*hd:(g*n+t1)*hd]
			matmulT(at.s, at.q, qr, hd, kg, t1)
			for i := 0; i < qr; i++ {
				t := t0 + r0 + i/group // the position of this query row
				row := at.s[i*t1 : (i+1)*t1]
				mx := float32(math.Inf(-1))
				for _, x := range row[:t+1] {
					mx = max(mx, x)
				}
				var sum float64
				for j, x := range row[:t+1] {
					e := float32(math.Exp(float64((x - mx) * scale)))
					row[j] = e
					sum += float64(e)
				}
				inv := float32(1 / sum)
				for j := range row[:t+1] {
					row[j] *= inv
				}
				clear(row[t+1:])
			}
			matmul(at.o, at.s, qr, t1, vg, hd)
			for r := r0; r < r1; r++ {
				base := (r*c.Heads + g*group) * hd
				copy(s.a[base:base+group*hd], at.o[(r-r0)*group*hd:(r-r0+1)*group*hd])
			}
		}
	}
}

// attendFunc fills s.a with layer l's attention for the rows of s, at
// positions t0, t0+1, …, whose keys and values (fp16 in s.kh and s.vh)
// are stored, decoded, in keys and values ([KVHeads][n][HeadDim]).
type attendFunc func(l int, s *work, t0 int, keys, values []float32) error

// forward runs tokens through the model a chunk of positions at a time
// (the first chunk first rows long, then chunkRows), attending with
// attend, and returns the logits [n][Vocab] and every layer's keys and
// values, [Layers][KVHeads][n][HeadDim], decoded from fp16.
func (w *Weights) forward(tokens []byte, first int, attend attendFunc, mm productFunc) (logits []float32, keys, values [][]float32, err error) {
	c := w.Config
	n, hd, kv := len(tokens), c.HeadDim, c.KVHeads*c.HeadDim
	logits = make([]float32, n*c.Vocab)
	keys, values = make([][]float32, c.Layers), make([][]float32, c.Layers)
	for l := range keys {
		keys[l], values[l] = make([]float32, n*kv), make([]float32, n*kv)
	}
	s := newWork(c, min(n, max(first, chunkRows)))
	s.mm = mm
	pos := make([]int, 0, chunkRows)
	for t0, t1 := 0, min(n, first); t0 < n; t0, t1 = t1, min(n, t1+chunkRows) {
		w.embed(s, tokens[t0:t1])
		pos = pos[:0]
		for t := t0; t < t1; t++ {
			pos = append(pos, t)
		}
		for l := range w.Layers {
			if err := w.qkv(l, s, pos); err != nil {
				return nil, nil, nil, err
			}
			forRows(s.rows, func(i int) {
				for g := 0; g < c.KVHeads; g++ {
					at, from := (g*n+t0+i)*hd, (i*c.KVHeads+g)*hd
					halvesToFloat32(keys[l][at:at+hd], s.kh[from:from+hd])
					halvesToFloat32(values[l][at:at+hd], s.vh[from:from+hd])
				}
			})
			if err := attend(l, s, t0, keys[l], values[l]); err != nil {
				return nil, nil, nil, err
			}
			if err := w.finish(l, s); err != nil {
				return nil, nil, nil, err
			}
		}
		if err := w.head(s); err != nil {
			return nil, nil, nil, err
		}
		copy(logits[t0*c.Vocab:t1*c.Vocab], s.logits[:s.rows*c.Vocab])
	}
	return logits, keys, values, nil
}

// cpuAttend is an attendFunc on the CPU (attention.attend).
func (w *Weights) cpuAttend(n int) attendFunc {
	at := &attention{}
	return func(_ int, s *work, t0 int, keys, values []float32) error {
		at.attend(w.Config, s, t0, keys, values, n)
		return nil
	}
}

// Forward runs the model over tokens on the CPU in float32 and returns
// the logits at every position, [len(tokens)][Vocab]. Attention is exact
// and causal, in float32, over keys (after RoPE) and values rounded to
// fp16, as the GPU stores them; query head h reads KV head
// h / (Heads/KVHeads), scale 1/√HeadDim. It computes chunkRows positions
// at a time; its time grows with len(tokens)².
func (w *Weights) Forward(tokens []byte) ([]float32, error) {
	if len(tokens) == 0 {
		return nil, fmt.Errorf("lm: Forward of no tokens")
	}
	if err := w.validate(); err != nil {
		return nil, err
	}
	logits, _, _, err := w.forward(tokens, chunkRows, w.cpuAttend(len(tokens)), cpuProducts)
	return logits, err
}

// Reference is the model's forward pass over tokens in float64 on the
// CPU, logits [len(tokens)][Vocab]. From the float32 weights, every step
// in float64:
//
//	x = Emb[token]
//	for each layer:
//	    h = x / sqrt(mean(x²) + Eps) ⊙ N1
//	    q = h Wqᵀ, k = h Wkᵀ, v = h Wvᵀ
//	    q, k: each pair (x[2i], x[2i+1]) of a head rotated by pos·θ^(−2i/HeadDim)
//	    k, v rounded to fp16 (through float32, to nearest even)
//	    a[h] = Σ_{j ≤ t} softmax_j(q[h]·k_j[g] / √HeadDim) v_j[g], g = h / (Heads/KVHeads)
//	    x += a Woᵀ
//	    g = x / sqrt(mean(x²) + Eps) ⊙ N2
//	    x += (silu(g W1ᵀ) ⊙ g W3ᵀ) W2ᵀ, silu(z) = z / (1 + e^−z)
//	logits = (x / sqrt(mean(x²) + Eps) ⊙ Nf) Headᵀ
//
// with pos counted from 0 and the softmax shifted by its maximum. Its
// cost grows with len(tokens)²: it is meant for short sequences.
func (w *Weights) Reference(tokens []byte) ([]float64, error) {
	if len(tokens) == 0 {
		return nil, fmt.Errorf("lm: Reference of no tokens")
	}
	if err := w.validate(); err != nil {
		return nil, err
	}
	c := w.Config
	n, d, hd, kvd := len(tokens), c.Dim, c.HeadDim, c.KVHeads*c.HeadDim
	group := c.Heads / c.KVHeads
	eps := float64(c.Eps)
	norm := func(x []float64, wt []float32) []float64 {
		var ss float64
		for _, v := range x {
			ss += v * v
		}
		r := 1 / math.Sqrt(ss/float64(len(x))+eps)
		out := make([]float64, len(x))
		for i, v := range x {
			out[i] = v * r * float64(wt[i])
		}
		return out
	}
	mul := func(x []float64, wt []float32, out int) []float64 {
		in := len(x)
		y := make([]float64, out)
		for o := range y {
			row := wt[o*in : (o+1)*in]
			var s float64
			for i, v := range x {
				s += v * float64(row[i])
			}
			y[o] = s
		}
		return y
	}
	rot := func(x []float64, heads, pos int) {
		for h := 0; h < heads; h++ {
			for i := 0; i < hd/2; i++ {
				s, co := math.Sincos(ropeAngle(pos, i, hd, c.RopeTheta))
				a, b := x[h*hd+2*i], x[h*hd+2*i+1]
				x[h*hd+2*i], x[h*hd+2*i+1] = a*co-b*s, a*s+b*co
			}
		}
	}
	half := func(x []float64) {
		for i, v := range x {
			x[i] = float64(float16.Fromfloat32(float32(v)).Float32())
		}
	}
	xs := make([][]float64, n)
	for t, b := range tokens {
		xs[t] = make([]float64, d)
		for i := range xs[t] {
			xs[t][i] = float64(w.Emb[int(b)*d+i])
		}
	}
	scale := 1 / math.Sqrt(float64(hd))
	for l := range w.Layers {
		ly := &w.Layers[l]
		qs, ks, vs := make([][]float64, n), make([][]float64, n), make([][]float64, n)
		for t := range xs {
			h := norm(xs[t], ly.N1)
			qs[t], ks[t], vs[t] = mul(h, ly.Wq, c.Heads*hd), mul(h, ly.Wk, kvd), mul(h, ly.Wv, kvd)
			rot(qs[t], c.Heads, t)
			rot(ks[t], c.KVHeads, t)
			half(ks[t])
			half(vs[t])
		}
		for t := range xs {
			a := make([]float64, c.Heads*hd)
			sc := make([]float64, t+1)
			for h := 0; h < c.Heads; h++ {
				g := h / group
				q := qs[t][h*hd : (h+1)*hd]
				mx := math.Inf(-1)
				for j := 0; j <= t; j++ {
					var dot float64
					for i, v := range q {
						dot += v * ks[j][g*hd+i]
					}
					sc[j] = dot * scale
					mx = math.Max(mx, sc[j])
				}
				var sum float64
				for j := range sc {
					sc[j] = math.Exp(sc[j] - mx)
					sum += sc[j]
				}
				for j := range sc {
					p := sc[j] / sum
					for i := 0; i < hd; i++ {
						a[h*hd+i] += p * vs[j][g*hd+i]
					}
				}
			}
			o := mul(a, ly.Wo, d)
			for i := range o {
				xs[t][i] += o[i]
			}
			g := norm(xs[t], ly.N2)
			g1, g3 := mul(g, ly.W1, c.Hidden), mul(g, ly.W3, c.Hidden)
			for i, v := range g1 {
				g3[i] *= v / (1 + math.Exp(-v))
			}
			o = mul(g3, ly.W2, d)
			for i := range o {
				xs[t][i] += o[i]
			}
		}
	}
	logits := make([]float64, 0, n*c.Vocab)
	for t := range xs {
		logits = append(logits, mul(norm(xs[t], w.Nf), w.Head, c.Vocab)...)
	}
	return logits, nil
}
