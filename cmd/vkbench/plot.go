package main

import (
	"fmt"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"

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
	return savePanels(path, []*plot.Plot{speed, tokens}, 12*vg.Inch, 5*vg.Inch)
}

// savePanels draws plots side by side, their axes aligned, into a PNG
// file of the given size.
func savePanels(path string, panels []*plot.Plot, width, height vg.Length) error {
	img := vgimg.New(width, height)
	drawPanels(draw.New(img), panels)
	return savePNG(path, img)
}

// drawPanels draws plots side by side on c, their axes aligned.
func drawPanels(c draw.Canvas, panels []*plot.Plot) {
	canvases := plot.Align([][]*plot.Plot{panels}, draw.Tiles{Rows: 1, Cols: len(panels), PadX: vg.Inch / 4}, c)
	for i, p := range panels {
		p.Draw(canvases[0][i])
	}
}

// savePNG writes img to a PNG file.
func savePNG(path string, img *vgimg.Canvas) error {
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

// plotCompare draws, for each layer of the fidelity comparison, the mass
// every policy reaches against the tokens it attends exactly (% of N, on a
// log scale): one curve per policy and budget source, a point per P. The
// panels share one legend, on their right.
func plotCompare(path string, fids []compareFidelity) error {
	var panels []*plot.Plot
	var legend plot.Legend
	for i, f := range fids {
		p := plot.New()
		p.Title.Text = fmt.Sprintf("%s, N = %d", f.Source, f.Tokens)
		p.X.Label.Text, p.Y.Label.Text = "tokens attended exactly (% of N)", "attention mass reached"
		p.X.Scale, p.X.Tick.Marker = plot.LogScale{}, plot.TickerFunc(logTicks125)
		var series []any
		for _, c := range fidelityCurves(f.Comparison) {
			xy := make(plotter.XYs, len(c.Points))
			for i, pt := range c.Points {
				xy[i] = plotter.XY{X: pt.TokensPct, Y: pt.Mass}
			}
			series = append(series, c.Name, xy)
		}
		if err := plotutil.AddLinePoints(p, series...); err != nil {
			return err
		}
		if i == 0 {
			legend = p.Legend
			legend.Top, legend.Left = true, true
		}
		p.Legend = plot.NewLegend()
		panels = append(panels, p)
	}
	if len(panels) == 0 {
		return fmt.Errorf("plot: no fidelity comparison to draw")
	}
	legendWidth := 2.5 * vg.Inch
	img := vgimg.New(vg.Length(len(panels))*6*vg.Inch+legendWidth, 5*vg.Inch)
	c := draw.New(img)
	drawPanels(draw.Crop(c, 0, -legendWidth, 0, 0), panels)
	legend.Draw(draw.Crop(c, c.Max.X-c.Min.X-legendWidth+vg.Inch/4, 0, 0, -vg.Inch/2))
	return savePNG(path, img)
}

// logTicks125 places ticks for a log axis over [min, max] (min > 0): a
// label at 1, 2 and 5 times each power of ten, unlabelled ticks at the
// other integers times it.
func logTicks125(min, max float64) []plot.Tick {
	var ticks []plot.Tick
	for e := math.Floor(math.Log10(min)); math.Pow(10, e) <= max; e++ {
		base := math.Pow(10, e)
		for m := 1; m <= 9; m++ {
			v := float64(m) * base
			if v < min || v > max {
				continue
			}
			t := plot.Tick{Value: v}
			if m == 1 || m == 2 || m == 5 {
				t.Label = strconv.FormatFloat(v, 'g', -1, 64)
			}
			ticks = append(ticks, t)
		}
	}
	return ticks
}

// plotPolicySteps draws, per policy, its step's speed-up over dense
// attention and its step over its skeleton as bars, one bar per source,
// N and batch (a missing figure leaves its bar out), with a line at 1×.
func plotPolicySteps(path string, rows []compareRow) error {
	if len(rows) == 0 {
		return fmt.Errorf("plot: no steps to draw")
	}
	var policies, groups []string
	for _, r := range rows {
		if !slices.Contains(policies, r.Policy) {
			policies = append(policies, r.Policy)
		}
		if g := stepGroup(r); !slices.Contains(groups, g) {
			groups = append(groups, g)
		}
	}
	panel := func(title, label string, value func(r compareRow) float64) (*plot.Plot, error) {
		p := plot.New()
		p.Title.Text, p.Y.Label.Text = title, label
		p.NominalX(policies...)
		p.X.Tick.Label.Rotation, p.X.Tick.Label.XAlign, p.X.Tick.Label.YAlign = math.Pi/6, draw.XRight, draw.YCenter
		p.Legend.Top = true
		// About 440 points of a panel's width hold the policies' bars.
		width := vg.Points(min(14, 0.8*440/float64(len(policies)*len(groups))))
		most := 1.0
		for gi, g := range groups {
			vals := make(plotter.Values, len(policies))
			for _, r := range rows {
				if stepGroup(r) == g {
					vals[slices.Index(policies, r.Policy)] = value(r)
					most = max(most, value(r))
				}
			}
			bars, err := plotter.NewBarChart(vals, width)
			if err != nil {
				return nil, err
			}
			bars.Offset = width * vg.Length(float64(gi)-float64(len(groups)-1)/2)
			bars.LineStyle.Width = 0
			bars.Color = plotutil.Color(gi)
			p.Add(bars)
			p.Legend.Add(g, bars)
		}
		one := plotter.NewFunction(func(float64) float64 { return 1 })
		one.Dashes = []vg.Length{vg.Points(4), vg.Points(4)}
		p.Add(one)
		// Headroom above the tallest bar keeps the legend, one line a
		// group at the top, off the bars.
		p.Y.Min, p.Y.Max = 0, most*(1.1+0.07*float64(len(groups)))
		return p, nil
	}
	speed, err := panel("step vs dense attention", "speed-up (×)", func(r compareRow) float64 { return r.Speedup })
	if err != nil {
		return err
	}
	over, err := panel("step vs its skeleton", "step / skeleton (×)", func(r compareRow) float64 {
		if r.Skeleton == nil {
			return 0
		}
		return r.Skeleton.StepOver
	})
	if err != nil {
		return err
	}
	return savePanels(path, []*plot.Plot{speed, over}, 14*vg.Inch, 6*vg.Inch)
}

// stepGroup names a row's bar: its source, N (where the source does not
// name it) and batch.
func stepGroup(r compareRow) string {
	if strings.Contains(r.Source, fmt.Sprintf("n=%d", r.Tokens)) {
		return fmt.Sprintf("%s, batch %d", r.Source, r.Batch)
	}
	return fmt.Sprintf("%s, N = %d, batch %d", r.Source, r.Tokens, r.Batch)
}
