package kvcache

import (
	"math/rand"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/vk/vktest"
)

// randomClusters returns an index of c clusters over [first, first+count)
// whose every head holds a random valid partition of the tokens.
func randomClusters(t *testing.T, dev *vk.Device, rng *rand.Rand, heads, dim, c, first, count int) *Clusters {
	t.Helper()
	x, err := NewClusters(dev, heads, dim, c, first, count)
	require.NoError(t, err)
	var cent, norms []float32
	var counts, starts, members, assign []uint32
	for g := 0; g < heads; g++ {
		a := make([]uint32, count)
		size := make([]uint32, c)
		for r := range a {
			a[r] = uint32(rng.Intn(c))
			if r < c {
				a[r] = uint32(r) // no cluster empty
			}
			size[a[r]]++
		}
		start := make([]uint32, c)
		for j := 1; j < c; j++ {
			start[j] = start[j-1] + size[j-1]
		}
		mem := make([]uint32, count)
		next := append([]uint32(nil), start...)
		for r, j := range a {
			mem[next[j]] = uint32(first + r)
			next[j]++
		}
		for i := 0; i < c*dim; i++ {
			cent = append(cent, float32(rng.NormFloat64()))
		}
		for j := 0; j < c; j++ {
			norms = append(norms, float32(rng.Float64()))
		}
		counts, starts = append(counts, size...), append(starts, start...)
		members, assign = append(members, mem...), append(assign, a...)
	}
	for _, err := range []error{x.Centroids.WriteFloat32(0, cent), x.Norms.WriteFloat32(0, norms), x.Counts.WriteUint32(0, counts),
		x.Starts.WriteUint32(0, starts), x.Members.WriteUint32(0, members), x.Assign.WriteUint32(0, assign)} {
		require.NoError(t, err)
	}
	return x
}

func TestClustersJoin(t *testing.T) {
	dev := vktest.Open(t)
	rng := rand.New(rand.NewSource(rand.Int63()))
	const heads, dim, first = 3, 16, 4
	a := randomClusters(t, dev, rng, heads, dim, 7, first, 61)
	defer a.Release()
	b := randomClusters(t, dev, rng, heads, dim, 5, first+61, 33)
	defer b.Release()

	j, err := a.Join(dev, b)
	require.NoError(t, err)
	defer j.Release()
	require.Equal(t, []int{12, first, 94}, []int{j.C, j.First, j.Count})
	for g := 0; g < heads; g++ {
		ha, err := a.Read(g)
		require.NoError(t, err)
		hb, err := b.Read(g)
		require.NoError(t, err)
		hj, err := j.Read(g)
		require.NoError(t, err)
		require.Equal(t, append(ha.Centroids, hb.Centroids...), hj.Centroids, "centroids of head %d", g)
		require.Equal(t, append(ha.Members, hb.Members...), hj.Members, "members of head %d", g)
		want := append([]int32(nil), ha.Assign...)
		for _, c := range hb.Assign {
			want = append(want, c+int32(a.C))
		}
		require.Equal(t, want, hj.Assign, "assignments of head %d", g)
	}
	// The norms ride along with the centroids.
	na, nb, nj := make([]float32, heads*a.C), make([]float32, heads*b.C), make([]float32, heads*j.C)
	require.NoError(t, a.Norms.ReadFloat32(0, na))
	require.NoError(t, b.Norms.ReadFloat32(0, nb))
	require.NoError(t, j.Norms.ReadFloat32(0, nj))
	for g := 0; g < heads; g++ {
		require.Equal(t, append(append([]float32(nil), na[g*a.C:(g+1)*a.C]...), nb[g*b.C:(g+1)*b.C]...), nj[g*j.C:(g+1)*j.C])
	}

	// Only an index that starts where the first ends joins it.
	c := randomClusters(t, dev, rng, heads, dim, 5, first+60, 33)
	defer c.Release()
	_, err = a.Join(dev, c)
	require.ErrorContains(t, err, "joining")
}
