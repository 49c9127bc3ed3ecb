package main

import (
	"fmt"
	"image/color"
	"math"
	"path/filepath"
	"strconv"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
)

// writePlots draws admitted requests per second, stacked by process,
// against the limit (single-key scenarios) and the offered load, with
// fault windows shaded, as PNG and SVG in dir.
func (r *recorder) writePlots(dir string) ([]string, error) {
	p := plot.New()
	p.Title.Text = r.sc.Name + ": admitted per second, stacked by process"
	if len(r.regions) > 0 {
		p.Title.Text = r.sc.Name + ": admitted per second, stacked by region"
	}
	p.X.Label.Text = "virtual seconds"
	p.Y.Label.Text = "requests per second"
	top := r.plotTop()
	r.logY = top > 20*r.maxAdmittedPerSecond()
	if r.logY {
		// Offered load far above what is admitted (a flood): on a linear
		// axis the admitted band would be a sliver.
		p.Y.Scale = plot.LogScale{}
		p.Y.Tick.Marker = plot.LogTicks{Prec: -1}
		p.Y.Label.Text = "requests per second (log scale)"
	} else {
		p.Y.Tick.Marker = wholeTicks{}
	}
	if lim := r.limitS; len(lim) > 0 && (r.singleKey || r.logY) {
		// The limit is labelled on the axis, where a reader looks for it.
		p.Y.Tick.Marker = limitTicks{Ticker: p.Y.Tick.Marker, limits: lim}
	}
	// Fault windows first, so the data is drawn over them.
	steps := []func(*plot.Plot, float64) error{r.plotFaults, r.plotStacked, r.plotOffered, r.plotLimit}
	for _, step := range steps {
		if err := step(p, top); err != nil {
			return nil, err
		}
	}
	p.Legend.Top = true
	p.Legend.Left = true
	p.Y.Min, p.Y.Max = r.yFloor(), top*1.1
	p.X.Min, p.X.Max = 0, float64(len(r.perSecond))
	p.Add(plotter.NewGrid())
	var files []string
	for _, ext := range []string{"png", "svg"} {
		f := filepath.Join(dir, fmt.Sprintf("%s.%s", r.sc.Name, ext))
		if err := p.Save(9*vg.Inch, 4.5*vg.Inch, f); err != nil {
			return nil, err
		}
		files = append(files, f)
	}
	return files, nil
}

// wholeTicks are gonum's default ticks labelled as whole numbers (requests
// per second have no fractions).
type wholeTicks struct{}

func (wholeTicks) Ticks(min, max float64) []plot.Tick {
	ts := plot.DefaultTicks{}.Ticks(min, max)
	for i := range ts {
		if ts[i].Label != "" {
			ts[i].Label = strconv.FormatFloat(ts[i].Value, 'f', -1, 64)
		}
	}
	return ts
}

// limitTicks adds a labelled tick at each limit in force (once each) to
// the axis's own ticks, dropping a labelled tick too close to it to read.
type limitTicks struct {
	plot.Ticker
	limits []float64
}

func (t limitTicks) Ticks(min, max float64) []plot.Tick {
	var out []plot.Tick
	seen := map[float64]bool{}
	for _, l := range t.limits {
		if !seen[l] && l >= min && l <= max {
			seen[l] = true
			out = append(out, plot.Tick{Value: l, Label: "limit " + strconv.FormatFloat(l, 'f', -1, 64)})
		}
	}
	for _, tk := range t.Ticker.Ticks(min, max) {
		near := false
		for l := range seen {
			near = near || tk.Label != "" && math.Abs(tk.Value-l) < (max-min)/25
		}
		if near {
			tk.Label = ""
		}
		out = append(out, tk)
	}
	return out
}

// yFloor is the lowest value drawn: 0, or 1 on a log axis.
func (r *recorder) yFloor() float64 {
	if r.logY {
		return 1
	}
	return 0
}

// maxAdmittedPerSecond is the most the fleet admitted in one second.
func (r *recorder) maxAdmittedPerSecond() float64 {
	top := 0.0
	for _, row := range r.perSecond {
		var n int64
		for _, v := range row {
			n += v
		}
		top = max(top, float64(n))
	}
	return top
}

// plotTop is the highest value drawn: offered load or limit.
func (r *recorder) plotTop() float64 {
	top := 0.0
	for _, o := range r.offeredS {
		top = max(top, float64(o))
	}
	for _, l := range r.limitS {
		top = max(top, l)
	}
	return top
}

