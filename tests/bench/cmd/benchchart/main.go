// Command benchchart draws messages per second against concurrent deliveries, one line per mode
// or peer, from the output of the repository's own benchmarks (go test -bench text, read with
// golang.org/x/perf/benchfmt), into an SVG file. It is how docs/img/throughput.svg is made:
//
//	cd tests/bench && go test . -run '^$' -bench Peers -benchtime 2000x -count 3 | tee ../../docs/img/peers.txt
//	go run ./cmd/benchchart -in ../../docs/img/peers.txt -out ../../docs/img/throughput.svg
//
// (make bench-peers runs both.) Each benchmark result whose name matches -bench and holds a
// "<key>=<n>" part (-x, default "deliveries") is a point of every metric whose unit ends in
// "-msg/s": the unit's prefix ("inbox", "bare", "dedup", a mode added later) names the line.
// A line joins the medians over the runs (-count); a vertical bar at each point spans the
// lowest and the highest run. The x axis is logarithmic (base 2).
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"

	"golang.org/x/perf/benchfmt"
)

func main() {
	in := flag.String("in", "-", "benchmark output to read (go test -bench text); - for standard input")
	out := flag.String("out", "-", "SVG file to write; - for standard output")
	bench := flag.String("bench", ".", "regular expression the benchmark's name must match")
	xkey := flag.String("x", "deliveries", "name part <key>=<n> that gives the x value")
	title := flag.String("title", "Messages per second against concurrent deliveries", "chart title")
	flag.Parse()
	if err := run(*in, *out, *bench, *xkey, *title); err != nil {
		fmt.Fprintln(os.Stderr, "benchchart:", err)
		os.Exit(1)
	}
}

func run(in, out, bench, xkey, title string) error {
	re, err := regexp.Compile(bench)
	if err != nil {
		return fmt.Errorf("-bench: %w", err)
	}
	var r io.Reader = os.Stdin
	if in != "-" {
		f, err := os.Open(in)
		if err != nil {
			return err
		}
		defer f.Close()
		r = f
	}
	series, err := read(r, in, re, xkey)
	if err != nil {
		return err
	}
	if len(series) == 0 {
		return errors.New("no <mode>-msg/s metric in a benchmark named <...>/" + xkey + "=<n> in the input")
	}
	svg := draw(series, title, xkey)
	if out == "-" {
		_, err = os.Stdout.WriteString(svg)
		return err
	}
	return os.WriteFile(out, []byte(svg), 0o644)
}

// series maps a line's name to its runs' values per x.
type series map[string]map[int][]float64

// read collects, from benchmark output, the values of every "<name>-msg/s" metric per x.
func read(r io.Reader, fileName string, re *regexp.Regexp, xkey string) (series, error) {
	s := series{}
	br := benchfmt.NewReader(r, fileName)
	for br.Scan() {
		res, ok := br.Result().(*benchfmt.Result)
		if !ok || !re.Match(res.Name.Full()) {
			continue
		}
		_, parts := res.Name.Parts()
		x := -1
		for _, p := range parts {
			k, v, ok := strings.Cut(strings.TrimPrefix(string(p), "/"), "=")
			if ok && k == xkey {
				if n, err := strconv.Atoi(v); err == nil && n > 0 {
					x = n
				}
			}
		}
		if x < 0 {
			continue
		}
		for _, v := range res.Values {
			unit, value := v.Unit, v.Value
			if v.OrigUnit != "" { // benchfmt tidied it; use the unit the benchmark reported
				unit, value = v.OrigUnit, v.OrigValue
			}
			name, ok := strings.CutSuffix(unit, "-msg/s")
			if !ok || name == "" {
				continue
			}
			if s[name] == nil {
				s[name] = map[int][]float64{}
			}
			s[name][x] = append(s[name][x], value)
		}
	}
	return s, br.Err()
}

func median(v []float64) float64 {
	w := slices.Clone(v)
	sort.Float64s(w)
	if n := len(w); n%2 == 1 {
		return w[n/2]
	} else {
		return (w[n/2-1] + w[n/2]) / 2
	}
}

// palette is a colour-blind-safe qualitative palette (Okabe and Ito).
var palette = []string{"#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#F0E442", "#000000"}

