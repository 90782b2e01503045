package main

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestParseSkeleton(t *testing.T) {
	cases, err := parseSkeleton(" a=4.2,7.7 ; 16.8 ;b = 1")
	require.NoError(t, err)
	assert.Equal(t, []skeletonCase{
		{Name: "a", Stage: []float64{4.2, 7.7}},
		{Name: "1", Stage: []float64{16.8}},
		{Name: "b", Stage: []float64{1}},
	}, cases)
	for _, bad := range []string{"", ";", "a=", "a=1,x", "a=0", "a=-2,1", "a=NaN", "a=Inf", "a=1e9"} {
		_, err := parseSkeleton(bad)
		assert.Error(t, err, "spec %q", bad)
	}
}
