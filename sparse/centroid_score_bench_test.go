package sparse

import (
	"errors"
	"fmt"
	"math/rand"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/vk/vktest"
)

// BenchmarkCentroidScores times Tactic's centroid scores (Hq 32, Hkv 8,
// D 128, 8-bit centroids of random clusters, a cluster per 16 tokens) for
// one sequence and for a batch of 8 (each its own centroids, the
// dispatches of one stage sharing its workgroups, as a batched step
// records them): float products (centroid_score) against integer dot
// products (centroid_score_dot, where the device has them), with the
// lanes of a row and the rows of a lane as the step's and a few others.
// It reports the GPU median and the codes' GB/s.
func BenchmarkCentroidScores(b *testing.B) {
	dev := vktest.Open(b)
	h := Heads{32, 8, 128}
	rng := rand.New(rand.NewSource(1))
	dense, err := NewDense(dev, h)
	require.NoError(b, err)
	defer dense.Release()
	var bufs []*vk.Buffer
	defer func() { require.NoError(b, releaseAll(bufs...)) }()
	bl := &builder{dev: dev, bufs: &bufs, cache: &dense.kernels}
	for _, n := range []int{32768, 131072} {
		c := n / 16
		const batch = 8
		type seqBufs struct{ queries, codes, scales, dims, sizes, logits, ext *vk.Buffer }
		seqs := make([]seqBufs, batch)
		codes, r, m := quantizeHeads(b, randomCentroids(rng, h.KV*c, h.Dim), h.KV, h.Dim)
		sizes := make([]uint32, h.KV*c)
		for i := range sizes {
			sizes[i] = uint32(1 + rng.Intn(30))
		}
		for s := range seqs {
			q := randomQueries(rng, h.Query*h.Dim, 1)
			x := seqBufs{bl.words(h.Query * h.Dim), bl.words(len(codes) / 4), bl.words(len(r)), bl.words(len(m)), bl.words(len(sizes)), bl.words(h.Query * c), bl.words(2 * h.Query)}
			require.NoError(b, bl.err)
			require.NoError(b, errors.Join(x.queries.WriteFloat32(0, q), x.codes.WriteUint32(0, kvcache.PackCodes(codes)), x.scales.WriteFloat32(0, r), x.dims.WriteFloat32(0, m), x.sizes.WriteUint32(0, sizes)))
			seqs[s] = x
		}
		cmd, err := dev.NewCommands()
		require.NoError(b, err)
		defer cmd.Release()
		type shape struct {
			dot      bool
			lanes, u int
		}
		for _, sh := range []shape{{false, 8, 2}, {true, 8, 2}, {true, 8, 4}, {true, 16, 4}, {false, 8, 2}} {
			if sh.dot && !dev.Info().IntegerDot {
				continue
			}
			name := "centroid_score"
			if sh.dot {
				name = "centroid_score_dot"
			}
			info := dev.Info()
			shuffle := info.SubgroupShuffle && info.SubgroupSize%uint32(sh.lanes) == 0
			sc := centroidScorer{
				pipe:  bl.kernel(name, 7, 4, scoreWorkgroup, uint32(h.Dim), 4, 0, boolWord(shuffle), uint32(sh.lanes), uint32(sh.u)),
				rows:  scoreWorkgroup / sh.lanes * sh.u,
				heads: 4, kv: h.KV, group: h.Group(), scale: h.scaleBits(),
			}
			require.NoError(b, bl.err)
			for _, batchSize := range []int{1, batch} {
				var binds []*vk.Binding
				for _, x := range seqs[:batchSize] {
					bind, err := sc.pipe.Bind(x.queries.All(), x.codes.All(), x.logits.All(), x.sizes.All(), x.ext.All(), x.scales.All(), x.dims.All())
					require.NoError(b, err)
					binds = append(binds, bind)
				}
				timed := func(warmup, reps int) ([]time.Duration, error) {
					return dev.TimeRuns(cmd, warmup, reps, func(cmd *vk.Commands) error {
						cmd.ComputeBarrier()
						for _, bind := range binds {
							sc.record(cmd, bind, c, batchSize, 0)
						}
						return nil
					})
				}
				b.Run(fmt.Sprintf("N%d/batch%d/dot%v/lanes%d/rows%d", n, batchSize, sh.dot, sh.lanes, sh.u), func(b *testing.B) {
					us := reportGPU(b, timed)
					b.ReportMetric(float64(batchSize*h.KV*c*h.Dim)/(us*1e3), "codes-GB/s")
				})
				for _, bind := range binds {
					require.NoError(b, bind.Release())
				}
			}
		}
	}
}
