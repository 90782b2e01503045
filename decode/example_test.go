package decode_test

import (
	"errors"
	"fmt"
	"math"

	"github.com/vksparse/vksparse/decode"
	"github.com/vksparse/vksparse/kvcache"
	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/vk"
)

// A decode loop over two layers and two sequences, layer 0 dense and
// layer 1 with Tactic at P = 0.9: each sequence's layers are prefilled,
// then every step appends each sequence's new token to a layer and
// attends that layer's queries for both sequences in one batch. Every 64
// appended tokens of the Tactic layer are clustered and join its index. The values are all 0.5, so every output
// element is 0.5 whatever tokens a step selects. Sequence 0 then ends and
// its slot takes a new one.
func ExampleModel() {
	dev, err := vk.Open(vk.OptionsFromEnv())
	if err != nil {
		fmt.Println(err)
		return
	}
	defer dev.Release()
	heads := sparse.Heads{Query: 8, KV: 2, Dim: 64}
	const layers, slots = 2, 2
	model, err := decode.New(dev, decode.Config{
		Heads: heads, Layers: layers, Slots: slots, Capacity: 1100,
		// A policy per layer: dense first, Tactic after (Config.Policy
		// gives every layer the same one).
		Layout: []decode.Policy{
			decode.Dense(),
			decode.Tactic(0.9, sparse.TacticDecoderOptions{Recluster: 64}),
		},
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer model.Release()

	// kv returns tokens [from, to) of a sequence's layer, [KV][to−from][Dim]
	// fp16: in an app, what the model's key and value projections wrote.
	kv := func(seq, layer, from, to int) (k, v []uint16) {
		var kf, vf []float32
		for g := 0; g < heads.KV; g++ {
			for t := from; t < to; t++ {
				for d := 0; d < heads.Dim; d++ {
					kf = append(kf, float32((t*31+d*7+g*5+layer*3+seq)%13)/13-0.5)
					vf = append(vf, 0.5)
				}
			}
		}
		k, _ = kvcache.ToHalves(kf)
		v, _ = kvcache.ToHalves(vf)
		return k, v
	}
	prefill := func(slot, seq, n int) error {
		for l := 0; l < layers; l++ {
			k, v := kv(seq, l, 0, n)
			if err := model.Prefill(slot, l, k, v, n); err != nil {
				return err
			}
		}
		return nil
	}
	// step appends one token to every active sequence and attends its
	// queries, layer by layer; it reports whether every output was 0.5.
	step := func(seqOf []int) (bool, error) {
		ok := true
		for l := 0; l < layers; l++ {
			var q []float32 // [B][Hq][Dim], the active slots in order
			for _, s := range model.Active() {
				n := model.Len(s, l)
				k, v := kv(seqOf[s], l, n, n+1)
				if err := model.Append(s, l, k, v); err != nil {
					return false, err
				}
				for i := 0; i < heads.Query*heads.Dim; i++ {
					q = append(q, float32((i+n)%5)-2)
				}
			}
			out, err := model.Attend(l, q) // [B][Hq][Dim]
			if err != nil {
				return false, err
			}
			for _, x := range out {
				ok = ok && math.Abs(float64(x)-0.5) < 1e-3
			}
		}
		return ok, nil
	}

	seqOf := []int{0, 1} // the sequence each slot holds
	if err := errors.Join(prefill(0, 0, 1000), prefill(1, 1, 600)); err != nil {
		fmt.Println(err)
		return
	}
	for i := 0; i < 70; i++ {
		if ok, err := step(seqOf); !ok || err != nil {
			fmt.Println(ok, err)
			return
		}
	}
	fmt.Println("active", model.Active(), "lengths", model.Len(0, 0), model.Len(1, 1))

	// Sequence 0 ends; sequence 2 takes its slot.
	seqOf[0] = 2
	if err := errors.Join(model.Free(0), prefill(0, 2, 300)); err != nil {
		fmt.Println(err)
		return
	}
	ok, err := step(seqOf)
	fmt.Println("active", model.Active(), "lengths", model.Len(0, 0), model.Len(1, 1), "outputs 0.5:", ok, err)
	// Output:
	// active [0 1] lengths 1070 670
	// active [0 1] lengths 301 671 outputs 0.5: true <nil>
}
