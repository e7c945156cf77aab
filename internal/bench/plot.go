package bench

import (
	"errors"
	"fmt"
	"html"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Plot geometry, in SVG user units.
const (
	plotWidth   = 860
	plotHeight  = 500
	plotLeft    = 70
	plotRight   = 20
	plotTop     = 40
	plotBottom  = 60
	plotPoints  = 400 // points per curve at most
	legendWidth = 260
)

// plotColors tell the rates apart; the contenders are told apart by the dash pattern.
var plotColors = []string{"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"}

// WritePlot writes an SVG of the latency distributions: for each rate and contender, the
// share of events stored within x milliseconds of their commit (a CDF), x on a log scale,
// with every round's samples pooled. It fails when no latency run was made.
func (r *Report) WritePlot(w io.Writer) error {
	type series struct {
		name   string
		sorted []time.Duration
		color  string
		dash   string
	}
	var ss []series
	lo, hi := math.Inf(1), math.Inf(-1)
	for i, rate := range r.Config.Rates {
		for _, c := range []string{cRelay, cPlain} {
			lat := slices.Clone(r.samples[fmt.Sprintf("%d/%s", rate, c)])
			if len(lat) == 0 {
				continue
			}
			slices.Sort(lat)
			// The axis starts at 10 µs at the lowest: an event can even be stored before its
			// producer hears that its COMMIT succeeded; such samples are drawn at the axis' start.
			lo, hi = min(lo, ms(max(lat[0], 10*time.Microsecond))), max(hi, ms(lat[len(lat)-1]))
			dash := ""
			if c == cPlain {
				dash = "6 4"
			}
			ss = append(ss, series{name: fmt.Sprintf("%s/s, %s", thousands(float64(rate)), contenderLabel(c)),
				sorted: lat, color: plotColors[i%len(plotColors)], dash: dash})
		}
	}
	if len(ss) == 0 {
		return errors.New("no latency samples to plot: the latency part did not run")
	}
	x0, x1 := math.Floor(math.Log10(lo)), math.Ceil(math.Log10(hi))
	if x1 <= x0 {
		x1 = x0 + 1
	}
	innerW, innerH := float64(plotWidth-plotLeft-plotRight), float64(plotHeight-plotTop-plotBottom)
	px := func(msv float64) float64 {
		return plotLeft + (math.Log10(math.Max(msv, math.Pow(10, x0)))-x0)/(x1-x0)*innerW
	}
	py := func(share float64) float64 { return plotTop + (1-share)*innerH }
	f := func(v float64) string { return strconv.FormatFloat(v, 'f', 1, 64) }

	b := &strings.Builder{}
	fmt.Fprintf(b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="12">`+"\n",
		plotWidth, plotHeight, plotWidth, plotHeight)
	fmt.Fprintf(b, `<rect width="%d" height="%d" fill="white"/>`+"\n", plotWidth, plotHeight)
	fmt.Fprintf(b, `<text x="%d" y="22" font-size="14">commit → stored in JetStream (share of events within x ms, after the warm-up)</text>`+"\n", plotLeft)
	// Grid: decades and their 2 and 5, and shares.
	for d := x0; d <= x1; d++ {
		for _, m := range []float64{1, 2, 5} {
			v := m * math.Pow(10, d)
			if math.Log10(v) > x1+1e-9 {
				break
			}
			x := px(v)
			stroke := "#eee"
			if m == 1 {
				stroke = "#ccc"
				fmt.Fprintf(b, `<text x="%s" y="%d" text-anchor="middle">%s</text>`+"\n", f(x), plotHeight-plotBottom+18, msLabel(v))
			}
			fmt.Fprintf(b, `<line x1="%s" y1="%d" x2="%s" y2="%d" stroke="%s"/>`+"\n", f(x), plotTop, f(x), plotHeight-plotBottom, stroke)
		}
	}
	for _, s := range []float64{0, 0.25, 0.5, 0.75, 0.9, 0.99, 1} {
		y := py(s)
		fmt.Fprintf(b, `<line x1="%d" y1="%s" x2="%d" y2="%s" stroke="#ddd"/>`+"\n", plotLeft, f(y), plotWidth-plotRight, f(y))
		fmt.Fprintf(b, `<text x="%d" y="%s" text-anchor="end">%s</text>`+"\n", plotLeft-6, f(y+4), strconv.FormatFloat(s, 'f', -1, 64))
	}
	fmt.Fprintf(b, `<text x="%d" y="%d" text-anchor="middle">milliseconds (log scale)</text>`+"\n", plotLeft+int(innerW/2), plotHeight-20)
	fmt.Fprintf(b, `<rect x="%d" y="%d" width="%s" height="%s" fill="none" stroke="#888"/>`+"\n", plotLeft, plotTop, f(innerW), f(innerH))
	for _, s := range ss {
		var pts []string
		n := len(s.sorted)
		for k := range min(n, plotPoints) + 1 {
			i := min(n-1, k*n/min(n, plotPoints))
			share := float64(i+1) / float64(n)
			pts = append(pts, f(px(ms(s.sorted[i])))+","+f(py(share)))
		}
		dash := ""
		if s.dash != "" {
			dash = ` stroke-dasharray="` + s.dash + `"`
		}
		fmt.Fprintf(b, `<polyline fill="none" stroke="%s" stroke-width="2"%s points="%s"/>`+"\n", s.color, dash, strings.Join(pts, " "))
	}
	// Legend, bottom right, where CDFs are low.
	lx, ly := plotWidth-plotRight-legendWidth, plotHeight-plotBottom-10-18*len(ss)
	fmt.Fprintf(b, `<rect x="%d" y="%d" width="%d" height="%d" fill="white" stroke="#ccc"/>`+"\n", lx-8, ly-14, legendWidth, 18*len(ss)+8)
	for i, s := range ss {
		y := ly + 18*i
		dash := ""
		if s.dash != "" {
			dash = ` stroke-dasharray="` + s.dash + `"`
		}
		fmt.Fprintf(b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="2"%s/>`+"\n", lx, y-4, lx+30, y-4, s.color, dash)
		p99 := ms(percentile(s.sorted, .99))
		fmt.Fprintf(b, `<text x="%d" y="%d">%s (p99 %s ms)</text>`+"\n", lx+38, y, html.EscapeString(s.name), strconv.FormatFloat(p99, 'f', 2, 64))
	}
	b.WriteString("</svg>\n")
	if _, err := io.WriteString(w, b.String()); err != nil {
		return fmt.Errorf("write the plot: %w", err)
	}
	return nil
}

// msLabel writes an axis value in milliseconds: 0.01, 0.1, 1, 10, 100, 1000.
func msLabel(v float64) string {
	return strconv.FormatFloat(v, 'f', -1, 64)
}
