package evaluate

import (
	"fmt"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/sparse"
)

// Skeleton is a step's skeleton: as many dependent dispatches as the step
// has stages, stage i streaming Bytes[i] contiguously and doing nothing
// else. No step that reads those bytes in those dispatches can be faster
// on the device, so Step / Us says how far the step lies above its floor.
// Bytes are counted from the step after it ran (Policy.Reads); Us and
// StageUs are filled by whoever times the skeleton (vkbench, with its read
// probe) in the same run as the step.
type Skeleton struct {
	Stages  []string  `json:"stages"`
	Bytes   []float64 `json:"stage_bytes"`
	StageUs []float64 `json:"stage_us,omitempty"`
	Us      float64   `json:"us,omitempty"`
	// StepOver is the step's median over Us.
	StepOver float64 `json:"step_over_skeleton,omitempty"`
}

// MB returns each stage's bytes in MB (10⁶ bytes).
func (s *Skeleton) MB() []float64 {
	out := make([]float64, len(s.Bytes))
	for i, b := range s.Bytes {
		out[i] = b / 1e6
	}
	return out
}

// Total returns the bytes of every stage.
func (s *Skeleton) Total() float64 {
	t := 0.0
	for _, b := range s.Bytes {
		t += b
	}
	return t
}

// Timed records the skeleton's times, stageUs in Stages order and their
// sum us, and the step's median stepUs over them.
func (s *Skeleton) Timed(stageUs []float64, us, stepUs float64) {
	s.StageUs, s.Us = stageUs, us
	if us > 0 {
		s.StepOver = stepUs / us
	}
}

// Add adds the bytes of o, a skeleton of the same stages (another
// sequence of a batch), stage by stage.
func (s *Skeleton) Add(o *Skeleton) error {
	if len(o.Bytes) != len(s.Bytes) {
		return fmt.Errorf("evaluate: skeletons of %d and %d stages", len(s.Bytes), len(o.Bytes))
	}
	for i := range s.Bytes {
		s.Bytes[i] += o.Bytes[i]
	}
	return nil
}

// The counts below are the arrays a stage streams, each element once:
// fp16 rows of keys and values, 8-bit rows of centroids with their row and
// dimension scales, and float32 or uint32 words of scores and cluster
// sizes. The queries, cuts and counters, a few words a head, are left out.

// rowBytes returns the bytes of one fp16 row of heads.
func rowBytes(h sparse.Heads) float64 { return float64(2 * h.Dim) }

// attendBytes returns what attention over rows rows per KV head reads:
// their keys and values.
func attendBytes(h sparse.Heads, rows float64) float64 {
	return float64(h.KV) * rows * 2 * rowBytes(h)
}

// centroidBytes returns what scoring the centroids of x reads: every KV
// head's 8-bit centroids with their row and dimension scales
// (kvcache.CodedHeadBytes) and cluster sizes.
func centroidBytes(h sparse.Heads, x *kvcache.Clusters) float64 {
	return float64(h.KV * (kvcache.CodedHeadBytes(x.C, h.Dim) + 4*x.C))
}

// keyBytes returns what scoring every stored key of layer reads.
func keyBytes(h sparse.Heads, layer *kvcache.Layer) float64 {
	return float64(h.KV*layer.Len()) * rowBytes(h)
}

// stepAttended returns the rows the step attended per KV head in the step
// that ran last (sparse.Step.Attended).
func stepAttended(s Stepper) (float64, error) {
	a, ok := s.(interface{ Attended() (float64, error) })
	if !ok {
		return 0, fmt.Errorf("evaluate: a %T does not report the rows it attended", s)
	}
	return a.Attended()
}

// attendOnly counts a step whose only stage is attention (StreamingLLM,
// a DELTA layer reusing a pick).
func attendOnly(s Stepper, l *Layers) ([]float64, error) {
	rows, err := stepAttended(s)
	if err != nil {
		return nil, err
	}
	return []float64{attendBytes(l.Dense.Heads(), rows)}, nil
}

