package benchmarks

import (
	"runtime/metrics"
	"testing"
)

func TestHistQuantile(t *testing.T) {
	h := &metrics.Float64Histogram{Counts: []uint64{90, 9, 1}, Buckets: []float64{0, 1, 2, 3}}
	for _, tc := range []struct {
		q    float64
		want float64
	}{{0.5, 1}, {0.9, 1}, {0.95, 2}, {0.99, 2}, {0.999, 3}, {1, 3}} {
		if got := histQuantile(h, tc.q); got != tc.want {
			t.Errorf("q %v: %v, want %v", tc.q, got, tc.want)
		}
	}
	if got := histQuantile(&metrics.Float64Histogram{Counts: []uint64{0, 0}, Buckets: []float64{0, 1, 2}}, 0.99); got != 0 {
		t.Errorf("empty: %v, want 0", got)
	}
	if got := histQuantile(nil, 0.99); got != 0 {
		t.Errorf("nil: %v, want 0", got)
	}
	if d := diffCounts([]uint64{1, 2}, []uint64{3, 5, 7}); d[0] != 2 || d[1] != 3 || d[2] != 7 {
		t.Errorf("diffCounts: %v", d)
	}
}