var faultColor = color.RGBA{R: 255, G: 200, B: 200, A: 255}

func (r *recorder) plotFaults(p *plot.Plot, top float64) error {
	for _, f := range r.faults {
		lo := r.yFloor()
		shade, err := plotter.NewPolygon(plotter.XYs{{X: f[0].Seconds(), Y: lo}, {X: f[1].Seconds(), Y: lo},
			{X: f[1].Seconds(), Y: top * 1.05}, {X: f[0].Seconds(), Y: top * 1.05}})
		if err != nil {
			return err
		}
		shade.Color = faultColor
		shade.LineStyle.Width = 0
		p.Add(shade)
	}
	if len(r.faults) > 0 {
		sw, _ := plotter.NewPolygon(plotter.XYs{{Y: 1}, {X: 1, Y: 1}, {X: 1, Y: 2}})
		sw.Color = faultColor
		p.Legend.Add("store fault", sw)
	}
	return nil
}

// plotStacked draws stacked areas: process i fills between the sums of
// 0..i-1 and 0..i.
// In a tiered world the bands are regions, named in the legend.
func (r *recorder) plotStacked(p *plot.Plot, _ float64) error {
	secs := len(r.perSecond)
	bands := 0
	for _, row := range r.perSecond {
		bands = max(bands, len(row))
	}
	at := func(band, s int) int64 {
		if band < len(r.perSecond[s]) {
			return r.perSecond[s][band]
		}
		return 0
	}
	if len(r.regions) > 0 {
		bands = len(r.regions)
		at = func(band, s int) int64 { return r.regions[band].perS[s] }
	}
	lower := make([]float64, secs)
	for s := range lower {
		lower[s] = r.yFloor()
	}
	for proc := 0; proc < bands; proc++ {
		upper := make([]float64, secs)
		pts := make(plotter.XYs, 0, 2*secs+2)
		for s := 0; s < secs; s++ {
			upper[s] = float64(at(proc, s))
			upper[s] += lower[s]
			pts = append(pts, plotter.XY{X: float64(s) + 0.5, Y: upper[s]})
		}
		for s := secs - 1; s >= 0; s-- {
			pts = append(pts, plotter.XY{X: float64(s) + 0.5, Y: lower[s]})
		}
		area, err := plotter.NewPolygon(pts)
		if err != nil {
			return err
		}
		r8, g8, b8, _ := plotutil.Color(proc).RGBA()
		area.Color = color.RGBA{R: uint8(r8 >> 8), G: uint8(g8 >> 8), B: uint8(b8 >> 8), A: 170}
		area.LineStyle.Width = 0
		p.Add(area)
		if len(r.regions) > 0 {
			p.Legend.Add(r.sc.Regions[proc].Name, area)
		}
		lower = upper
	}
	return nil
}

func (r *recorder) plotOffered(p *plot.Plot, _ float64) error {
	offered := make(plotter.XYs, len(r.offeredS))
	for s := range offered {
		offered[s] = plotter.XY{X: float64(s) + 0.5, Y: max(float64(r.offeredS[s]), r.yFloor())}
	}
	ol, err := plotter.NewLine(offered)
	if err != nil {
		return err
	}
	ol.LineStyle.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
	ol.LineStyle.Color = color.Gray{Y: 90}
	p.Add(ol)
	p.Legend.Add("offered", ol)
	return nil
}

// plotLimit draws the limit of a single-key scenario; in a flood on a
// log axis, the limit of one key (every key has the same).
func (r *recorder) plotLimit(p *plot.Plot, _ float64) error {
	if !r.singleKey && !r.logY {
		return nil
	}
	limit := make(plotter.XYs, 0, 2*len(r.limitS))
	for s, v := range r.limitS {
		limit = append(limit, plotter.XY{X: float64(s), Y: v}, plotter.XY{X: float64(s + 1), Y: v})
	}
	ll, err := plotter.NewLine(limit)
	if err != nil {
		return err
	}
	ll.LineStyle.Width = vg.Points(2)
	ll.LineStyle.Color = color.Black
	p.Add(ll)
	if r.singleKey {
		p.Legend.Add("limit", ll)
	} else {
		p.Legend.Add("one key's limit", ll)
	}
	return nil
}
