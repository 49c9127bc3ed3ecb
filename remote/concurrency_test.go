package remote

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"github.com/leasehold/leasehold/local"
	"github.com/redis/go-redis/v9"
)

// TestConcurrentLeasesExactBound: 64 goroutines over 4 separate clients
// lease from one key for 3 s. Granted in total must stay within the exact
// bound Burst + Rate·elapsed/Period, elapsed measured on the store's clock
// between the first and last call, and reach 95% of it: demand is far above
// the limit.
func TestConcurrentLeasesExactBound(t *testing.T) {
	if testing.Short() {
		t.Skip("3 s of load")
	}
	tests := []struct {
		name string
		key  string
		dial func(t *testing.T) redis.UniversalClient
	}{
		{"standalone", "hot", func(t *testing.T) redis.UniversalClient { return redistest.Standalone(t).Client(t) }},
		{"cluster", "user:{42}:}{x:", func(t *testing.T) redis.UniversalClient { return redistest.SharedCluster(t).Client(t) }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			lim := local.Limit{Rate: 2000, Period: time.Second, Burst: 200}
			stores := make([]Store, 4)
			for i := range stores {
				stores[i] = NewRedis(tt.dial(t))
			}
			policy := "exact-" + tt.name + time.Now().Format("150405.000000")
			var granted, calls atomic.Int64
			var first, last atomic.Int64 // store µs
			first.Store(1 << 62)
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			defer cancel()
			var wg sync.WaitGroup
			for g := 0; g < 64; g++ {
				wg.Add(1)
				go func(s Store) {
					defer wg.Done()
					for ctx.Err() == nil {
						res, err := s.Lease(context.Background(), Request{Policy: policy, Key: tt.key, Limit: lim, N: 5})
						if err != nil {
							t.Errorf("Lease: %v", err)
							return
						}
						calls.Add(1)
						granted.Add(res.Granted)
						if res.Granted > 0 {
							now := res.Now.UnixMicro()
							for f := first.Load(); now < f && !first.CompareAndSwap(f, now); f = first.Load() {
							}
							for l := last.Load(); now > l && !last.CompareAndSwap(l, now); l = last.Load() {
							}
						}
					}
				}(stores[g%4])
			}
			wg.Wait()
			elapsed := time.Duration(last.Load()-first.Load()) * time.Microsecond
			bound := lim.Burst + lim.TokensIn(elapsed)
			got := granted.Load()
			t.Logf("%s: %d calls, granted %d over %v of store time, exact bound %d (%.2f%%)",
				tt.name, calls.Load(), got, elapsed, bound, 100*float64(got)/float64(bound))
			if got > bound {
				t.Fatalf("granted %d > exact bound %d", got, bound)
			}
			if float64(got) < 0.95*float64(bound) {
				t.Fatalf("granted %d < 95%% of bound %d", got, bound)
			}
		})
	}
}
