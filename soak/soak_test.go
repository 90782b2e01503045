package soak

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/vksparse/vksparse/vk/vktest"
)

// ciSteps is the short soak's length: under a few minutes on a software
// renderer.
const ciSteps = 300

// TestSoak runs the short seeded soak: every check passes, every kind of
// operation ran, reclustering boundaries were crossed, and the device's
// memory returned to the warm-up's after each drain and to nothing after
// release.
func TestSoak(t *testing.T) {
	dev := vktest.Open(t)
	rep, err := Run(dev, DefaultConfig(ciSteps, 39), nil)
	b, _ := json.MarshalIndent(rep, "", "  ")
	t.Logf("%s", b)
	require.NoError(t, err)
	require.Equal(t, ciSteps, rep.Steps)
	for _, op := range []string{"prefill", "append", "attend", "free", "drain"} {
		require.Positive(t, rep.Operations[op], "operations of kind %s", op)
	}
	require.Positive(t, rep.Reclusters)
	require.Equal(t, ciSteps/DefaultConfig(0, 0).CheckEvery+1, rep.Checks) // the warm-up's, then every CheckEvery
	require.Zero(t, rep.ReleasedBytes)
	require.Equal(t, rep.WarmBytes, rep.FinalBytes)
	require.GreaterOrEqual(t, rep.PeakBytes, rep.WarmBytes)
	for _, p := range rep.Policies {
		require.Positive(t, p.Heads, p.Name)
		require.Less(t, p.WorstShare, 1.0, p.Name)
	}
}

// TestSoakFailsOnDrift makes the float64 model disagree with what the
// models were given, in a stored key and in a value, and requires the
// next check to fail.
func TestSoakFailsOnDrift(t *testing.T) {
	dev := vktest.Open(t)
	for name, tamper := range map[string]func(ls *layerState){
		"key bit": func(ls *layerState) { ls.k[0][3] ^= 1 },
		"value":   func(ls *layerState) { ls.vf[1][5] += 0.5 },
	} {
		t.Run(name, func(t *testing.T) {
			cfg := DefaultConfig(40, 7)
			// One model of the first four policies (none takes a budget
			// from the capacity), small enough to warm up fast.
			cfg.Slots, cfg.Capacity, cfg.MaxPrefill, cfg.Policies, cfg.CheckEvery = 4, 128, 100, cfg.Policies[:4], 10
			done := false
			// The check that follows the step sees the change.
			cfg.tamper = func(step int, s *state) {
				if act := s.active(); !done && step >= 20 && (step+1)%cfg.CheckEvery == 0 && len(act) > 0 {
					tamper(s.slots[act[0]][0])
					done = true
				}
			}
			_, err := Run(dev, cfg, nil)
			require.True(t, done)
			require.ErrorIs(t, err, ErrCheck)
			t.Log(err)
		})
	}
}
