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
// the limit. The coalesced stores (WithCoalescing(2)) must send most of
// their calls in pipelines, and keep the bound the same.
func TestConcurrentLeasesExactBound(t *testing.T) {
	if testing.Short() {
		t.Skip("3 s of load")
	}
	tests := []struct {
		name     string
		key      string
		dial     func(t *testing.T) redis.UniversalClient
		coalesce int
	}{
		{"standalone", "hot", standalone, 0},
		{"cluster", "user:{42}:}{x:", cluster, 0},
		{"standalone-coalesced", "hot", standalone, 2},
		{"cluster-coalesced", "user:{42}:}{x:", cluster, 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			lim := local.Limit{Rate: 2000, Period: time.Second, Burst: 200}
			stores := make([]Store, 4)
			var piped pipedCommands
			for i := range stores {
				c := tt.dial(t)
				c.AddHook(&piped)
				stores[i] = NewRedis(c, WithCoalescing(tt.coalesce))
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
			t.Logf("%s: %d calls (%d in pipelines), granted %d over %v of store time, exact bound %d (%.2f%%)",
				tt.name, calls.Load(), piped.n.Load(), got, elapsed, bound, 100*float64(got)/float64(bound))
			if tt.coalesce > 0 && piped.n.Load() < calls.Load()/2 {
				t.Fatalf("%d of %d calls in pipelines with 64 callers on 8 round trips, want most", piped.n.Load(), calls.Load())
			}
			if tt.coalesce == 0 && piped.n.Load() != 0 {
				t.Fatalf("%d calls in pipelines without coalescing", piped.n.Load())
			}
			if got > bound {
				t.Fatalf("granted %d > exact bound %d", got, bound)
			}
			if float64(got) < 0.95*float64(bound) {
				t.Fatalf("granted %d < 95%% of bound %d", got, bound)
			}
		})
	}
}

func standalone(t *testing.T) redis.UniversalClient { return redistest.Standalone(t).Client(t) }
func cluster(t *testing.T) redis.UniversalClient    { return redistest.SharedCluster(t).Client(t) }

// pipedCommands is a go-redis hook counting the scripts sent in
// pipelines.
type pipedCommands struct{ n atomic.Int64 }

func (*pipedCommands) DialHook(next redis.DialHook) redis.DialHook          { return next }
func (*pipedCommands) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }
func (p *pipedCommands) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, c := range cmds {
			if n := c.Name(); n == "evalsha" || n == "eval" { // not a connection's set-up
				p.n.Add(1)
			}
		}
		return next(ctx, cmds)
	}
}
