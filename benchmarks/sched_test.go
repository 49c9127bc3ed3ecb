package benchmarks

import (
	"context"
	"runtime"
	"runtime/metrics"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leasehold/leasehold/internal/testkit/redistest"
)

// BenchmarkPingBeside is why hybrid's tails at 256 goroutines sit above
// redis_rate's, shown without leasehold: 16 goroutines time PINGs to a
// real Redis beside 240 others that are parked (others=parked: they sleep,
// as redis_rate's goroutines wait on its pool) or always runnable
// (others=runnable: a moment's work, then runtime.Gosched, as goroutines
// deciding from their leases are). The runtime polls the network when a
// core runs out of goroutines to run, or else from its monitor thread
// every 10 ms: beside runnable goroutines a reply waits for that, and a
// PING's p99 is milliseconds instead of a fraction of one.
func BenchmarkPingBeside(b *testing.B) {
	c := redistest.Standalone(b).Client(b)
	ctx := context.Background()
	for _, others := range []string{"parked", "runnable"} {
		b.Run("others="+others, func(b *testing.B) {
			var stop atomic.Bool
			var bg sync.WaitGroup
			for range 240 {
				bg.Go(func() {
					for !stop.Load() {
						if others == "parked" {
							time.Sleep(time.Millisecond)
							continue
						}
						work(300)
						runtime.Gosched()
					}
				})
			}
			var next atomic.Int64
			var mu sync.Mutex
			samples := make([]time.Duration, 0, b.N)
			var pings sync.WaitGroup
			b.ResetTimer()
			for range 16 {
				pings.Go(func() {
					for next.Add(1) <= int64(b.N) {
						start := time.Now()
						if err := c.Ping(ctx).Err(); err != nil {
							b.Error(err)
							return
						}
						d := time.Since(start)
						mu.Lock()
						samples = append(samples, d)
						mu.Unlock()
						work(300)
					}
				})
			}
			pings.Wait()
			b.StopTimer()
			stop.Store(true)
			bg.Wait()
			if len(samples) > 0 {
				reportQuantiles(b, samples)
			}
		})
	}
}

// workSink keeps work's loop from being optimized away.
var workSink atomic.Int64

// work is a moment of computation, about a microsecond for n = 300.
func work(n int) {
	x := 0
	for i := range n {
		x += i * 7
	}
	workSink.Add(int64(x & 1))
}

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
