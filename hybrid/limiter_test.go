package hybrid

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/internal/testkit/poll"
	"github.com/leasehold/leasehold/remote"
	"github.com/stretchr/testify/require"
)

func TestBadInput(t *testing.T) {
	t.Parallel()
	w := newFakeWorld()
	ctx := context.Background()
	good := Policy{Name: "api", Limit: PerSecond(10)}
	newCases := []struct {
		name string
		p    Policy
		want error
	}{
		{"empty name", Policy{Limit: PerSecond(1)}, ErrInvalidPolicy},
		{"name too long", Policy{Name: strings.Repeat("n", 300), Limit: PerSecond(1)}, ErrInvalidPolicy},
		{"unknown algorithm", Policy{Name: "x", Limit: PerSecond(1), Algorithm: Algorithm(9)}, ErrInvalidPolicy},
		{"rate zero", Policy{Name: "x", Limit: Limit{Period: time.Second, Burst: 1}}, ErrInvalidLimit},
		{"period zero", Policy{Name: "x", Limit: Limit{Rate: 1, Burst: 1}}, ErrInvalidLimit},
		{"burst zero", Policy{Name: "x", Limit: Limit{Rate: 1, Period: time.Second}}, ErrInvalidLimit},
		{"overflow", Policy{Name: "x", Limit: Limit{Rate: 1, Period: 200 * 365 * 24 * time.Hour, Burst: 1e12}}, ErrInvalidLimit},
	}
	for _, c := range newCases {
		if _, err := New(w.store, c.p); !errors.Is(err, c.want) {
			t.Errorf("New(%s) error = %v, want %v", c.name, err, c.want)
		}
	}
	if _, err := New(w.store, good, WithPrefix("a{b")); !errors.Is(err, ErrInvalidKey) {
		t.Errorf("New(WithPrefix(a{b)) error = %v, want ErrInvalidKey", err)
	}
	if _, err := New(nil, good); err == nil {
		t.Error("New(nil store) = nil error")
	}
	l := w.limiter(t, good)
	allowCases := []struct {
		name string
		key  string
		n    int64
		want error
	}{
		{"empty key", "", 1, ErrInvalidKey},
		{"key over 1 KiB", strings.Repeat("k", 1025), 1, ErrInvalidKey},
		{"n zero", "k", 0, ErrInvalidN},
		{"n negative", "k", -1, ErrInvalidN},
		{"n over burst", "k", 11, ErrExceedsBurst},
	}
	for _, c := range allowCases {
		d, err := l.AllowN(ctx, c.key, c.n)
		if !errors.Is(err, c.want) || d.Allowed {
			t.Errorf("AllowN(%s) = %+v, %v; want rejected with %v", c.name, d, err, c.want)
		}
		if c.n == 1 && l.Allow(ctx, c.key) {
			t.Errorf("Allow(%s) = true", c.name)
		}
	}
	if err := l.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if err := l.Close(ctx); err != nil {
		t.Fatalf("second Close = %v, want nil", err)
	}
	if _, err := l.AllowN(ctx, "k", 1); !errors.Is(err, ErrClosed) {
		t.Errorf("AllowN after Close error = %v, want ErrClosed", err)
	}
	if l.Allow(ctx, "k") {
		t.Error("Allow after Close = true")
	}
}

// TestSlowKeyExact: Rate 10/min shared by two limiters on one store under
// constant demand: the cumulative admitted count equals the exact bound at
// every step, never above it. With Burst 1 that is exactly 10 in the first
// minute.
func TestSlowKeyExact(t *testing.T) {
	t.Parallel()
	for _, burst := range []int64{1, 10} {
		w := newFakeWorld()
		p := Policy{Name: "slow", Limit: Limit{Rate: 10, Period: time.Minute, Burst: burst}}
		a, b := w.limiter(t, p), w.limiter(t, p)
		ctx := context.Background()
		var admitted int64
		step := 100 * time.Millisecond
		for at := time.Duration(0); at < time.Minute; at += step {
			for i := 0; i < 12; i++ { // demand above Burst at every step
				if []*Limiter{a, b}[i%2].Allow(ctx, "tenant-7") {
					admitted++
				}
			}
			bound := burst + p.Limit.TokensIn(at)
			if admitted > bound {
				t.Fatalf("burst %d: at %v admitted %d > bound %d", burst, at, admitted, bound)
			}
			// A token is admitted within 1 step of being due (reservations
			// are spent when they become spendable).
			if admitted < bound-1 || (at%time.Second == 0 && at > 0 && admitted < p.Limit.TokensIn(at-step)+burst) {
				t.Fatalf("burst %d: at %v admitted %d, want about %d", burst, at, admitted, bound)
			}
			quiesce(t, a)
			quiesce(t, b)
			w.clk.Advance(step)
		}
		want := burst + 9 // refills at 6 s, 12 s, ... 54 s
		if admitted != want {
			t.Fatalf("burst %d: admitted %d in the first minute, want %d", burst, admitted, want)
		}
		calls := a.Stats().StoreCalls + b.Stats().StoreCalls
		t.Logf("burst %d: %d admitted, %d store calls", burst, admitted, calls)
		// A key at its limit costs about one call per process per token
		// interval (6 s here), not one per request (1 200 requests were
		// offered): at most twice that, plus the burst's own calls.
		if limit := 2*2*10 + burst; calls > limit {
			t.Fatalf("burst %d: %d store calls for 10 token intervals and 2 processes, want ≤ %d", burst, calls, limit)
		}
	}
}

