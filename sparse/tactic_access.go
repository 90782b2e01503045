package sparse

// Resolve returns the options with the defaults in place of zero values,
// as NewTacticDecoder uses them, or why they cannot be used. It needs no
// device.
func (o TacticDecoderOptions) Resolve() (TacticDecoderOptions, error) { return o.resolve() }

// Validate reports why the fit parameters cannot be used, or nil: every
// fraction in [0, 1] and MaxWindow ≥ 0. It needs no device.
func (f TacticFit) Validate() error { return f.validate() }
