package sparse

import (
	"errors"
	"fmt"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/vk"
)

// TacticDefaultRecluster is how many tokens the unclustered tail gathers
// before it is clustered and joins the index.
const TacticDefaultRecluster = 2048

// TacticDecoderOptions configure a TacticDecoder; zero values take the
// defaults.
type TacticDecoderOptions struct {
	// Sinks is the tokens before the clustered range, always attended;
	// 0 = TacticDefaultSinks.
	Sinks int
	// Recluster is the tail length at which the tail is clustered;
	// 0 = TacticDefaultRecluster.
	Recluster int
	// KMeans configures every clustering (prefill and tails).
	KMeans KMeansOptions
	// Fit is the distribution fit; the zero value is DefaultTacticFit.
	Fit TacticFit
}

// TacticDecoder runs Tactic decode steps on a layer that grows: tokens
// appended since the last clustering (the tail) are attended in full, and
// once Recluster of them have gathered they are clustered on the GPU and
// join the index.
type TacticDecoder struct {
	dense    *Dense
	km       *KMeans
	layer    *kvcache.Layer
	p        float64
	opts     TacticDecoderOptions
	clusters *kvcache.Clusters
	step     *TacticStep
	// pending is a tail clustered and stored in cluster order whose join
	// to the index failed; the next Append joins it.
	pending *kvcache.Clusters
}

// joinClusters joins a clustered tail to an index (kvcache.Clusters.Join);
// a variable, so that tests can make it fail.
var joinClusters = (*kvcache.Clusters).Join

// NewTacticDecoder clusters the layer's tokens past the sinks and prepares
// decode steps at target mass p. The decoder uses dense, km and layer but
// does not own them.
func NewTacticDecoder(dense *Dense, km *KMeans, layer *kvcache.Layer, p float64, opts TacticDecoderOptions) (*TacticDecoder, error) {
	opts, err := opts.resolve()
	if err != nil {
		return nil, err
	}
	if err := checkP(p); err != nil {
		return nil, err
	}
	if layer.Len() <= opts.Sinks {
		return nil, fmt.Errorf("sparse: a cache of %d tokens has none to cluster past its %d sinks", layer.Len(), opts.Sinks)
	}
	clusters, err := km.Cluster(layer, opts.Sinks, layer.Len()-opts.Sinks, opts.KMeans)
	if err != nil {
		return nil, err
	}
	if err := layer.Reorder(clusters); err != nil {
		return nil, errors.Join(err, clusters.Release())
	}
	d := &TacticDecoder{dense: dense, km: km, layer: layer, p: p, opts: opts, clusters: clusters}
	if d.step, err = NewTacticStep(dense, layer, clusters, p, opts.Fit); err != nil {
		return nil, errors.Join(err, clusters.Release())
	}
	return d, nil
}

// Clusters returns the current index.
func (d *TacticDecoder) Clusters() *kvcache.Clusters { return d.clusters }

// Tail returns the number of stored tokens past the clustered range.
func (d *TacticDecoder) Tail() int { return d.layer.Len() - d.clusters.First - d.clusters.Count }

// Append stores one token's k and v ([KVHeads][HeadDim] fp16 each) and,
// when the tail reaches Recluster tokens, clusters the tail, stores it in
// cluster order and joins it to the index. When the clustering or the
// reorder fails, the token is dropped again and the cache and the index
// are as they were. When the join fails after the reorder, the token
// stays stored, the reordered tail waits (attended in full, as every
// token past the index) and the next Append joins it; the error says so.
func (d *TacticDecoder) Append(k, v []uint16) error {
	if d.step == nil {
		return vk.ErrReleased
	}
	if err := d.layer.Append(k, v); err != nil {
		return err
	}
	if d.pending == nil {
		if d.Tail() < d.opts.Recluster {
			return nil
		}
		tail, err := d.km.Cluster(d.layer, d.clusters.First+d.clusters.Count, d.Tail(), d.opts.KMeans)
		if err != nil {
			return d.undo(err)
		}
		if err := d.layer.Reorder(tail); err != nil {
			return errors.Join(d.undo(err), tail.Release())
		}
		d.pending = tail
	}
	fail := func(err error) error {
		return fmt.Errorf("sparse: the token is stored, but joining the clustered tail to the index failed (tried again at the next Append): %w", err)
	}
	joined, err := joinClusters(d.clusters, d.dense.dev, d.pending)
	if err != nil {
		return fail(err)
	}
	if err := d.step.SetClusters(joined); err != nil {
		return errors.Join(fail(err), joined.Release())
	}
	err = errors.Join(d.clusters.Release(), d.pending.Release())
	d.clusters, d.pending = joined, nil
	return err
}

// undo drops the token just appended and returns err.
func (d *TacticDecoder) undo(err error) error {
	return errors.Join(err, d.layer.Truncate(d.layer.Len()-1))
}

// Attend runs one decode step for the queries q ([Hq][HeadDim]) and returns
// the output, [Hq][HeadDim].
func (d *TacticDecoder) Attend(q []float32) ([]float32, error) { return d.step.Attend(q) }

// Step returns the decode step (moved onto each new index).
func (d *TacticDecoder) Step() *TacticStep { return d.step }

// Release frees the index and the step (not the layer or the kernels).
func (d *TacticDecoder) Release() error {
	if d.step == nil {
		return vk.ErrReleased
	}
	err := errors.Join(d.step.Release(), d.clusters.Release())
	if d.pending != nil {
		err = errors.Join(err, d.pending.Release())
	}
	d.step, d.clusters, d.pending = nil, nil, nil
	return err
}
