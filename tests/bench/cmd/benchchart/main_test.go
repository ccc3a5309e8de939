package main

import (
	"regexp"
	"strings"
	"testing"
)

const sample = `goos: linux
goarch: amd64
pkg: github.com/watermill-inbox/watermill-inbox/tests/bench
BenchmarkPeers/deliveries=1-2         	    2000	         0 ns/op	      2000 bare-msg/s	      1900 dedup-msg/s	      1700 inbox-msg/s	 0.85 inbox/bare
BenchmarkPeers/deliveries=1-2         	    2000	         0 ns/op	      2200 bare-msg/s	      2000 dedup-msg/s	      1800 inbox-msg/s	 0.82 inbox/bare
BenchmarkPeers/deliveries=1-2         	    2000	         0 ns/op	      2100 bare-msg/s	      2100 dedup-msg/s	      1750 inbox-msg/s	 0.83 inbox/bare
BenchmarkPeers/deliveries=8-2         	    2000	         0 ns/op	      6000 bare-msg/s	      5800 dedup-msg/s	      5000 inbox-msg/s	 0.83 inbox/bare
BenchmarkOther/deliveries=8-2         	    2000	         0 ns/op	      9999 bare-msg/s
BenchmarkPeers/nokey-2                	    2000	         0 ns/op	      9999 bare-msg/s
PASS
`

// TestReadAndDraw: the medians per mode and x come from the metrics, filtered by name; every
// mode gets a line and a legend entry.
func TestReadAndDraw(t *testing.T) {
	s, err := read(strings.NewReader(sample), "sample", regexp.MustCompile("Peers"), "deliveries")
	if err != nil {
		t.Fatal(err)
	}
	if len(s) != 3 {
		t.Fatalf("series %v, want bare, dedup and inbox", s)
	}
	if got := median(s["bare"][1]); got != 2100 {
		t.Fatalf("median of bare at 1: %v, want 2100", got)
	}
	if got := s["inbox"][8]; len(got) != 1 || got[0] != 5000 {
		t.Fatalf("inbox at 8: %v, want [5000]", got)
	}
	if _, ok := s["bare"][0]; ok {
		t.Fatal("a result without deliveries=<n> was read")
	}
	svg := draw(s, "t", "deliveries")
	if n := strings.Count(svg, "<polyline"); n != 3 {
		t.Fatalf("%d lines drawn, want 3", n)
	}
	for _, name := range []string{">bare<", ">dedup<", ">inbox<"} {
		if !strings.Contains(svg, name) {
			t.Fatalf("legend lacks %s", name)
		}
	}
}

func TestNiceStep(t *testing.T) {
	for raw, want := range map[float64]float64{0.7: 1, 1300: 2000, 4100: 5000, 9000: 10000} {
		if got := niceStep(raw); got != want {
			t.Errorf("niceStep(%v) = %v, want %v", raw, got, want)
		}
	}
}
