package main

import (
	"math"

	"github.com/x448/float16"
)

// halfSource is a fast deterministic generator of benchmark data.
type halfSource struct{ state uint64 }

func newHalfSource(seed uint64) *halfSource { return &halfSource{state: seed*0x9E3779B97F4A7C15 + 1} }

func (s *halfSource) next() uint64 {
	s.state += 0x9E3779B97F4A7C15
	z := s.state
	z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
	z = (z ^ (z >> 27)) * 0x94D049BB133111EB
	return z ^ (z >> 31)
}

// uniform returns a value in [-1, 1).
func (s *halfSource) uniform() float64 { return float64(s.next()>>11)/(1<<52) - 1 }

// normal returns a standard normal value (Box–Muller).
func (s *halfSource) normal() float64 {
	u := (float64(s.next()>>11) + 0.5) / (1 << 53)
	return math.Sqrt(-2*math.Log(u)) * math.Cos(2*math.Pi*s.uniform())
}

// halves returns n fp16 values spread over [-1.7, 1.7].
func (s *halfSource) halves(n int) []uint16 {
	var table [4096]uint16
	for i := range table {
		table[i] = uint16(float16.Fromfloat32(float32(1.7 * s.uniform())))
	}
	out := make([]uint16, n)
	for i := 0; i < n; i += 4 {
		r := s.next()
		for j := 0; j < 4 && i+j < n; j++ {
			out[i+j] = table[(r>>(16*j))&4095]
		}
	}
	return out
}
