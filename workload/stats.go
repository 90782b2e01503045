package workload

import (
	"fmt"
	"math"
	"sort"
	"sync"

	"github.com/x448/float16"

	"github.com/vksparse/vksparse/trace"
)

// Attention is the exact softmax attention of one query head of one decode
// query, computed in float64 from the trace's fp16 keys.
type Attention struct {
	// Logits[n] is q·k_n·Scale for the keys n = 0..QPos the query attends.
	Logits []float64
	// Probs is the softmax of Logits, in the same token order.
	Probs []float64
	// descending is Probs sorted from largest to smallest.
	descending []float64
}

// HeadAttention computes the exact attention of query head `head` for
// decode query `query` of t, over the keys 0..QPos[query].
func HeadAttention(t *trace.Trace, query, head int) (*Attention, error) {
	if err := t.Validate(); err != nil {
		return nil, err
	}
	if query < 0 || query >= t.Queries() {
		return nil, fmt.Errorf("workload: query %d outside [0, %d)", query, t.Queries())
	}
	if head < 0 || head >= t.QHeads {
		return nil, fmt.Errorf("workload: head %d outside [0, %d)", head, t.QHeads)
	}
	d := t.HeadDim
	kvHead := head / (t.QHeads / t.KVHeads)
	q := t.Query(query)[head*d : (head+1)*d]
	keys := t.K[kvHead*t.Tokens*d:]
	n := int(t.QPos[query]) + 1

	halfToFloat := halfTable()
	a := &Attention{Logits: make([]float64, n), Probs: make([]float64, n)}
	maxLogit := math.Inf(-1)
	for tok := range n {
		var dot float64
		for i, x := range keys[tok*d : (tok+1)*d] {
			dot += float64(q[i]) * float64(halfToFloat[x])
		}
		a.Logits[tok] = dot * t.Scale
		maxLogit = max(maxLogit, a.Logits[tok])
	}
	var sum float64
	for tok, l := range a.Logits {
		a.Probs[tok] = math.Exp(l - maxLogit)
		sum += a.Probs[tok]
	}
	for tok := range a.Probs {
		a.Probs[tok] /= sum
	}
	a.descending = append([]float64(nil), a.Probs...)
	sort.Sort(sort.Reverse(sort.Float64Slice(a.descending)))
	return a, nil
}

// halfTable returns the float32 value of every fp16 bit pattern.
var halfTable = sync.OnceValue(func() []float32 {
	table := make([]float32, 1<<16)
	for bits := range table {
		table[bits] = float16.Frombits(uint16(bits)).Float32()
	}
	return table
})

// LogitStd returns the standard deviation of the logits over the attended
// tokens.
func (a *Attention) LogitStd() float64 {
	var mean float64
	for _, l := range a.Logits {
		mean += l
	}
	mean /= float64(len(a.Logits))
	var variance float64
	for _, l := range a.Logits {
		variance += (l - mean) * (l - mean)
	}
	return math.Sqrt(variance / float64(len(a.Logits)))
}

// TokensFor returns the fewest tokens whose probabilities sum to at least
// p (exact top-p: the largest probabilities first). p ≤ 0 gives 0 and p
// beyond the total (rounding) gives all tokens.
func (a *Attention) TokensFor(p float64) int {
	var cum float64
	for i, x := range a.descending {
		if cum >= p {
			return i
		}
		cum += x
	}
	return len(a.descending)
}

// Mass returns the total probability of tokens [from, to), clipped to the
// attended tokens.
func (a *Attention) Mass(from, to int) float64 {
	from, to = max(from, 0), min(to, len(a.Probs))
	var sum float64
	for i := from; i < to; i++ {
		sum += a.Probs[i]
	}
	return sum
}
