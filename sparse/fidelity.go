package sparse

import (
	"fmt"
	"math"
	"sort"
)

// Fidelity describes how well one query head's selected token set I stands
// in for dense attention. p_i is the exact softmax over every token the query
// attends.
type Fidelity struct {
	// Mass is p(I) = Σ_{i∈I} p_i, the attention mass the selection captures.
	Mass float64
	// Selected is |I|.
	Selected int
	// GlobalOptimal is TopPCount(p, P): the fewest tokens reaching mass P.
	GlobalOptimal int
	// ClusterOptimal is ClusterTopPCount(p, clusters, forced, P): the fewest
	// tokens reaching P when whole clusters are taken on top of the forced
	// tokens.
	ClusterOptimal int
	// Err is ‖o − ô‖₂ where o is dense attention and ô attention
	// restricted to I (AttendSubsetRef); RelErr is Err / ‖o‖₂ (see
	// RelativeError).
	Err, RelErr float64
}

// SuccessTolerance absorbs the rounding of the probability sums in
// Success: a selection of every token has mass 1 only up to rounding.
const SuccessTolerance = 1e-9

// Success reports whether the selection reached the target: Mass ≥ p −
// SuccessTolerance.
func (f Fidelity) Success(p float64) bool { return f.Mass >= p-SuccessTolerance }

// SoftmaxRef returns p_i = exp(s_i − m) / Σ_j exp(s_j − m) for every row i
// of keys, with s_i = scale·q·k_i and m = max s; the sum runs in row order.
func SoftmaxRef(q, keys []float64, scale float64) ([]float64, error) {
	n, err := checkKV(q, keys, nil)
	if err != nil {
		return nil, err
	}
	if n == 0 {
		return nil, fmt.Errorf("sparse: SoftmaxRef: no keys")
	}
	p, m := scaledScores(q, keys, scale)
	z := 0.0
	for i := range p {
		p[i] = math.Exp(p[i] - m)
		z += p[i]
	}
	for i := range p {
		p[i] /= z
	}
	return p, nil
}

// SubsetMass returns Σ_{i∈tokens} probs[i], summed in the order of tokens,
// which must be distinct ids in [0, len(probs)).
func SubsetMass(probs []float64, tokens []int32) (float64, error) {
	if err := checkTokens(tokens, len(probs)); err != nil {
		return 0, err
	}
	s := 0.0
	for _, t := range tokens {
		s += probs[t]
	}
	return s, nil
}

// CheckP returns an error unless the target mass p lies in (0, 1], the
// range every policy and measure here accepts.
func CheckP(p float64) error { return checkP(p) }

func checkP(p float64) error {
	if !(p > 0 && p <= 1) {
		return fmt.Errorf("sparse: target mass P = %v outside (0, 1]", p)
	}
	return nil
}

// TopPCount returns the global-optimal count: with probs sorted in
// descending order and c_k the running sum of the first k, the least k with
// c_k ≥ p·c_n (c_n, the same running sum over all, equals Σ probs up to
// rounding, so the count never exceeds n).
func TopPCount(probs []float64, p float64) (int, error) {
	if err := checkP(p); err != nil {
		return 0, err
	}
	s := append([]float64(nil), probs...)
	sort.Sort(sort.Reverse(sort.Float64Slice(s)))
	return topPCountSorted(s, p), nil
}

// topPCountSorted is TopPCount of probabilities already in descending
// order.
func topPCountSorted(desc []float64, p float64) int {
	total := 0.0
	for _, x := range desc {
		total += x
	}
	c := 0.0
	for k, x := range desc {
		c += x
		if c >= p*total {
			return k + 1
		}
	}
	return len(desc)
}

// ClusterTopPCount returns the cluster-optimal count on top of a forced
// token set F (tokens every selection includes; may be empty). Each cluster
// contributes its members outside F: mass m_c = Σ probs over them and size
// n_c = their number. Clusters are taken in descending order of m_c (ties:
// lower cluster index first) until Σ_{F} probs + Σ m_c ≥ p·Σ probs (all
// sums in float64, Σ probs in index order); the result is |F| + Σ n_c of the
// clusters taken (|F| alone if F already reaches the target; every token of
// F and of the clusters if rounding keeps the target out of reach). Tokens
// must be distinct within F and within the clusters together.
func ClusterTopPCount(probs []float64, clusters [][]int32, forced []int32, p float64) (int, error) {
	if err := checkP(p); err != nil {
		return 0, err
	}
	n := len(probs)
	if err := checkTokens(forced, n); err != nil {
		return 0, err
	}
	inF := make([]bool, n)
	for _, t := range forced {
		inF[t] = true
	}
	seen := make([]bool, n)
	mass := make([]float64, len(clusters))
	size := make([]int, len(clusters))
	for c, mem := range clusters {
		for _, t := range mem {
			if t < 0 || int(t) >= n {
				return 0, fmt.Errorf("sparse: ClusterTopPCount: cluster %d token %d outside [0, %d)", c, t, n)
			}
			if seen[t] {
				return 0, fmt.Errorf("sparse: ClusterTopPCount: token %d in two clusters", t)
			}
			seen[t] = true
			if !inF[t] {
				mass[c] += probs[t]
				size[c]++
			}
		}
	}
	total := 0.0
	for _, x := range probs {
		total += x
	}
	got, count := 0.0, len(forced)
	for _, t := range forced {
		got += probs[t]
	}
	if got >= p*total {
		return count, nil
	}
	order := make([]int, len(clusters))
	for i := range order {
		order[i] = i
	}
	sort.SliceStable(order, func(i, j int) bool { return mass[order[i]] > mass[order[j]] })
	for _, c := range order {
		got += mass[c]
		count += size[c]
		if got >= p*total {
			break
		}
	}
	return count, nil
}

