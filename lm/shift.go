package lm

import (
	"fmt"
	"math"
	"slices"

	"github.com/vksparse/vksparse/sparse"
)

// AttentionShifts runs tokens through the model on the CPU (exact
// attention, fp16 keys and values) and returns, for each pair of
// consecutive layers (l, l+1), their attention shift averaged over the
// given positions and every query head: the mean of 1 − cos(α_l, α_{l+1})
// (sparse.AttentionShiftRef) between head h's attention distributions over
// the tokens up to the position in the two layers. DELTA's calibration
// (the DELTA paper, section 4) refreshes its page selection where that shift is large.
func (w *Weights) AttentionShifts(tokens []byte, positions []int) ([]float64, error) {
	if err := w.validate(); err != nil {
		return nil, err
	}
	n := len(tokens)
	if len(positions) == 0 {
		return nil, fmt.Errorf("lm: attention shifts at no position")
	}
	for _, p := range positions {
		if p < 0 || p >= n {
			return nil, fmt.Errorf("lm: attention shift at position %d of %d tokens", p, n)
		}
	}
	c := w.Config
	hd, group := c.HeadDim, c.Heads/c.KVHeads
	scale := 1 / math.Sqrt(float64(hd))
	// dists[l][i][h]: layer l's distribution of head h at positions[i].
	dists := make([][][][]float64, c.Layers)
	cpu := w.cpuAttend(n)
	attend := func(l int, s *work, t0 int, keys, values []float32) error {
		for i, p := range positions {
			r := p - t0
			if r < 0 || r >= s.rows {
				continue
			}
			if dists[l] == nil {
				dists[l] = make([][][]float64, len(positions))
			}
			dists[l][i] = make([][]float64, c.Heads)
			for h := 0; h < c.Heads; h++ {
				g := h / group
				q := make([]float64, hd)
				for j := range q {
					q[j] = float64(s.q[(r*c.Heads+h)*hd+j])
				}
				k := make([]float64, (p+1)*hd)
				for j := range k {
					k[j] = float64(keys[g*n*hd+j])
				}
				d, err := sparse.SoftmaxRef(q, k, scale)
				if err != nil {
					return err
				}
				dists[l][i][h] = d
			}
		}
		return cpu(l, s, t0, keys, values)
	}
	if _, _, _, err := w.forward(tokens, chunkRows, attend, cpuProducts); err != nil {
		return nil, err
	}
	shifts := make([]float64, c.Layers-1)
	for l := range shifts {
		for i := range positions {
			for h := 0; h < c.Heads; h++ {
				s, err := sparse.AttentionShiftRef(dists[l][i][h], dists[l+1][i][h])
				if err != nil {
					return nil, err
				}
				shifts[l] += s / float64(len(positions)*c.Heads)
			}
		}
	}
	return shifts, nil
}

// ProposeRefresh proposes DELTA's Δ-layers from the attention shifts of
// consecutive layers (AttentionShifts): the first layer after the warm-up,
// and every later layer whose shift from the layer before is above the
// mean shift of the layers past the warm-up.
func ProposeRefresh(shifts []float64, warmup int) ([]int, error) {
	layers := len(shifts) + 1
	if warmup < 0 || warmup >= layers {
		return nil, fmt.Errorf("lm: a warm-up of %d layers of %d", warmup, layers)
	}
	refresh := []int{warmup}
	var mean float64
	count := 0
	for l := warmup + 1; l < layers; l++ {
		mean += shifts[l-1]
		count++
	}
	if count == 0 {
		return refresh, nil
	}
	mean /= float64(count)
	for l := warmup + 1; l < layers; l++ {
		if shifts[l-1] > mean {
			refresh = append(refresh, l)
		}
	}
	return slices.Clip(refresh), nil
}
