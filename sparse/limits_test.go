package sparse

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/vk"
	"github.com/vksparse/vksparse/vk/vktest"
)

// TestLayerBeyondStorageRange builds a cache whose heads each fit the
// device's storage-buffer range but whose keys together do not (lavapipe:
// 128 MiB): dense attention binds it head by head and runs, clustering
// binds all its keys at once and must refuse it before dispatching.
func TestLayerBeyondStorageRange(t *testing.T) {
	dev := vktest.Open(t)
	info := dev.Info()
	h := Heads{Query: 2, KV: 2, Dim: 128}
	capacity := int(info.MaxStorageBufferRange / uint64(h.Dim*2))
	if total := uint64(h.KV*capacity*h.Dim) * 2; total > info.MaxAllocation || total > 1<<30 {
		t.Skipf("a cache of two heads of %d tokens (%d bytes) is beyond this device's allocation or this test's budget", capacity, total)
	}
	layer, err := kvcache.NewLayer(dev, h.KV, h.Dim, capacity)
	require.NoError(t, err)
	defer layer.Release()
	const n = 64
	kv := make([]uint16, h.KV*n*h.Dim)
	require.NoError(t, layer.Prefill(kv, kv, n))

	dense, err := NewDense(dev, h)
	require.NoError(t, err)
	defer dense.Release()
	plan, err := dense.Plan([]*kvcache.Layer{layer})
	require.NoError(t, err)
	defer plan.Release()
	_, err = plan.Attend(make([]float32, h.Query*h.Dim))
	require.NoError(t, err)

	km, err := NewKMeans(dev, h.KV, h.Dim)
	require.NoError(t, err)
	defer km.Release()
	_, err = km.Cluster(layer, 0, n, KMeansOptions{})
	require.ErrorIs(t, err, vk.ErrUnsupported)
	require.ErrorContains(t, err, "maxStorageBufferRange")
	t.Log(err)
}
