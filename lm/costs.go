package lm

import (
	"fmt"
	"math"
	"sort"
)

// Costs is what a sparse attention policy costs a model's next-byte
// distributions against dense attention's at the same positions.
type Costs struct {
	Positions int `json:"positions"`
	// BitsPerByte is −log2 p(next byte) averaged over the positions whose
	// next byte is known, under the policy; DenseBitsPerByte the same
	// under dense attention.
	BitsPerByte      float64 `json:"bits_per_byte"`
	DenseBitsPerByte float64 `json:"dense_bits_per_byte"`
	// KL is KL(dense ‖ policy) in nats: its mean and 99th percentile.
	KLMean float64 `json:"kl_mean"`
	KLP99  float64 `json:"kl_p99"`
	// Top1 is the share of positions where both argmaxes agree.
	Top1 float64 `json:"top1"`
	// Acceptance is E[Σ_x min(p_dense(x), p_policy(x))], the chance that a
	// draft sampled from the policy's distribution is accepted against
	// dense attention's in speculative decoding.
	Acceptance float64 `json:"acceptance"`
}

// Softmax returns the distribution of logits, computed in float64.
func Softmax(logits []float32) []float64 {
	m := math.Inf(-1)
	for _, x := range logits {
		m = math.Max(m, float64(x))
	}
	p := make([]float64, len(logits))
	sum := 0.0
	for i, x := range logits {
		p[i] = math.Exp(float64(x) - m)
		sum += p[i]
	}
	for i := range p {
		p[i] /= sum
	}
	return p
}

// CompareLogits returns the costs of the policy's logits against dense
// logits at the same positions, both [positions][vocab] row-major; next[i]
// is the byte that follows position i, or −1 where it is unknown (the
// bits per byte skip such positions). KL(p‖q) = Σ p ln(p/q) over x with
// p(x) > 0; the 99th percentile is the value at rank ⌈0.99·n⌉ − 1 of the
// sorted KLs.
func CompareLogits(dense, policy []float32, vocab int, next []int) (Costs, error) {
	if vocab <= 0 || len(dense) == 0 || len(dense) != len(policy) || len(dense)%vocab != 0 {
		return Costs{}, fmt.Errorf("lm: logits of %d and %d values for a vocabulary of %d", len(dense), len(policy), vocab)
	}
	n := len(dense) / vocab
	if len(next) != n {
		return Costs{}, fmt.Errorf("lm: %d next bytes for %d positions", len(next), n)
	}
	c := Costs{Positions: n}
	kls := make([]float64, n)
	known := 0
	for i := 0; i < n; i++ {
		d, q := dense[i*vocab:(i+1)*vocab], policy[i*vocab:(i+1)*vocab]
		for _, x := range append(append([]float32(nil), d...), q...) {
			if math.IsNaN(float64(x)) || math.IsInf(float64(x), 0) {
				return Costs{}, fmt.Errorf("lm: a logit at position %d is %v", i, x)
			}
		}
		pd, pq := Softmax(d), Softmax(q)
		kl, overlap := 0.0, 0.0
		for x := range pd {
			if pd[x] > 0 {
				kl += pd[x] * math.Log(pd[x]/pq[x])
			}
			overlap += math.Min(pd[x], pq[x])
		}
		kls[i] = math.Max(kl, 0)
		c.KLMean += kls[i]
		c.Acceptance += overlap
		if argmax(pd) == argmax(pq) {
			c.Top1++
		}
		if b := next[i]; b >= 0 && b < vocab {
			c.BitsPerByte -= math.Log2(pq[b])
			c.DenseBitsPerByte -= math.Log2(pd[b])
			known++
		} else if b >= vocab {
			return Costs{}, fmt.Errorf("lm: next byte %d at position %d outside the vocabulary of %d", b, i, vocab)
		}
	}
	c.KLMean /= float64(n)
	c.Acceptance /= float64(n)
	c.Top1 /= float64(n)
	if known > 0 {
		c.BitsPerByte /= float64(known)
		c.DenseBitsPerByte /= float64(known)
	}
	sort.Float64s(kls)
	c.KLP99 = kls[int(math.Ceil(0.99*float64(n)))-1]
	return c, nil
}

// BitsPerByte returns −log2 p(next[i]) averaged over the positions of
// logits ([positions][vocab]) with next[i] ≥ 0.
func BitsPerByte(logits []float32, vocab int, next []int) (float64, error) {
	c, err := CompareLogits(logits, logits, vocab, next)
	return c.BitsPerByte, err
}

// Argmax returns the first index of the greatest logit: the greedy choice
// of the next byte.
func Argmax(logits []float32) int { return argmax(logits) }

// argmax returns the first index of x's greatest value.
func argmax[T float32 | float64](x []T) int {
	best := 0
	for i, v := range x {
		if v > x[best] {
			best = i
		}
	}
	return best
}
