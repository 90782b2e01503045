package sparse

import (
	"fmt"
	"math"

	"github.com/vksparse/vksparse/vk"
)

// LogSumExpRef returns ln Σ_t exp(scale·q·k_t) over the n rows of keys
// (n×d row-major), computed in float64 shifted by its maximum: the
// normaliser of the softmax AttendRef takes, which lets attention over
// two disjoint sets of tokens be merged exactly.
func LogSumExpRef(q, keys []float64, scale float64) (float64, error) {
	d := len(q)
	if d == 0 || len(keys)%d != 0 || len(keys) == 0 {
		return 0, fmt.Errorf("sparse: keys of %d values for a query of %d", len(keys), d)
	}
	s, m := scaledScores(q, keys, scale)
	sum := 0.0
	for _, x := range s {
		sum += math.Exp(x - m)
	}
	return m + math.Log(sum), nil
}

// scaledScores returns scale·q·k_t for every row t of keys (len(q) wide)
// and their maximum.
func scaledScores(q, keys []float64, scale float64) ([]float64, float64) {
	d := len(q)
	s := make([]float64, len(keys)/d)
	m := math.Inf(-1)
	for t := range s {
		s[t] = scale * dot(q, keys[t*d:(t+1)*d])
		m = math.Max(m, s[t])
	}
	return s, m
}

// LogSumExp returns, for each sequence and query head ([B][Hq]), the log
// of the normaliser of the softmax the plan's last run took, ln Σ_t
// exp(scale·q·k_t) over every token of the sequence (LogSumExpRef), from
// the maxima m_c and sums l_c its chunks left: M + ln Σ_c exp(m_c − M)·l_c
// with M = max_c m_c. With it, attention over a sequence's stored tokens
// merges exactly with attention over other tokens computed elsewhere (a
// prefill's causal block, say). It holds for plans over whole sequences
// (Dense.Plan); read it once the commands ran, before the sequences grow.
func (p *DensePlan) LogSumExp() ([]float32, error) {
	if p.query == nil {
		return nil, vk.ErrReleased
	}
	if _, ok := p.mode.(*denseMode); !ok {
		return nil, fmt.Errorf("sparse: LogSumExp of a plan over token lists or clusters")
	}
	h := p.d.heads
	ml := make([]float32, len(p.seqs)*h.Query*p.maxChunks*2)
	r := p.parts[1]
	if err := r.Buffer.ReadFloat32(r.Offset, ml); err != nil {
		return nil, err
	}
	out := make([]float32, len(p.seqs)*h.Query)
	for b, s := range p.seqs {
		n := s.Len()
		nc := ceilDiv(n, p.chunkFor(n))
		for hh := 0; hh < h.Query; hh++ {
			base := (b*h.Query + hh) * p.maxChunks * 2
			m := math.Inf(-1)
			for c := 0; c < nc; c++ {
				m = math.Max(m, float64(ml[base+2*c]))
			}
			sum := 0.0
			for c := 0; c < nc; c++ {
				if mc := float64(ml[base+2*c]); !math.IsInf(mc, -1) {
					sum += math.Exp(mc-m) * float64(ml[base+2*c+1])
				}
			}
			out[b*h.Query+hh] = float32(m + math.Log(sum))
		}
	}
	return out, nil
}
