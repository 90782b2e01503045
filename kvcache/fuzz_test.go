package kvcache

import (
	"encoding/binary"
	"slices"
	"testing"

	"github.com/x448/float16"

	"github.com/vksparse/vksparse/vk/vktest"
)

// halvesOf reads little-endian fp16 bit patterns from b (a trailing odd
// byte is dropped).
func halvesOf(b []byte) []uint16 {
	out := make([]uint16, len(b)/2)
	for i := range out {
		out[i] = binary.LittleEndian.Uint16(b[2*i:])
	}
	return out
}

func bytesOfHalves(h []uint16) []byte {
	var b []byte
	for _, x := range h {
		b = binary.LittleEndian.AppendUint16(b, x)
	}
	return b
}

func finite(h []uint16) bool {
	for _, x := range h {
		if f := float16.Frombits(x); f.IsNaN() || f.IsInf(0) {
			return false
		}
	}
	return true
}

// splitKV cuts the fuzzer's bytes into keys and values at cut.
func splitKV(data []byte, cut uint16) (k, v []uint16) {
	h := halvesOf(data)
	c := int(cut) % (len(h) + 1)
	return h[:c], h[c:]
}

// FuzzInputChecks checks the device-free validation of Prefill and Append
// against the rules stated in their docs: any shape, length and fp16 bit
// pattern either passes all of them or is refused, without a panic.
func FuzzInputChecks(f *testing.F) {
	one := bytesOfHalves([]uint16{0x3c00, 0xc100, 0x0001, 0x8000}) // 1, -2.5, a subnormal, -0
	f.Add(uint8(1), uint8(2), uint8(4), 2, 0, uint16(4), one)      // a valid prefill of 2 tokens
	f.Add(uint8(1), uint8(2), uint8(4), 0, 3, uint16(2), one)      // a valid append
	f.Add(uint8(2), uint8(8), uint8(3), 4, 3, uint16(0), one)      // over capacity, append on a full cache
	f.Add(uint8(1), uint8(1), uint8(1), 0, 0, uint16(0), []byte{}) // zero tokens
	f.Add(uint8(1), uint8(1), uint8(1), -5, -1, uint16(1), []byte{0, 0x7e, 0, 0x3c})
	f.Add(uint8(1), uint8(1), uint8(2), 1, 0, uint16(1), []byte{0, 0x7c, 0, 0xfc}) // ±Inf
	f.Add(uint8(1), uint8(2), uint8(4), 1, 0, uint16(3), one)                      // keys and values of different lengths
	f.Fuzz(func(t *testing.T, heads, dim, capacity uint8, n, stored int, cut uint16, data []byte) {
		kvHeads, headDim, capTokens := int(heads%8)+1, int(dim%16)+1, int(capacity)+1
		k, v := splitKV(data, cut)

		ok := n > 0 && n <= capTokens && len(k) == kvHeads*n*headDim && len(v) == len(k) && finite(k) && finite(v)
		if err := checkPrefill(kvHeads, headDim, capTokens, k, v, n); (err == nil) != ok {
			t.Fatalf("checkPrefill(%d heads, dim %d, capacity %d, %d keys, %d values, n %d) = %v, want ok %v", kvHeads, headDim, capTokens, len(k), len(v), n, err, ok)
		}
		ok = len(k) == kvHeads*headDim && len(v) == len(k) && stored < capTokens && finite(k) && finite(v)
		if err := checkAppend(kvHeads, headDim, capTokens, stored, k, v); (err == nil) != ok {
			t.Fatalf("checkAppend(%d heads, dim %d, capacity %d, stored %d, %d keys, %d values) = %v, want ok %v", kvHeads, headDim, capTokens, stored, len(k), len(v), err, ok)
		}
	})
}

// FuzzLayer drives one small cache on the device with arbitrary Prefill,
// Append and Truncate calls and checks, after each, that its length and
// contents are what the accepted calls made them: a refused call changes
// nothing.
func FuzzLayer(f *testing.F) {
	const heads, dim, capacity = 2, 8, 5
	valid := make([]uint16, 2*heads*(capacity+1)*dim)
	for i := range valid {
		valid[i] = uint16(float16.Fromfloat32(float32(i%13) - 6))
	}
	row := bytesOfHalves(valid[:2*heads*dim])
	f.Add(uint8(0), 3, uint16(heads*3*dim), bytesOfHalves(valid[:2*heads*3*dim]))     // prefill 3 tokens
	f.Add(uint8(0), capacity+1, uint16(heads*(capacity+1)*dim), bytesOfHalves(valid)) // over capacity
	f.Add(uint8(0), 0, uint16(0), []byte{})                                           // zero tokens
	f.Add(uint8(1), 0, uint16(heads*dim), row)                                        // append one token
	f.Add(uint8(1), 0, uint16(3), row)                                                // append with a short k
	nan := slices.Clone(row)
	nan[1] = 0x7e
	f.Add(uint8(1), 0, uint16(heads*dim), nan) // NaN key
	inf := slices.Clone(row)
	inf[len(inf)-1] = 0xfc
	f.Add(uint8(1), 0, uint16(heads*dim), inf) // −Inf value
	f.Add(uint8(2), 1, uint16(0), []byte{})    // truncate
	f.Add(uint8(2), -1, uint16(0), []byte{})   // truncate below zero

	dev := vktest.Open(f)
	l, err := NewLayer(dev, heads, dim, capacity)
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { l.Release() })
	// wantK[h] and wantV[h] hold head h's stored rows, as the accepted
	// calls wrote them.
	wantK, wantV := make([][]uint16, heads), make([][]uint16, heads)
	f.Fuzz(func(t *testing.T, op uint8, n int, cut uint16, data []byte) {
		k, v := splitKV(data, cut)
		var err error
		switch op % 3 {
		case 0:
			if err = l.Prefill(k, v, n); err == nil {
				for h := 0; h < heads; h++ {
					wantK[h] = slices.Clone(k[h*n*dim : (h+1)*n*dim])
					wantV[h] = slices.Clone(v[h*n*dim : (h+1)*n*dim])
				}
			}
		case 1:
			if err = l.Append(k, v); err == nil {
				for h := 0; h < heads; h++ {
					wantK[h] = append(wantK[h], k[h*dim:(h+1)*dim]...)
					wantV[h] = append(wantV[h], v[h*dim:(h+1)*dim]...)
				}
			}
		case 2:
			if err = l.Truncate(n); err == nil {
				for h := 0; h < heads; h++ {
					wantK[h], wantV[h] = wantK[h][:n*dim], wantV[h][:n*dim]
				}
			}
		}
		if l.Len()*dim != len(wantK[0]) {
			t.Fatalf("op %d (error %v): the cache holds %d tokens, want %d", op%3, err, l.Len(), len(wantK[0])/dim)
		}
		gotK, gotV, rerr := l.Read()
		if rerr != nil {
			t.Fatal(rerr)
		}
		rows := l.Len() * dim
		for h := 0; h < heads; h++ {
			if !slices.Equal(gotK[h*rows:(h+1)*rows], wantK[h]) || !slices.Equal(gotV[h*rows:(h+1)*rows], wantV[h]) {
				t.Fatalf("op %d (error %v): head %d's keys or values differ from what the accepted calls stored", op%3, err, h)
			}
		}
	})
}