// draw renders the series as an SVG line chart.
func draw(s series, title, xkey string) string {
	const w, h = 720, 440
	const left, right, top, bottom = 80, 170, 50, 60
	names := make([]string, 0, len(s))
	var xs []int
	ymax := 0.0
	for name, pts := range s {
		names = append(names, name)
		for x, v := range pts {
			if !slices.Contains(xs, x) {
				xs = append(xs, x)
			}
			ymax = max(ymax, slices.Max(v))
		}
	}
	sort.Strings(names)
	sort.Ints(xs)
	ystep := niceStep(ymax / 5)
	ytop := math.Ceil(ymax/ystep) * ystep
	lx0, lx1 := math.Log2(float64(xs[0])), math.Log2(float64(xs[len(xs)-1]))
	px := func(x int) float64 {
		if lx1 == lx0 {
			return float64(left) + float64(w-left-right)/2
		}
		return float64(left) + (math.Log2(float64(x))-lx0)/(lx1-lx0)*float64(w-left-right)
	}
	py := func(y float64) float64 { return float64(h-bottom) - y/ytop*float64(h-top-bottom) }

	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="12">`+"\n", w, h, w, h)
	fmt.Fprintf(&b, `<rect width="%d" height="%d" fill="white"/>`+"\n", w, h)
	fmt.Fprintf(&b, `<text x="%d" y="24" font-size="15" font-weight="bold">%s</text>`+"\n", left, esc(title))
	for y := 0.0; y <= ytop+ystep/2; y += ystep {
		fmt.Fprintf(&b, `<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#ddd"/>`+"\n", left, py(y), w-right, py(y))
		fmt.Fprintf(&b, `<text x="%d" y="%.1f" text-anchor="end">%s</text>`+"\n", left-6, py(y)+4, strconv.FormatFloat(y, 'f', -1, 64))
	}
	for _, x := range xs {
		fmt.Fprintf(&b, `<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#ddd"/>`+"\n", px(x), top, px(x), h-bottom)
		fmt.Fprintf(&b, `<text x="%.1f" y="%d" text-anchor="middle">%d</text>`+"\n", px(x), h-bottom+18, x)
	}
	fmt.Fprintf(&b, `<text x="%.1f" y="%d" text-anchor="middle">concurrent %s (log scale)</text>`+"\n", float64(left+w-right)/2, h-16, esc(xkey))
	fmt.Fprintf(&b, `<text transform="translate(20,%.1f) rotate(-90)" text-anchor="middle">messages per second (median; bars: min to max)</text>`+"\n", float64(top+h-bottom)/2)
	for i, name := range names {
		c := palette[i%len(palette)]
		var pts []string
		for _, x := range xs {
			v, ok := s[name][x]
			if !ok {
				continue
			}
			m := median(v)
			pts = append(pts, fmt.Sprintf("%.1f,%.1f", px(x), py(m)))
			fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="%s"/>`+"\n", px(x), py(slices.Min(v)), px(x), py(slices.Max(v)), c)
			fmt.Fprintf(&b, `<circle cx="%.1f" cy="%.1f" r="3.5" fill="%s"><title>%s at %d: %.0f msg/s (runs: %s)</title></circle>`+"\n",
				px(x), py(m), c, esc(name), x, m, runs(v))
		}
		fmt.Fprintf(&b, `<polyline points="%s" fill="none" stroke="%s" stroke-width="2"/>`+"\n", strings.Join(pts, " "), c)
		ly := top + 10 + i*20
		fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="3"/>`+"\n", w-right+16, ly, w-right+40, ly, c)
		fmt.Fprintf(&b, `<text x="%d" y="%d">%s</text>`+"\n", w-right+46, ly+4, esc(name))
	}
	b.WriteString("</svg>\n")
	return b.String()
}

func runs(v []float64) string {
	s := make([]string, len(v))
	for i, x := range v {
		s[i] = strconv.FormatFloat(x, 'f', 0, 64)
	}
	return strings.Join(s, ", ")
}

// niceStep rounds a raw grid step up to 1, 2 or 5 times a power of ten.
func niceStep(raw float64) float64 {
	if raw <= 0 {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(raw)))
	for _, m := range []float64{1, 2, 5, 10} {
		if m*p >= raw {
			return m * p
		}
	}
	return 10 * p
}

func esc(s string) string {
	return strings.NewReplacer("&", "&amp;", "<", "&lt;", ">", "&gt;", `"`, "&quot;").Replace(s)
}
