package sparse_test

import (
	"fmt"

	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/vk"
)

// Dense decode attention over a cache of 1000 tokens whose values are all
// 0.5: whatever the scores, every output element is 0.5.
func Example() {
	dev, err := vk.Open(vk.OptionsFromEnv())
	if err != nil {
		fmt.Println(err)
		return
	}
	defer dev.Release()
	heads := sparse.Heads{Query: 4, KV: 1, Dim: 64}
	const n = 1000
	cache, _ := kvcache.NewLayer(dev, heads.KV, heads.Dim, n)
	defer cache.Release()
	k, v := make([]float32, n*heads.Dim), make([]float32, n*heads.Dim)
	for i := range k {
		k[i], v[i] = float32(i%7)/7, 0.5
	}
	kh, _ := kvcache.ToHalves(k)
	vh, _ := kvcache.ToHalves(v)
	if err := cache.Prefill(kh, vh, n); err != nil {
		fmt.Println(err)
		return
	}
	dense, _ := sparse.NewDense(dev, heads)
	defer dense.Release()
	plan, _ := dense.Plan([]*kvcache.Layer{cache})
	defer plan.Release()
	q := make([]float32, heads.Query*heads.Dim)
	for i := range q {
		q[i] = float32(i%5) - 2
	}
	out, err := plan.Attend(q)
	fmt.Printf("%.3f %.3f %v\n", out[0], out[len(out)-1], err)
	// Output: 0.500 0.500 <nil>
}
