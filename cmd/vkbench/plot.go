package main

import (
	"fmt"
	"os"
	"slices"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// plotTactic draws the tokens selected and the mass reached as fractions:
// against P when the results hold one layer, otherwise against N (one
// curve of each per P).
func plotTactic(path string, results []tacticResult) error {
	p := plot.New()
	p.Y.Label.Text = "fraction"
	// Headroom above 1 keeps the legend off the curves.
	p.Y.Min, p.Y.Max = 0, 1.35
	var ticks []plot.Tick
	for i := 0; i <= 10; i++ {
		t := plot.Tick{Value: float64(i) / 10}
		if i%2 == 0 {
			t.Label = fmt.Sprint(t.Value)
		}
		ticks = append(ticks, t)
	}
	p.Y.Tick.Marker = plot.ConstantTicks(ticks)
	p.Legend.Top, p.Legend.Left = true, true
	var series []any
	layers := map[string]bool{}
	for _, r := range results {
		layers[fmt.Sprint(r.Source, r.Tokens)] = true
	}
	if len(layers) == 1 {
		r0 := results[0]
		p.Title.Text = fmt.Sprintf("Tactic on %s, N = %d", r0.Source, r0.Tokens)
		p.X.Label.Text = "target mass P"
		curve := func(f func(r tacticResult) float64) plotter.XYs {
			var xy plotter.XYs
			for _, r := range results {
				xy = append(xy, plotter.XY{X: r.P, Y: f(r)})
			}
			return xy
		}
		series = append(series,
			"selected / N", curve(func(r tacticResult) float64 { return r.Selected / r.Attended }),
			"union / N", curve(func(r tacticResult) float64 { return r.Union / r.Attended }),
			"cluster-optimal / N", curve(func(r tacticResult) float64 { return r.ClusterOptimal / r.Attended }),
			"mass reached", curve(func(r tacticResult) float64 { return r.Mass }),
			"target P", curve(func(r tacticResult) float64 { return r.P }))
	} else {
		p.Title.Text = fmt.Sprintf("Tactic on %s", results[0].Source)
		p.X.Label.Text = "context length N"
		var ps []float64
		var nTicks []plot.Tick
		for _, r := range results {
			if !slices.Contains(ps, r.P) {
				ps = append(ps, r.P)
			}
			if t := (plot.Tick{Value: float64(r.Tokens), Label: fmt.Sprint(r.Tokens)}); !slices.Contains(nTicks, t) {
				nTicks = append(nTicks, t)
			}
		}
		p.X.Scale, p.X.Tick.Marker = plot.LogScale{}, plot.ConstantTicks(nTicks)
		for _, pv := range ps {
			var sel, mass plotter.XYs
			for _, r := range results {
				if r.P == pv {
					sel = append(sel, plotter.XY{X: float64(r.Tokens), Y: r.Selected / r.Attended})
					mass = append(mass, plotter.XY{X: float64(r.Tokens), Y: r.Mass})
				}
			}
			series = append(series, fmt.Sprintf("selected / N, P=%g", pv), sel, fmt.Sprintf("mass, P=%g", pv), mass)
		}
	}
	if err := plotutil.AddLinePoints(p, series...); err != nil {
		return err
	}
	return p.Save(7*vg.Inch, 5*vg.Inch, path)
}

// plotSteps draws, per P, the speed-up of Tactic's GPU step over dense
// attention and the tokens a head selects (% of N) against N.
func plotSteps(path string, rows []stepRow) error {
	speed, tokens := plot.New(), plot.New()
	speed.Title.Text, speed.X.Label.Text, speed.Y.Label.Text = "Tactic step vs dense attention", "context length N", "speed-up (×)"
	tokens.Title.Text, tokens.X.Label.Text, tokens.Y.Label.Text = "tokens selected", "context length N", "% of N"
	var ps []float64
	for _, r := range rows {
		if !slices.Contains(ps, r.P) {
			ps = append(ps, r.P)
		}
	}
	var sp, tk []any
	for _, pv := range ps {
		var a, b plotter.XYs
		for _, r := range rows {
			if r.P == pv {
				a = append(a, plotter.XY{X: float64(r.Tokens), Y: r.Speedup})
				b = append(b, plotter.XY{X: float64(r.Tokens), Y: r.SelectedPct})
			}
		}
		sp = append(sp, fmt.Sprintf("P=%g", pv), a)
		tk = append(tk, fmt.Sprintf("P=%g", pv), b)
	}
	if err := plotutil.AddLinePoints(speed, sp...); err != nil {
		return err
	}
	if err := plotutil.AddLinePoints(tokens, tk...); err != nil {
		return err
	}
	img := vgimg.New(12*vg.Inch, 5*vg.Inch)
	canvases := plot.Align([][]*plot.Plot{{speed, tokens}}, draw.Tiles{Rows: 1, Cols: 2, PadX: vg.Inch / 4}, draw.New(img))
	speed.Draw(canvases[0][0])
	tokens.Draw(canvases[0][1])
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