// TestCloseGivesTokensBack: with leases that keep their tokens, Close
// gives back every token the lease held.
func TestCloseGivesTokensBack(t *testing.T) {
	t.Parallel()
	w := newFakeWorld()
	p := Policy{Name: "close", Limit: PerSecond(1000)}
	ctx := context.Background()
	l := w.limiter(t, p, WithRefillHorizon(time.Second), lenient)
	// Warm the key so its lease grows to the maximum (10% of Burst).
	for i := 0; i < 400; i++ {
		l.Allow(ctx, "k")
		if i%50 == 0 {
			quiesce(t, l)
			w.clk.Advance(5 * time.Millisecond)
		}
	}
	quiesce(t, l)
	held := int64(0)
	if e := l.keys.load("k"); e != nil {
		held = e.lease.Tokens()
	}
	if held == 0 {
		t.Fatal("no tokens leased before Close; the test proves nothing")
	}
	before, err := w.store.Lease(ctx, remote.Request{Policy: "close", Key: "k", Limit: p.Limit, Version: 1, N: 1})
	require.NoError(t, err)
	_, err = w.store.Return(ctx, remote.Request{Policy: "close", Key: "k", Limit: p.Limit, Version: 1, N: 1})
	require.NoError(t, err)
	require.NoError(t, l.Close(ctx))
	after, err := w.store.Lease(ctx, remote.Request{Policy: "close", Key: "k", Limit: p.Limit, Version: 1, N: 1})
	require.NoError(t, err)
	if got := after.Remaining + 1 - (before.Remaining + 1); got != held {
		t.Fatalf("Close gave back %d tokens, lease held %d", got, held)
	}
	if s := l.Stats(); s.TokensReturned < held {
		t.Fatalf("Stats.TokensReturned = %d, want ≥ %d", s.TokensReturned, held)
	}
}

// TestStockServesABurst: with stock records a process alone on a key of
// 10 an hour, burst 10, admits the whole burst back to back and nothing
// more, on the memory store and on real Redis, and a second process
// finds nothing left (capacity grants gave a holder at most Burst/16).
func TestStockServesABurst(t *testing.T) {
	ctx := context.Background()
	stockPairs(t, "stock-burst-", PerHour(10), nil, func(t *testing.T, a, b *Limiter) {
		admitted := 0
		for range 20 {
			if a.Allow(ctx, "k") {
				admitted++
			}
		}
		require.Equal(t, 10, admitted, "a burst of 10 in one process")
		require.False(t, b.Allow(ctx, "k"), "a second process found tokens the first holds")
		require.LessOrEqual(t, a.Stats().StoreCalls, int64(11))
	})
}

// stockPairs runs f on two limiters with stock records and opts, sharing
// a policy of lim named for the run, on the memory store and on real
// Redis.
func stockPairs(t *testing.T, name string, lim Limit, opts []Option, f func(t *testing.T, a, b *Limiter)) {
	for store, s := range map[string]remote.Store{
		"memory": remote.NewMemory(clock.Real()),
		"redis":  remote.NewRedis(standaloneDial(t)),
	} {
		t.Run(store, func(t *testing.T) {
			p := runPolicy(name+store, lim)
			mk := func() *Limiter {
				l, err := New(s, p, append([]Option{quiet, lenient}, opts...)...)
				require.NoError(t, err)
				t.Cleanup(func() { _ = l.Close(context.Background()) })
				return l
			}
			f(t, mk(), mk())
		})
	}
}

