package hybrid

import (
	"context"
	"github.com/leasehold/leasehold/internal/keys"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"github.com/leasehold/leasehold/remote"
	"github.com/stretchr/testify/require"
)

// TestTailTokensAreGranted (issue 10.1): Burst 1000 at 1 per hour. A admits
// 50 and closes, giving its unspent lease back, so the bucket holds 950.
// B must admit all 950: a lease it cannot fill falls back to the tokens
// that are there, and its refusal waits for one token, not a whole lease.
func TestTailTokensAreGranted(t *testing.T) {
	t.Parallel()
	srv := redistest.Standalone(t)
	p := Policy{Name: "tail-" + t.Name(), Limit: Limit{Rate: 1, Period: time.Hour, Burst: 1000}}
	ctx := context.Background()
	a := newFleet(t, 1, p, dial(srv))[0]
	for i := 0; i < 50; i++ {
		if !a.Allow(ctx, "k") {
			t.Fatalf("A: Allow %d refused on a full bucket", i)
		}
	}
	require.NoError(t, a.Close(ctx))
	b := newFleet(t, 1, p, dial(srv))[0]
	admitted := 0
	var last Decision
	for i := 0; i < 2000; i++ {
		d, err := b.AllowN(ctx, "k", 1)
		require.NoError(t, err)
		if !d.Allowed {
			last = d
			break
		}
		admitted++
	}
	if admitted != 950 {
		t.Fatalf("B admitted %d after A took 50 of 1000, want 950", admitted)
	}
	if last.RetryAfter <= 0 || last.RetryAfter > time.Hour {
		t.Fatalf("refusal RetryAfter = %v, want the wait for one token (≤ 1h)", last.RetryAfter)
	}
}

// TestRemainingIsTheFleetsEstimate (issue 10.2): on a fresh PerSecond(1000)
// key the first decisions report about what the bucket still holds, not
// what is left of a small local lease.
func TestRemainingIsTheFleetsEstimate(t *testing.T) {
	t.Parallel()
	srv := redistest.Standalone(t)
	l := newFleet(t, 1, Policy{Name: "remaining-" + t.Name(), Limit: PerSecond(1000)}, dial(srv))[0]
	ctx := context.Background()
	for i := 1; i <= 20; i++ {
		d, err := l.AllowN(ctx, "k", 1)
		require.NoError(t, err)
		if !d.Allowed {
			t.Fatalf("decision %d refused on a fresh bucket", i)
		}
		// The fleet may still admit 1000 - i, plus what refilled since
		// (a few ms at 1/ms); never more than Burst.
		if lo, hi := int64(1000-i), int64(1000); d.Remaining < lo-5 || d.Remaining > hi {
			t.Fatalf("decision %d: Remaining = %d, want about %d", i, d.Remaining, lo)
		}
		if d.Remaining < d.Limit.Burst/2 && d.Source == SourceLease {
			t.Fatalf("decision %d reports only its lease: %+v", i, d)
		}
	}
}

// TestInternalNamesUnreachable (issue 10.3): a user key spelled like an
// internal flight name is decided like any other key, and Close returns.
func TestInternalNamesUnreachable(t *testing.T) {
	t.Parallel()
	srv := redistest.Standalone(t)
	// A long store timeout: a decision stuck behind an internal flight
	// waits all of it, which no healthy round trip comes near, even on a
	// loaded CI machine.
	l, err := New(remote.NewRedis(srv.Client(t)), Policy{Name: "names-" + t.Name(), Limit: PerSecond(100)}, quiet,
		WithStoreTimeout(500*time.Millisecond))
	require.NoError(t, err)
	ctx := context.Background()
	for _, key := range []string{"\x00policy", "policy", "sync", "refresh", "\x00fleet"} {
		start := time.Now()
		d, err := l.AllowN(ctx, key, 1)
		require.NoError(t, err)
		if !d.Allowed || d.Source == SourceDegraded || time.Since(start) > 400*time.Millisecond {
			t.Fatalf("AllowN(%q) = %+v after %v, want an admission without waiting out the store timeout", key, d, time.Since(start))
		}
	}
	closed := make(chan error, 1)
	go func() { closed <- l.Close(ctx) }()
	select {
	case err := <-closed:
		require.NoError(t, err)
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not return")
	}
}

// logCounter counts log records whose message contains a substring.
type logCounter struct {
	mu   sync.Mutex
	want string
	n    int
}

func (h *logCounter) Enabled(context.Context, slog.Level) bool { return true }
func (h *logCounter) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h *logCounter) WithGroup(string) slog.Handler            { return h }
func (h *logCounter) Handle(_ context.Context, r slog.Record) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if strings.Contains(r.Message, h.want) {
		h.n++
	}
	return nil
}

func (h *logCounter) count() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.n
}

// TestForeignPolicyRecordDoesNotStall (issue 10.3): a policy record
// overwritten by someone else (a foreign string, another type) is logged
// once and ignored: decisions follow the bucket, none waits for the store
// timeout.
func TestForeignPolicyRecordDoesNotStall(t *testing.T) {
	t.Parallel()
	srv := redistest.Standalone(t)
	c := srv.Client(t)
	ctx := context.Background()
	for _, clobber := range []func(key string) error{
		func(key string) error { return c.Set(ctx, key, "not a policy", 0).Err() },
		func(key string) error { return c.HSet(ctx, key, "f", "v").Err() },
	} {
		name := "foreign-" + time.Now().Format("150405.000000000")
		require.NoError(t, clobber(keys.Policy("", name)))
		logs := &logCounter{want: "policy record"}
		l, err := New(remote.NewRedis(srv.Client(t)), Policy{Name: name, Limit: PerSecond(100)}, WithLogger(slog.New(logs)),
			WithStoreTimeout(500*time.Millisecond)) // a stall waits all of it (see TestInternalNamesUnreachable)
		require.NoError(t, err)
		for i := 0; i < 50; i++ {
			start := time.Now()
			d, err := l.AllowN(ctx, "k"+string(rune('a'+i%5)), 1)
			require.NoError(t, err)
			if !d.Allowed || d.Source == SourceDegraded || time.Since(start) > 400*time.Millisecond {
				t.Fatalf("decision %d with a foreign policy record: %+v after %v", i, d, time.Since(start))
			}
		}
		require.NoError(t, l.Close(ctx))
		if n := logs.count(); n != 1 {
			t.Fatalf("unreadable policy record logged %d times, want once", n)
		}
	}
}

