package benchmarks

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-redis/redis_rate/v10"
	"github.com/leasehold/leasehold/hybrid"
	"github.com/leasehold/leasehold/internal/redistest"
	"github.com/leasehold/leasehold/remote"
	"golang.org/x/time/rate"
)

func TestMain(m *testing.M) { redistest.Main(m) }

// Every implementation gets a limit far above what a benchmark can reach,
// so each decision is an admission and the benchmark measures decision
// cost, not rejections.
const limitPerSecond = 1_000_000_000

// keySet builds n distinct keys and checks that they are distinct.
func keySet(b *testing.B, n int) []string {
	keys := make([]string, n)
	seen := make(map[string]bool, n)
	for i := range keys {
		keys[i] = "user-" + strconv.Itoa(i)
		seen[keys[i]] = true
	}
	if len(seen) != n {
		b.Fatalf("key set holds %d distinct keys, want %d", len(seen), n)
	}
	return keys
}

// BenchmarkDecision compares the cost of one decision, serial and parallel,
// on 1 and 1024 keys. Names read impl=X/keys=N/goroutines=G.
func BenchmarkDecision(b *testing.B) {
	srv := redistest.Standalone(b)
	ctx := context.Background()
	for _, nkeys := range []int{1, 1024} {
		keys := keySet(b, nkeys)
		for _, par := range []int{1, 8} {
			suffix := fmt.Sprintf("keys=%d/goroutines=%d", nkeys, par)

			b.Run("impl=hybrid/"+suffix, func(b *testing.B) {
				rdb := srv.Client(b)
				lim, err := hybrid.New(remote.NewRedis(rdb),
					hybrid.Policy{Name: "bench-" + suffix, Limit: hybrid.Limit{Rate: limitPerSecond, Period: time.Second, Burst: 1e10}},
					hybrid.WithLogger(slog.New(slog.DiscardHandler)))
				if err != nil {
					b.Fatal(err)
				}
				defer lim.Close(ctx)
				for _, k := range keys { // warm the leases
					lim.Allow(ctx, k)
				}
				var rejected atomic.Int64
				run(b, par, func(i int) {
					if !lim.Allow(ctx, keys[i%nkeys]) {
						rejected.Add(1)
					}
				})
				s := lim.Stats()
				b.ReportMetric(float64(s.StoreCalls)/float64(b.N)*1000, "storecalls/1000")
				if rejected.Load() > int64(b.N)/100 {
					b.Fatalf("%d of %d rejected: the benchmark measured rejections", rejected.Load(), b.N)
				}
			})

			b.Run("impl=redis_rate/"+suffix, func(b *testing.B) {
				rdb := srv.Client(b)
				lim := redis_rate.NewLimiter(rdb)
				l := redis_rate.Limit{Rate: limitPerSecond, Period: time.Second, Burst: limitPerSecond}
				var rejected atomic.Int64
				run(b, par, func(i int) {
					res, err := lim.Allow(ctx, "bench:"+suffix+":"+keys[i%nkeys], l)
					if err != nil || res.Allowed == 0 {
						rejected.Add(1)
					}
				})
				b.ReportMetric(1000, "storecalls/1000")
				if rejected.Load() > int64(b.N)/100 {
					b.Fatalf("%d of %d rejected or failed", rejected.Load(), b.N)
				}
			})

			b.Run("impl=x-time-rate(local only)/"+suffix, func(b *testing.B) {
				lims := make([]*rate.Limiter, nkeys)
				for i := range lims {
					lims[i] = rate.NewLimiter(limitPerSecond, limitPerSecond)
				}
				var rejected atomic.Int64
				run(b, par, func(i int) {
					if !lims[i%nkeys].Allow() {
						rejected.Add(1)
					}
				})
				if rejected.Load() > int64(b.N)/100 {
					b.Fatalf("%d of %d rejected", rejected.Load(), b.N)
				}
			})
		}
	}
}

// run calls f b.N times from par goroutines, each with its own counter.
func run(b *testing.B, par int, f func(i int)) {
	b.ReportAllocs()
	b.ResetTimer()
	if par == 1 {
		for i := 0; i < b.N; i++ {
			f(i)
		}
		return
	}
	b.SetParallelism(par)
	var next atomic.Int64
	b.RunParallel(func(pb *testing.PB) {
		i := int(next.Add(1)) * 7919
		for pb.Next() {
			f(i)
			i++
		}
	})
}
