package hybrid

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestLeaseSizeFollowsDemand: a key seeing 1 request per second leases one
// token per store call (a classic limiter); a key back every 250 ms keeps a
// token for its next decision; a key seeing 100 000 per second leases
// hundreds or more per call, never above 10% of Burst. Stock alone, no
// flow (lenient).
func TestLeaseSizeFollowsDemand(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	lim := Limit{Rate: 1_000_000, Period: time.Second, Burst: 100_000}

	w := newFakeWorld()
	slow := w.limiter(t, Policy{Name: "slow", Limit: lim}, lenient)
	for i := 0; i < 20; i++ {
		if !slow.Allow(ctx, "k") {
			t.Fatalf("request %d rejected", i)
		}
		w.clk.Advance(time.Second)
	}
	s := slow.Stats()
	if perCall := float64(s.TokensLeased) / float64(leaseCalls(slow)); perCall != 1 {
		t.Fatalf("a 1/s key leased %.2f tokens per call, want 1 (stats %+v)", perCall, s)
	}

	// A key of a small burst, whose batch the cap holds to one token,
	// back every 250 ms: the lease keeps a token for the next decision,
	// so about half of them are store calls, and nothing goes back while
	// it keeps coming.
	w3 := newFakeWorld()
	warm := w3.limiter(t, Policy{Name: "warm", Limit: Limit{Rate: 10, Period: time.Second, Burst: 10}}, lenient)
	for i := 0; i < 40; i++ {
		if !warm.Allow(ctx, "k") {
			t.Fatalf("request %d rejected", i)
		}
		w3.clk.Advance(250 * time.Millisecond)
	}
	if s := warm.Stats(); s.StoreCalls > 22 || s.TokensReturned != 0 {
		t.Fatalf("a 4/s key of burst 10: %d store calls and %d tokens returned for 40 decisions, want at most 22 and none", s.StoreCalls, s.TokensReturned)
	}

	w2 := newFakeWorld()
	hot := w2.limiter(t, Policy{Name: "hot", Limit: lim}, lenient)
	for step := 0; step < 500; step++ { // 100 requests per ms for 0.5 s
		for i := 0; i < 100; i++ {
			hot.Allow(ctx, "k")
		}
		w2.clk.Advance(time.Millisecond)
	}
	calls := leaseCalls(hot)
	perCall := float64(hot.Stats().TokensLeased) / float64(calls)
	t.Logf("100 000/s key: %d lease calls, %.0f tokens per call", calls, perCall)
	if perCall < 100 || perCall > float64(lim.Burst)/10 {
		t.Fatalf("a 100 000/s key leased %.0f tokens per call, want hundreds, at most %d", perCall, lim.Burst/10)
	}
}

// leaseCalls counts l's Lease calls that granted tokens.
func leaseCalls(l *Limiter) int64 { return l.stats.leaseGrants.Load() }

// TestColdKeyBurstIsNotRejected: many goroutines hitting a cold key at
// once, far below its limit, are all admitted: the first store call leases
// for every caller waiting on it, not one token for the first.
func TestColdKeyBurstIsNotRejected(t *testing.T) {
	t.Parallel()
	w := newFakeWorld()
	l := w.limiter(t, Policy{Name: "burst", Limit: Limit{Rate: 1_000_000, Period: time.Second, Burst: 100_000}})
	var wg sync.WaitGroup
	var rejected atomic.Int64
	for g := 0; g < 16; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 50; i++ {
				if !l.Allow(context.Background(), "cold") {
					rejected.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	if n := rejected.Load(); n != 0 {
		t.Fatalf("%d of 800 requests on a cold key rejected, limit far above them (stats %+v)", n, l.Stats())
	}
}
