package sparse

import "github.com/vksparse/vksparse/vk"

// Output returns the buffer the step's output lands in, float32 [Hq][D].
// SetClusters replaces it: ask again after moving the step onto a new
// index.
func (t *TacticStep) Output() *vk.Buffer { return t.plan.Output() }

// Resolve returns the options with the defaults in place of zero values,
// as NewTacticDecoder uses them, or why they cannot be used. It needs no
// device.
func (o TacticDecoderOptions) Resolve() (TacticDecoderOptions, error) { return o.resolve() }

// Validate reports why the fit parameters cannot be used, or nil: every
// fraction in [0, 1] and MaxWindow ≥ 0. It needs no device.
func (f TacticFit) Validate() error { return f.validate() }