// TacticReads counts a Tactic step over x: the centroids; the fit's key
// rows (sparse.TacticStep.FitRows, every query head's), the scores and
// the clusters' starts and sizes, or with the moment estimate the scores,
// sizes, spreads and dimension weights; attention over the union.
func TacticReads(t *sparse.TacticStep, h sparse.Heads, x *kvcache.Clusters) ([]float64, error) {
	fit, err := t.FitRows()
	if err != nil {
		return nil, err
	}
	sampled := 0
	for _, r := range fit {
		sampled += r
	}
	rows, err := t.Attended()
	if err != nil {
		return nil, err
	}
	index := float64(h.Query*x.C*4 + 2*h.KV*x.C*4)
	if t.Fit().Moments {
		index = float64(2*h.Query*x.C*4 + h.KV*x.C*4 + h.Query*h.Dim*4)
	}
	return []float64{centroidBytes(h, x), float64(sampled)*rowBytes(h) + index, attendBytes(h, rows)}, nil
}

// tacticReads is TacticReads for a policy's step.
func tacticReads(s Stepper, l *Layers) ([]float64, error) {
	return TacticReads(s.(*sparse.TacticStep), l.Dense.Heads(), l.Clusters)
}

// doublePReads counts a Double-P step: the centroids; the logits its cut
// ranks; attention over the union and the pseudo-tokens (counted as rows).
func doublePReads(s Stepper, l *Layers) ([]float64, error) {
	h, x := l.Dense.Heads(), l.Clusters
	rows, err := stepAttended(s)
	if err != nil {
		return nil, err
	}
	return []float64{centroidBytes(h, x), float64(h.Query * x.C * 4), attendBytes(h, rows)}, nil
}

// keysThenAttend counts a step whose one selection stage scores every
// key of layer (the oracles) against the clusters of x, then attends.
func keysThenAttend(layer func(l *Layers) *kvcache.Layer) func(s Stepper, l *Layers) ([]float64, error) {
	return func(s Stepper, l *Layers) ([]float64, error) {
		h := l.Dense.Heads()
		rows, err := stepAttended(s)
		if err != nil {
			return nil, err
		}
		return []float64{keyBytes(h, layer(l)), attendBytes(h, rows)}, nil
	}
}

// questReads counts a Quest step: every page's fp16 key minima and maxima
// (pages of sparse.QuestPageSize over the middle of the baseline layout),
// then attention.
func questReads(s Stepper, l *Layers) ([]float64, error) {
	h := l.Dense.Heads()
	lo, hi := sparse.DefaultBaselineLayout().Middle(l.Positional.Len())
	pages := (hi - lo + sparse.QuestPageSize - 1) / sparse.QuestPageSize
	rows, err := stepAttended(s)
	if err != nil {
		return nil, err
	}
	return []float64{2 * float64(h.KV*pages) * rowBytes(h), attendBytes(h, rows)}, nil
}

// h2oReads counts an H2O step: every query head's recorded logits and
// accumulated attention over the tokens; attention.
func h2oReads(s Stepper, l *Layers) ([]float64, error) {
	h, n := l.Dense.Heads(), l.Positional.Len()
	rows, err := stepAttended(s)
	if err != nil {
		return nil, err
	}
	return []float64{float64(2 * h.Query * n * 4), attendBytes(h, rows)}, nil
}

// lukaReads counts a LuKA step: the keys of its cover (summaries and the
// raw tail) per KV head; every query head's scores of the cover; the
// cover's and the refined summaries' keys and values (sparse.LuKAStep.
// Attended).
func lukaReads(s Stepper, l *Layers) ([]float64, error) {
	st := s.(*sparse.LuKAStep)
	h, n := l.Dense.Heads(), l.Positional.Len()
	cover := st.Summaries() + n - st.Summaries()*st.Options().Segment
	rows, err := st.Attended()
	if err != nil {
		return nil, err
	}
	return []float64{float64(h.KV*cover) * rowBytes(h), float64(h.Query * cover * 4), attendBytes(h, rows)}, nil
}

// skeletonOf returns the skeleton of a step that ran last, counted by
// reads, with the step's stage names.
func skeletonOf(s Stepper, l *Layers, reads func(Stepper, *Layers) ([]float64, error)) (*Skeleton, error) {
	b, err := reads(s, l)
	if err != nil {
		return nil, err
	}
	stages := s.Stages()
	if len(b) != len(stages) {
		return nil, fmt.Errorf("evaluate: %d stages' bytes counted for the %d stages %v", len(b), len(stages), stages)
	}
	return &Skeleton{Stages: stages, Bytes: b}, nil
}