// TestStockSpentAtOnceIsNotHeld: under stock records, the tokens a lease
// brings for the caller that waits on it are spent as the reply comes,
// so the holder's record does not count them: the bucket refills behind
// them for the others. Counted as held until the holder's next call, they
// left 64 processes on one key 0.796 of Burst + Rate·t (make figures,
// stock), 0.817 without; on the memory store and on real Redis.
func TestStockSpentAtOnceIsNotHeld(t *testing.T) {
	ctx := context.Background()
	lim := Limit{Rate: 20, Period: time.Second, Burst: 10}
	stockPairs(t, "stock-spent-", lim, []Option{WithFleetSize(2), WithMaxReservation(0)}, func(t *testing.T, a, b *Limiter) {
		d, err := a.AllowN(ctx, "k", 10)
		require.NoError(t, err)
		require.True(t, d.Allowed, "%+v", d)
		require.Zero(t, a.Stats().TokensHeld, "a holds none of the 10 it spent")
		// 2 tokens refill in 100 ms: b gets them, though a made no
		// call since.
		poll.Until(t, "b to be admitted", time.Second, func() bool {
			d, err := b.AllowN(ctx, "k", 1)
			require.NoError(t, err)
			return d.Allowed
		})
	})
}

// releaseCounter counts the stock releases (remote.Stock.Release) a
// limiter sends.
type releaseCounter struct {
	*remote.MemoryStore
	releases atomic.Int64
}

func (c *releaseCounter) Return(ctx context.Context, r remote.Request) (remote.Result, error) {
	if r.Stock.Release {
		c.releases.Add(1)
	}
	return c.MemoryStore.Return(ctx, r)
}

func (c *releaseCounter) Batch(ctx context.Context, op remote.Op, rs []remote.Request) []remote.Reply {
	for _, r := range rs {
		if r.Stock.Release {
			c.releases.Add(1)
		}
	}
	return c.MemoryStore.Batch(ctx, op, rs)
}

// TestCloseReleasesEachRecordOnce: under stock records Close drops each
// key's record with one release. Its second pass, for refills that
// landed after the first, sent every key's release again: 2 of the 3
// calls a process made at Close on a key at its limit.
func TestCloseReleasesEachRecordOnce(t *testing.T) {
	t.Parallel()
	w := newFakeWorld()
	store := &releaseCounter{MemoryStore: w.store}
	l, err := New(store, Policy{Name: "release-once", Limit: PerSecond(1000)}, WithClock(w.clk), quiet)
	require.NoError(t, err)
	ctx := context.Background()
	for _, k := range []string{"a", "b", "c"} {
		require.True(t, l.Allow(ctx, k))
	}
	quiesce(t, l)
	require.NoError(t, l.Close(ctx))
	require.Equal(t, int64(3), store.releases.Load(), "releases sent at Close for 3 keys")
}

// TestStripedCounterSums: a striped counter's Load is every Add, from
// any number of goroutines.
func TestStripedCounterSums(t *testing.T) {
	t.Parallel()
	var c striped
	var wg sync.WaitGroup
	for g := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 1000 {
				c.Add(int64(g + 1))
			}
		}()
	}
	wg.Wait()
	require.Equal(t, int64(1000*16*17/2), c.Load())
}

// TestGrantRefusalsCountInDemand: a grant's refusals are the key's
// demand, each one on a manual clock (a run stays deterministic), one in
// missSample counted missSample times on the real clock: the estimate
// stays within a few percent of the count.
func TestGrantRefusalsCountInDemand(t *testing.T) {
	t.Parallel()
	const refusals = 64_000
	for _, real := range []bool{false, true} {
		var opts []Option
		if real {
			opts = append(opts, WithClock(clock.Real()))
		}
		l := grantLimiterOf(t, opts...)
		e := l.keys.load("hot")
		before := e.misses.Load()
		for range refusals {
			l.grantDecided(e, 1, false, l.cfg.now())
		}
		got := e.misses.Load() - before
		if !real {
			require.Equal(t, int64(refusals), got, "manual clock: every refusal counts")
			continue
		}
		require.InDelta(t, refusals, got, 0.05*refusals, "real clock: sampled")
		require.Equal(t, int64(refusals), l.Stats().Source(SourceGrant).Rejected, "Stats counts every refusal")
	}
}
