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

// Tactic decoding on a growing cache: the keys after the sinks are
// clustered at the start, and every 128 appended tokens are clustered and
// join the index. The values are all 0.5, so every output element is 0.5
// whatever tokens a step selects.
func ExampleTacticDecoder() {
	dev, err := vk.Open(vk.OptionsFromEnv())
	if err != nil {
		fmt.Println(err)
		return
	}
	defer dev.Release()
	heads := sparse.Heads{Query: 4, KV: 1, Dim: 64}
	const prefill, capacity = 1000, 1200
	cache, _ := kvcache.NewLayer(dev, heads.KV, heads.Dim, capacity)
	defer cache.Release()
	token := func(t int) (k, v []uint16) { // one token's key and value
		kf, vf := make([]float32, heads.Dim), make([]float32, heads.Dim)
		for d := range kf {
			kf[d], vf[d] = float32((t*31+d*7)%13)/13-0.5, 0.5
		}
		k, _ = kvcache.ToHalves(kf)
		v, _ = kvcache.ToHalves(vf)
		return k, v
	}
	var kh, vh []uint16
	for t := 0; t < prefill; t++ {
		k, v := token(t)
		kh, vh = append(kh, k...), append(vh, v...)
	}
	if err := cache.Prefill(kh, vh, prefill); err != nil {
		fmt.Println(err)
		return
	}
	dense, _ := sparse.NewDense(dev, heads)
	defer dense.Release()
	km, _ := sparse.NewKMeans(dev, heads.KV, heads.Dim)
	defer km.Release()
	dec, err := sparse.NewTacticDecoder(dense, km, cache, 0.9, sparse.TacticDecoderOptions{Recluster: 128})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer dec.Release()
	for t := prefill; t < prefill+150; t++ {
		if err := dec.Append(token(t)); err != nil {
			fmt.Println(err)
			return
		}
	}
	q := make([]float32, heads.Query*heads.Dim)
	for i := range q {
		q[i] = float32(i%5) - 2
	}
	out, err := dec.Attend(q)
	fmt.Printf("clustered %d, tail %d: %.3f %.3f %v\n", dec.Clusters().Count, dec.Tail(), out[0], out[len(out)-1], err)
	// Output: clustered 1124, tail 22: 0.500 0.500 <nil>
}

// Double-P over a clustered cache (every policy's step works alike: a
// Selector, then attention over what it selects). The values are all 0.5,
// so every output element is 0.5 whatever the step attends, exactly or
// through the clusters' mean values.
func ExampleNewDoublePStep() {
	dev, err := vk.Open(vk.OptionsFromEnv())
	if err != nil {
		fmt.Println(err)
		return
	}
	defer dev.Release()
	heads := sparse.Heads{Query: 4, KV: 1, Dim: 64}
	const n, sinks, recent = 2000, 4, 64
	layer, _ := kvcache.NewLayer(dev, heads.KV, heads.Dim, n)
	defer layer.Release()
	k, v := make([]float32, n*heads.Dim), make([]float32, n*heads.Dim)
	for i := range k {
		k[i], v[i] = float32((i*7919)%13)/13-0.5, 0.5
	}
	kh, _ := kvcache.ToHalves(k)
	vh, _ := kvcache.ToHalves(v)
	if err := layer.Prefill(kh, vh, n); err != nil {
		fmt.Println(err)
		return
	}
	km, _ := sparse.NewKMeans(dev, heads.KV, heads.Dim)
	defer km.Release()
	clusters, err := km.Cluster(layer, sinks, n-sinks-recent, sparse.KMeansOptions{Span: sparse.KMeansDefaultSpan})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer clusters.Release()
	if err := layer.Reorder(clusters); err != nil { // each cluster a run of slots
		fmt.Println(err)
		return
	}
	dense, _ := sparse.NewDense(dev, heads)
	defer dense.Release()
	step, err := sparse.NewDoublePStep(dense, layer, clusters, sparse.DefaultDoubleP())
	if err != nil {
		fmt.Println(err)
		return
	}
	defer step.Release()
	q := make([]float32, heads.Query*heads.Dim)
	for i := range q {
		q[i] = float32(i%5) - 2
	}
	out, err := step.Attend(q)
	fmt.Printf("%v %.3f %.3f %v\n", step.Stages(), out[0], out[len(out)-1], err)
	// Output: [score cut attend] 0.500 0.500 <nil>
}
