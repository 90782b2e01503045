package sparse

import (
	"errors"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/vk"
)

// OracleSelector is one of the oracles of the Tactic paper's Table 3 on
// the GPU, in one dispatch (shaders/select_bins.comp): every query head
// scores each cluster by the log of its true mass, l_c = log Σ_{t∈c}
// exp(scale·q·k_t) (ClusterLogMassRef; over single-token clusters the
// token's logit), ranks the clusters by bins of l (ScoreBin semantics)
// and cuts at the fewest leading bins whose mass, with that of the tokens
// outside the index (the sinks and recent tokens, attended anyway),
// reaches p of all the mass, the target of TokenOracleRef and
// ClusterOracleRef (BinnedTopPRef states the cut exactly: bins' masses
// summed in fixed point). Over a single-token index of the middle it is
// the token oracle (exact top-p over tokens), over K-means clusters the
// cluster oracle (clusters by true mass). Whole bins are taken, so at
// least the exact oracle's mass, with bins of near-equal scores.
type OracleSelector struct{ *binSelector }

// NewTokenOracleStep prepares steps of the token oracle at target p over
// layer: the middle of DefaultBaselineLayout at the layer's current length
// in single-token clusters (the step owns that index); the sinks and every
// token after the middle are attended.
func NewTokenOracleStep(dense *Dense, layer *kvcache.Layer, p float64) (*Step, error) {
	tokens, err := baselinePages(dense, layer, 1)
	if err != nil {
		return nil, err
	}
	sel, err := NewOracleSelector(dense, layer, tokens, p)
	if err != nil {
		return nil, errors.Join(err, tokens.Release())
	}
	sel.owned = tokens
	return NewStep(dense, layer, sel)
}

// NewClusterOracleStep prepares steps of the cluster oracle at target p
// over layer, clustered as clusters says (the layer in cluster order:
// kvcache.Layer.Reorder); tokens outside the index are attended.
func NewClusterOracleStep(dense *Dense, layer *kvcache.Layer, clusters *kvcache.Clusters, p float64) (*Step, error) {
	sel, err := NewOracleSelector(dense, layer, clusters, p)
	if err != nil {
		return nil, err
	}
	return NewStep(dense, layer, sel)
}

// NewOracleSelector builds the oracle's selection kernel at target p
// (0 < p ≤ 1) over clusters of layer, stored in cluster order. The caller
// keeps clusters.
func NewOracleSelector(dense *Dense, layer *kvcache.Layer, clusters *kvcache.Clusters, p float64) (*OracleSelector, error) {
	b, err := newBinSelector(dense, layer, clusters, scoreMass, true, p, 0)
	if err != nil {
		return nil, err
	}
	return &OracleSelector{b}, nil
}

// Selection returns the clusters' bins as ranks and the cuts.
func (s *OracleSelector) Selection() Selection { return s.selection() }

// Bind makes the kernel read the queries from query.
func (s *OracleSelector) Bind(query vk.Range) error { return s.bindQuery(query) }

// Stages returns SelectStages.
func (s *OracleSelector) Stages() []string { return SelectStages }

// RecordStage appends the selection (stage 0).
func (s *OracleSelector) RecordStage(c *vk.Commands, stage int) error { return s.recordStage(c, stage) }

// Scores returns the last step's log mass of every cluster, [Hq][C].
func (s *OracleSelector) Scores() ([]float32, error) { return s.scores() }

// Bins returns the last step's bin of every cluster, [Hq][C].
func (s *OracleSelector) Bins() ([]int, error) { return s.bins() }

// Cuts returns the last step's cut per query head, in bins.
func (s *OracleSelector) Cuts() ([]int, error) { return s.cuts() }

// Release frees the kernel, its buffers and an index the step made.
func (s *OracleSelector) Release() error { return s.release() }
