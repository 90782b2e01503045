package sparse

import (
	"fmt"
	"math"
)

// checkQuery reports why queries q for batch sequences of heads h must be
// refused: q holds [batch][Query][Dim] finite float32 values. It needs no
// device, so that bad input is refused before anything is written.
func checkQuery(q []float32, batch int, h Heads) error {
	if want := batch * h.Query * h.Dim; len(q) != want {
		return fmt.Errorf("sparse: query has %d values, want %d (batch %d × %d heads × %d)", len(q), want, batch, h.Query, h.Dim)
	}
	for i, x := range q {
		if math.IsNaN(float64(x)) || math.IsInf(float64(x), 0) {
			return fmt.Errorf("sparse: query value %d is %v", i, x)
		}
	}
	return nil
}

// resolve returns the options with the defaults in place of zero values,
// or why they cannot be used. It needs no device.
func (o TacticDecoderOptions) resolve() (TacticDecoderOptions, error) {
	if o.Sinks == 0 {
		o.Sinks = TacticDefaultSinks
	}
	if o.Recluster == 0 {
		o.Recluster = TacticDefaultRecluster
	}
	if o.Fit == (TacticFit{}) {
		o.Fit = DefaultTacticFit()
	}
	switch {
	case o.Sinks < 0 || o.Recluster < 0:
		return o, fmt.Errorf("sparse: TacticDecoderOptions: Sinks %d and Recluster %d must not be negative", o.Sinks, o.Recluster)
	case o.KMeans.AvgClusterSize < 0 || o.KMeans.MaxIter < 0:
		return o, fmt.Errorf("sparse: TacticDecoderOptions: KMeans.AvgClusterSize %d and KMeans.MaxIter %d must not be negative", o.KMeans.AvgClusterSize, o.KMeans.MaxIter)
	}
	if err := o.Fit.validate(); err != nil {
		return o, err
	}
	return o, nil
}
