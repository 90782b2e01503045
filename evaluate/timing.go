package evaluate

import (
	"time"

	"github.com/vksparse/vksparse/sparse"
	"github.com/vksparse/vksparse/vk"
)

// timed is what GPU timestamps time: a step, a batch of steps, a dense plan.
type timed interface {
	Time(warmup, reps int) ([]time.Duration, error)
}

// warmUp runs x for about d, so that the GPU's clocks have risen before it
// is timed.
func warmUp(x timed, d time.Duration) error {
	for spin := time.Now(); time.Since(spin) < d; {
		if _, err := x.Time(0, 20); err != nil {
			return err
		}
	}
	return nil
}

// medianMicros returns the median in µs of reps timed runs of x, after 10
// untimed ones.
func medianMicros(x timed, reps int) (float64, error) {
	times, err := x.Time(10, reps)
	if err != nil {
		return 0, err
	}
	return micros(times[len(times)/2]), nil
}

// stagesTimed is what timestamps time stage by stage: a step, a batch.
type stagesTimed interface {
	TimeStages(warmup, reps int) ([]time.Duration, time.Duration, error)
	Stages() []string
}

// stageMicros returns the median in µs of each stage of reps timed runs of
// step (after 10 untimed ones), by stage name.
func stageMicros(step stagesTimed, reps int) (map[string]float64, error) {
	stages, _, err := step.TimeStages(10, reps)
	if err != nil {
		return nil, err
	}
	out := map[string]float64{}
	for i, s := range step.Stages() {
		out[s] = micros(stages[i])
	}
	return out, nil
}

func micros(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }

// timeStages warms a step (or batch) up, then the GPU's clocks
// (sparse.WarmUp: a step whose runs leave the GPU mostly idle between
// submissions does not raise them, and one timed after a long host gap ran
// at a third of their speed), and fills r's per-stage medians, its
// dependent dispatches and its whole median, each over reps timed runs.
func timeStages[T interface {
	timed
	stagesTimed
}](dev *vk.Device, r *StepRun, step T, reps int) error {
	if err := warmUp(step, 300*time.Millisecond); err != nil {
		return err
	}
	if err := sparse.WarmUp(dev, 300*time.Millisecond); err != nil {
		return err
	}
	var err error
	if r.StageUs, err = stageMicros(step, reps); err != nil {
		return err
	}
	r.Dispatches = len(r.StageUs)
	r.StepUs, err = medianMicros(step, reps)
	return err
}