// RelativeError returns ‖o − ref‖₂ / ‖ref‖₂ (+Inf if ref is zero and o is
// not, 0 if both are zero).
func RelativeError(o, ref []float64) (float64, error) {
	_, rel, err := outputError(o, ref)
	return rel, err
}

// outputError returns ‖o − ref‖₂ and the relative error of RelativeError.
func outputError(o, ref []float64) (abs, rel float64, err error) {
	if len(o) != len(ref) {
		return 0, 0, fmt.Errorf("sparse: RelativeError: lengths %d and %d differ", len(o), len(ref))
	}
	var num, den float64
	for i := range o {
		e := o[i] - ref[i]
		num += e * e
		den += ref[i] * ref[i]
	}
	switch {
	case num == 0:
		return 0, 0, nil
	case den == 0:
		return math.Sqrt(num), math.Inf(1), nil
	}
	return math.Sqrt(num), math.Sqrt(num / den), nil
}

// FidelityRef measures a selection for one query head: q attends every row
// of keys and values (n×d, d = len(q)); selected is the token set I it
// actually uses; clusters and forced define the cluster-optimal oracle (see
// ClusterTopPCount); p is the target mass.
func FidelityRef(q, keys, values []float64, scale float64, selected []int32, clusters [][]int32, forced []int32, p float64) (Fidelity, error) {
	o, err := NewFidelityOracle(q, keys, values, scale)
	if err != nil {
		return Fidelity{}, err
	}
	return o.Measure(selected, nil, clusters, forced, p)
}

// FidelityOracle is what FidelityRef computes from one query alone: the
// exact softmax over every token (SoftmaxRef), the same sorted in
// descending order, and dense attention (AttendRef). It measures several
// selections of that query without computing them again. It is read-only
// once made, so safe for concurrent use.
type FidelityOracle struct {
	q, keys, values []float64
	scale           float64
	probs, desc     []float64
	dense           []float64
}

// NewFidelityOracle computes the oracle of query q over every row of keys
// and values (n×d, d = len(q)) at the given score scale. It keeps the
// slices, which must not change while it is in use.
func NewFidelityOracle(q, keys, values []float64, scale float64) (*FidelityOracle, error) {
	o := &FidelityOracle{q: q, keys: keys, values: values, scale: scale}
	var err error
	if o.probs, err = SoftmaxRef(q, keys, scale); err != nil {
		return nil, err
	}
	o.desc = append([]float64(nil), o.probs...)
	sort.Sort(sort.Reverse(sort.Float64Slice(o.desc)))
	if o.dense, err = AttendRef(q, keys, values, scale); err != nil {
		return nil, err
	}
	return o, nil
}

// Measure returns FidelityRef of the oracle's query: the Fidelity of the
// selection selected at target mass p, clusters and forced defining the
// cluster-optimal count. out, if not nil, must be AttendSubsetRef over
// selected (as TacticDecodeRef returns it), which is then not computed
// again.
func (o *FidelityOracle) Measure(selected []int32, out []float64, clusters [][]int32, forced []int32, p float64) (Fidelity, error) {
	var f Fidelity
	var err error
	if err = checkP(p); err != nil {
		return f, err
	}
	if f.Mass, err = SubsetMass(o.probs, selected); err != nil {
		return f, err
	}
	f.Selected = len(selected)
	f.GlobalOptimal = topPCountSorted(o.desc, p)
	if f.ClusterOptimal, err = ClusterTopPCount(o.probs, clusters, forced, p); err != nil {
		return f, err
	}
	if out == nil {
		if out, err = AttendSubsetRef(o.q, o.keys, o.values, selected, o.scale); err != nil {
			return f, err
		}
	}
	f.Err, f.RelErr, err = outputError(out, o.dense)
	return f, err
}

// CompareHeads compares an output got ([heads][dim] float32) with its
// float64 reference want, head by head: it returns an error naming the
// first head whose relative error ‖got − want‖ / ‖want‖ is not below tol
// (NaN counts as infinitely far), with that head's first few elements off
// by more than tol times want's root mean square; nil when every head is
// within tol.
func CompareHeads(want []float64, got []float32, dim int, tol float64) error {
	if len(got) != len(want) || dim < 1 || len(want)%dim != 0 {
		return fmt.Errorf("sparse: CompareHeads: %d elements against %d, heads of %d", len(got), len(want), dim)
	}
	for h := 0; h*dim < len(want); h++ {
		var num, den float64
		for i := h * dim; i < (h+1)*dim; i++ {
			diff := float64(got[i]) - want[i]
			if math.IsNaN(diff) {
				diff = math.Inf(1)
			}
			num += diff * diff
			den += want[i] * want[i]
		}
		rel := math.Sqrt(num / math.Max(den, 1e-300))
		if rel < tol {
			continue
		}
		var first []string
		for i := h * dim; i < (h+1)*dim && len(first) < 5; i++ {
			if d := math.Abs(float64(got[i]) - want[i]); !(d <= tol*math.Sqrt(den/float64(dim))) {
				first = append(first, fmt.Sprintf("[%d] got %g want %g", i-h*dim, got[i], want[i]))
			}
		}
		return fmt.Errorf("head %d relative error %.3g ≥ %.g; first mismatches: %v", h, rel, tol, first)
	}
	return nil
}
