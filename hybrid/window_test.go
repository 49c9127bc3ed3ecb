package hybrid

import (
	"context"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/leasehold/leasehold/remote"
	"github.com/redis/go-redis/v9"
)

// TestSlidingWindowInVirtualTime runs 8 limiters of a sliding window of
// 1 000 per 10 s at 3× demand for 40 s of virtual time on MemoryStore, and
// 22 s on the Lua script (miniredis, its TIME moved with the clock, which
// is slower): every 10 s
// window, at 100 ms steps, admits at most 1 000 and, once a whole window
// has passed, at least 90% of it.
func TestSlidingWindowInVirtualTime(t *testing.T) {
	for _, script := range []bool{false, true} {
		name := map[bool]string{false: "memory", true: "lua"}[script]
		t.Run(name, func(t *testing.T) {
			w := newFakeWorld()
			var store remote.Store = w.store
			sync := func() {}
			if script {
				mr := miniredis.RunT(t)
				mr.SetTime(w.clk.Now())
				c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
				t.Cleanup(func() { _ = c.Close() })
				store = remote.NewRedis(c)
				sync = func() { mr.SetTime(w.clk.Now()) }
			}
			p := Policy{Name: "sw", Limit: Limit{Rate: 1000, Period: 10 * time.Second}, Algorithm: SlidingWindow}
			var lims []*Limiter
			for range 8 {
				l, err := New(store, p, WithClock(w.clk), quiet)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = l.Close(context.Background()) })
				lims = append(lims, l)
			}
			var adm []time.Duration
			ctx := context.Background()
			run := 40 * time.Second
			if script {
				run = 22 * time.Second
			}
			for ms, i := 0, 0; ms < int(run/time.Millisecond); ms++ {
				// 300/s, one decision every 10/3 ms, round robin.
				for ; i*10 < ms*3; i++ {
					if lims[i%8].Allow(ctx, "k") {
						adm = append(adm, time.Duration(ms)*time.Millisecond)
					}
				}
				w.clk.Advance(time.Millisecond)
				sync()
			}
			lo, hi := 1<<30, 0
			for end := 100 * time.Millisecond; end <= run; end += 100 * time.Millisecond {
				n := 0
				for _, a := range adm {
					if a > end-10*time.Second && a <= end {
						n++
					}
				}
				hi = max(hi, n)
				if end >= 10*time.Second {
					lo = min(lo, n)
				}
			}
			s := fleetStats(lims)
			t.Logf("%s: admitted %d in %v, per 10 s window at most %d and at least %d, %d store calls", name, len(adm), run, hi, lo, s.StoreCalls)
			if hi > 1000 {
				t.Fatalf("a window admitted %d, over 1 000", hi)
			}
			if lo < 900 {
				t.Fatalf("a window admitted %d, under 90%% of 1 000", lo)
			}
		})
	}
}