// TestDegradedShareRoundsDown (issue 10.4): when Rate per N·Period has no
// exact form, the share rounds toward admitting less; it never falls back
// to the whole limit.
func TestDegradedShareRoundsDown(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		lim       Limit
		n         int
		wantBurst int64
	}{
		{Limit{Rate: 100_000, Period: 24 * time.Hour, Burst: 100_000}, 4, 25_000},
		{Limit{Rate: 100_003, Period: 24 * time.Hour, Burst: 100_003}, 4, 25_000},
		{Limit{Rate: 100_003, Period: 24 * time.Hour, Burst: 100_003}, 200, 500},
		{Limit{Rate: 3, Period: 24 * time.Hour, Burst: 3}, 200, 1},
	} {
		w := newFakeWorld()
		st := &flaky{Store: w.store}
		l, err := New(st, Policy{Name: "share", Limit: tc.lim}, WithClock(w.clk), WithFleetSize(tc.n), quiet)
		require.NoError(t, err)
		st.down.Store(true)
		admitted := int64(0)
		for i := int64(0); i < tc.lim.Burst+10; i++ {
			if l.Allow(context.Background(), "k") {
				admitted++
			}
		}
		// The first calls trip the breaker (3 failures, each refused).
		if admitted > tc.wantBurst {
			t.Fatalf("%v over %d processes: one process admitted %d at once in an outage, want ≤ %d", tc.lim, tc.n, admitted, tc.wantBurst)
		}
		if tc.wantBurst > 10 && admitted < tc.wantBurst*9/10 {
			t.Fatalf("%v over %d processes: admitted %d, want about %d", tc.lim, tc.n, admitted, tc.wantBurst)
		}
		// Its refill rate is at most Rate/N too.
		s, ok := shareOf(tc.lim, int64(tc.n))
		if ok && float64(s.Rate)/s.Period.Seconds() > float64(tc.lim.Rate)/tc.lim.Period.Seconds()/float64(tc.n) {
			t.Fatalf("share %v of %v over %d refills faster than Rate/N", s, tc.lim, tc.n)
		}
		_ = l.Close(context.Background())
	}
}

// TestCachedRefusalOnlyForLargerRequests: a refusal the store gave for n
// tokens is cached for requests of n or more; a smaller request that the
// bucket can serve is not refused by it (found through the HTTP
// middleware, where requests have different costs).
func TestCachedRefusalOnlyForLargerRequests(t *testing.T) {
	t.Parallel()
	w := newFakeWorld()
	l := w.limiter(t, Policy{Name: "costs", Limit: Limit{Rate: 10, Period: 4 * time.Second, Burst: 10}}, WithMaxReservation(0))
	ctx := context.Background()
	for _, n := range []int64{4, 4} {
		if d, err := l.AllowN(ctx, "k", n); err != nil || !d.Allowed {
			t.Fatalf("AllowN(%d) = %+v, %v on a full bucket", n, d, err)
		}
	}
	quiesce(t, l)
	if d, _ := l.AllowN(ctx, "k", 4); d.Allowed {
		t.Fatalf("AllowN(4) with about 2 left = %+v, want refused", d)
	}
	d, err := l.AllowN(ctx, "k", 1)
	if err != nil || !d.Allowed {
		t.Fatalf("AllowN(1) after a refusal of 4 = %+v, %v; want admitted (tokens are there)", d, err)
	}
}

// TestPacedRetryAfterIsForN: on a key at its limit, whose tokens arrive by
// paced future-dated grants, a refusal's RetryAfter is the wait for the
// caller's own n, not for the next release: asking again exactly then is
// admitted (one process, nobody else takes the tokens).
func TestPacedRetryAfterIsForN(t *testing.T) {
	t.Parallel()
	w := newFakeWorld()
	l := w.limiter(t, Policy{Name: "paced-n", Limit: PerSecond(20)}, lenient) // a token every 50 ms; no flow
	ctx := context.Background()
	// Drain the bucket until the key runs on paced grants.
	eventually(t, "a pending reservation", func() bool {
		l.Allow(ctx, "k")
		e := l.keys.load("k")
		return e != nil && e.pendingUntil() != 0
	})
	for _, n := range []int64{3, 2, 5, 1} {
		d, err := l.AllowN(ctx, "k", n)
		require.NoError(t, err)
		if d.Allowed {
			continue // tokens were there: nothing to wait for
		}
		step := PerSecond(20).DurationFor(1)
		if held := l.keys.load("k").lease.Tokens(); d.RetryAfter < time.Duration(n-held-1)*step {
			t.Fatalf("AllowN(%d) with %d leased: RetryAfter %v, shorter than the %d more tokens take at 50 ms each", n, held, d.RetryAfter, n-held)
		}
		w.clk.Advance(d.RetryAfter)
		if d2, err := l.AllowN(ctx, "k", n); err != nil || !d2.Allowed {
			t.Fatalf("AllowN(%d) again after RetryAfter %v = %+v, %v; want admitted", n, d.RetryAfter, d2, err)
		}
	}
}
