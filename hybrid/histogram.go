package hybrid

import (
	"math"
	"sort"
	"sync/atomic"
)

// Histogram is a snapshot of a distribution: Counts[i] observations were
// at most Bounds[i] (and above Bounds[i-1]); the last count is above every
// bound. It is laid out as Prometheus and OpenTelemetry histograms want.
type Histogram struct {
	Bounds []float64
	Counts []uint64 // len(Bounds)+1
	Count  uint64
	Sum    float64
}

// histogram counts observations into fixed buckets with atomics only: it
// is written off the hot path (store calls, grants) and read by Stats.
type histogram struct {
	bounds []float64
	counts []atomic.Uint64
	sum    atomic.Uint64 // float64 bits
}

func newHistogram(bounds ...float64) *histogram {
	return &histogram{bounds: bounds, counts: make([]atomic.Uint64, len(bounds)+1)}
}

func (h *histogram) observe(v float64) {
	h.counts[sort.SearchFloat64s(h.bounds, v)].Add(1)
	for {
		old := h.sum.Load()
		if h.sum.CompareAndSwap(old, math.Float64bits(math.Float64frombits(old)+v)) {
			return
		}
	}
}

func (h *histogram) snapshot() Histogram {
	s := Histogram{Bounds: h.bounds, Counts: make([]uint64, len(h.counts)), Sum: math.Float64frombits(h.sum.Load())}
	for i := range h.counts {
		s.Counts[i] = h.counts[i].Load()
		s.Count += s.Counts[i]
	}
	return s
}

// Bucket bounds: store call latency in seconds (a call past the 500 ms
// breaker threshold counts as a failure), lease grant sizes in tokens.
var (
	latencyBounds = []float64{.0005, .001, .002, .005, .01, .025, .05, .1, .25, .5, 1}
	leaseBounds   = []float64{1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 10000}
)
