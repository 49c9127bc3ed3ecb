package inflight

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/remote"
	"github.com/stretchr/testify/require"
	"golang.org/x/sync/semaphore"
)

var t0 = time.Unix(1_700_000_000, 0)

func newLimiter(t *testing.T, store remote.Store, slots int64, opts ...Option) *Limiter {
	t.Helper()
	l, err := New(store, "in-flight", slots, opts...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close(context.Background()) })
	return l
}

// crash stops l's background work without giving its slots back, as a
// process that dies would.
func crash(l *Limiter) {
	if l.closed.CompareAndSwap(false, true) {
		l.bg.Close()
		l.bg.Wait()
	}
}

// TestAcquireRelease: one process under a limit of 3: three acquires
// pass, the fourth does not, a release makes room; the store is asked
// only when the held slots do not cover an acquire.
func TestAcquireRelease(t *testing.T) {
	clk := clock.NewManual(t0)
	l := newLimiter(t, remote.NewMemory(clk), 3, WithClock(clk), WithFleetSize(1))
	for i := range 3 {
		require.True(t, l.TryAcquire("k", 1), "acquire %d", i)
	}
	require.False(t, l.TryAcquire("k", 1), "a fourth in flight under a limit of 3")
	l.Release("k", 1)
	require.True(t, l.TryAcquire("k", 1), "after a release")
	l.Release("k", 3) // the third slot goes back: two are kept spare
	clk.Advance(time.Millisecond)
	require.Equal(t, int64(2), l.Stats().Held)
	calls := l.Stats().StoreCalls
	for range 100 {
		require.True(t, l.TryAcquire("k", 2))
		l.Release("k", 2)
	}
	require.Equal(t, calls, l.Stats().StoreCalls, "acquires on held slots asked the store")
}

// TestFleetNeverHoldsMoreThanTheLimit: two processes share 4 slots. One
// takes 3 and holds the fourth as its batch; the other gets nothing. The
// first releases one and keeps it spare until its next check of the
// store (every 250 ms) says the other waits, then gives the spares back.
func TestFleetNeverHoldsMoreThanTheLimit(t *testing.T) {
	clk := clock.NewManual(t0)
	store := remote.NewMemory(clk)
	a := newLimiter(t, store, 4, WithClock(clk), WithFleetSize(2))
	b := newLimiter(t, store, 4, WithClock(clk), WithFleetSize(2))
	require.True(t, a.TryAcquire("k", 3))
	require.False(t, b.TryAcquire("k", 1), "a holds every slot, b took one")
	a.Release("k", 1)
	require.False(t, b.TryAcquire("k", 1), "a's spare went back before it knew b waits")
	clk.Advance(spareCheck)  // a's spare check learns that b waits, and gives its spare back
	clk.Advance(a.cfg.retry) // b asks again only after its retry interval
	require.True(t, b.TryAcquire("k", 2), "a's released and spare slots never reached b")
	require.False(t, a.TryAcquire("k", 1), "5 in flight under a limit of 4")
	require.LessOrEqual(t, a.Stats().Held+b.Stats().Held, int64(4))
}

// TestCrashedHolderSlotsComeBackAfterTheTerm: a process that dies holding
// slots keeps them counted until its term ends, never less, then the
// others get them.
func TestCrashedHolderSlotsComeBackAfterTheTerm(t *testing.T) {
	clk := clock.NewManual(t0)
	store := remote.NewMemory(clk)
	term := time.Second
	a := newLimiter(t, store, 4, WithClock(clk), WithFleetSize(2), WithTerm(term))
	b := newLimiter(t, store, 4, WithClock(clk), WithFleetSize(2), WithTerm(term))
	require.True(t, a.TryAcquire("k", 3))
	crash(a)
	require.False(t, b.TryAcquire("k", 2), "a's slots came back before its term")
	retry := b.cfg.retry // b asks the store again only after its retry interval
	clk.Advance(term - retry)
	require.False(t, b.TryAcquire("k", 2), "a's slots came back before its term")
	clk.Advance(retry)
	require.True(t, b.TryAcquire("k", 4), "a's slots did not come back after its term")
}

// TestAcquireWaits: Acquire waits for a release in this process (woken at
// once) or in another (found by its retries), and gives up with ctx.
func TestAcquireWaits(t *testing.T) {
	store := remote.NewMemory(clock.Real())
	a := newLimiter(t, store, 2, WithFleetSize(2), WithRetry(5*time.Millisecond))
	b := newLimiter(t, store, 2, WithFleetSize(2), WithRetry(5*time.Millisecond))
	ctx := context.Background()
	require.NoError(t, a.Acquire(ctx, "k", 2))
	done := make(chan error, 2)
	go func() { done <- a.Acquire(ctx, "k", 1) }()
	go func() { done <- b.Acquire(ctx, "k", 1) }()
	a.Release("k", 2)
	for range 2 {
		select {
		case err := <-done:
			require.NoError(t, err)
		case <-time.After(5 * time.Second):
			t.Fatal("a waiting Acquire was never served")
		}
	}
	short, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, b.Acquire(short, "k", 1), context.DeadlineExceeded)
}

// TestAcquireOnHeldSlotAllocatesNothing: the fast path of TryAcquire and
// Release.
func TestAcquireOnHeldSlotAllocatesNothing(t *testing.T) {
	l := newLimiter(t, remote.NewMemory(clock.Real()), 10, WithFleetSize(1))
	require.True(t, l.TryAcquire("k", 1))
	l.Release("k", 1)
	if a := testing.AllocsPerRun(1000, func() {
		l.TryAcquire("k", 1)
		l.Release("k", 1)
	}); a != 0 {
		t.Fatalf("TryAcquire and Release on held slots allocate %v per pair", a)
	}
}

// down is a MemoryStore whose slot and policy calls fail while off is
// set.
type down struct {
	*remote.MemoryStore
	off atomic.Bool
}

func (d *down) slots(ctx context.Context, r slotRequest) (slotReply, error) {
	if d.off.Load() {
		return slotReply{}, errors.Join(remote.ErrUnavailable, errors.New("down"))
	}
	return memoryBackend{d.MemoryStore}.slots(ctx, r)
}

func (d *down) policy(ctx context.Context, key, rec string, version uint64) (string, error) {
	if d.off.Load() {
		return "", errors.Join(remote.ErrUnavailable, errors.New("down"))
	}
	return memoryBackend{d.MemoryStore}.policy(ctx, key, rec, version)
}

// TestStoreAway: while the store is away a process uses the slots it
// holds until their term, and no more even when its share is larger (so a
// fleet that lost the store together stays within the limit); past the
// term it admits its share (10 among 2: 5).
func TestStoreAway(t *testing.T) {
	clk := clock.NewManual(t0)
	st := &down{MemoryStore: remote.NewMemory(clk)}
	l := newLimiter(t, st, 10, WithClock(clk), WithFleetSize(2), WithTerm(time.Second))
	require.True(t, l.TryAcquire("k", 1)) // holds 1 + a batch of 1
	st.off.Store(true)
	require.True(t, l.TryAcquire("k", 1), "a held slot refused while the store is away")
	clk.Advance(l.cfg.retry)
	require.False(t, l.TryAcquire("k", 1), "past the held slots before their term, while the store is away")
	l.Release("k", 2)
	clk.Advance(2 * time.Second)
	require.True(t, l.TryAcquire("k", 5), "the share of 5 refused after the term")
	clk.Advance(l.cfg.retry)
	require.False(t, l.TryAcquire("k", 1), "past the share while the store is away")
}

// TestStoreAwayTermsEndApart: the whole fleet loses the store while A's
// term ends before B's. A may not take its share when its own term ends,
// while B still uses the 7 it holds (5 + 7 in flight under a limit of
// 10): only a term after its first failed call, when every holding that
// was live at the outage has ended.
func TestStoreAwayTermsEndApart(t *testing.T) {
	clk := clock.NewManual(t0)
	shared := remote.NewMemory(clk)
	sa, sb := &down{MemoryStore: shared}, &down{MemoryStore: shared}
	opts := []Option{WithClock(clk), WithFleetSize(2), WithTerm(time.Second)}
	a := newLimiter(t, sa, 10, opts...)
	b := newLimiter(t, sb, 10, opts...)
	require.True(t, a.TryAcquire("k", 1)) // holds 2 until t0+0.99s
	clk.Advance(100 * time.Millisecond)
	require.True(t, b.TryAcquire("k", 7)) // holds 8 until t0+1.09s
	sa.off.Store(true)
	sb.off.Store(true)
	require.False(t, a.TryAcquire("k", 2), "past A's held slots") // A's first failure, at t0+0.1s
	for range 4 {
		clk.Advance(225 * time.Millisecond) // t0+1.0s: A's term is over, B's is not
	}
	require.False(t, a.TryAcquire("k", 4), "A took its share while B's term runs: 5 + 7 in flight under 10")
	clk.Advance(150 * time.Millisecond) // t0+1.15s: a term after A's first failure
	require.True(t, a.TryAcquire("k", 4), "A's share of 5 refused a term after its first failure")
}

// TestBadInput: sentinel errors for bad n, options and names, and after
// Close.
func TestBadInput(t *testing.T) {
	store := remote.NewMemory(clock.Real())
	for _, tc := range []struct {
		name  string
		slots int64
		opts  []Option
		pname string
	}{
		{"no slots", 0, nil, "p"},
		{"short term", 1, []Option{WithTerm(time.Millisecond)}, "p"},
		{"no retry", 1, []Option{WithRetry(0)}, "p"},
		{"no clock", 1, []Option{WithClock(nil)}, "p"},
		{"empty name", 1, nil, ""},
	} {
		if _, err := New(store, tc.pname, tc.slots, tc.opts...); !errors.Is(err, ErrInvalidOption) {
			t.Errorf("%s: %v, want ErrInvalidOption", tc.name, err)
		}
	}
	if _, err := New(struct{ remote.Store }{store}, "p", 1); !errors.Is(err, ErrInvalidOption) {
		t.Errorf("a store without slots: %v, want ErrInvalidOption", err)
	}
	l := newLimiter(t, store, 3)
	ctx := context.Background()
	require.ErrorIs(t, l.Acquire(ctx, "k", 0), ErrInvalidN)
	require.ErrorIs(t, l.Acquire(ctx, "k", 4), ErrInvalidN)
	require.ErrorIs(t, l.Acquire(ctx, "", 1), remote.ErrInvalidKey)
	require.NoError(t, l.Close(ctx))
	require.ErrorIs(t, l.Acquire(ctx, "k", 1), ErrClosed)
	require.False(t, l.TryAcquire("k", 1))
}

// TestCallerGivingUpIsNoOutage: a store call cut short by its caller's
// context says nothing of the store: it starts no hold at the share after
// the next answer (with it, 6 of 10 would be refused for a term at a share
// of 5), and Acquire returns the context's error unchanged.
func TestCallerGivingUpIsNoOutage(t *testing.T) {
	clk := clock.NewManual(t0)
	st := &down{MemoryStore: remote.NewMemory(clk)}
	l := newLimiter(t, st, 10, WithClock(clk), WithFleetSize(2))
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	st.off.Store(true)
	require.Equal(t, context.Canceled, l.Acquire(ctx, "k", 1))
	st.off.Store(false)
	require.True(t, l.TryAcquire("k", 6), "a caller that gave up started a hold at the share")
}

// BenchmarkAcquireRelease: a TryAcquire and a Release on held slots, one
// goroutine and all of them on one key; golang.org/x/sync/semaphore's
// TryAcquire and Release, local to the process, in the same run.
func BenchmarkAcquireRelease(b *testing.B) {
	sem := semaphore.NewWeighted(1 << 20)
	b.Run("impl=x-sync-semaphore/serial", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if !sem.TryAcquire(1) {
				b.Fatal("refused")
			}
			sem.Release(1)
		}
	})
	b.Run("impl=x-sync-semaphore/parallel", func(b *testing.B) {
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				if !sem.TryAcquire(1) {
					b.Error("refused")
					return
				}
				sem.Release(1)
			}
		})
	})
	l, err := New(remote.NewMemory(clock.Real()), "bench-in-flight", 1<<20, WithFleetSize(1))
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close(context.Background())
	l.TryAcquire("k", 1<<18) // holds a band wide enough for every goroutine
	l.Release("k", 1<<18)
	b.Run("impl=inflight/serial", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if !l.TryAcquire("k", 1) {
				b.Fatal("refused")
			}
			l.Release("k", 1)
		}
	})
	b.Run("impl=inflight/parallel", func(b *testing.B) {
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				if !l.TryAcquire("k", 1) {
					b.Error("refused")
					return
				}
				l.Release("k", 1)
			}
		})
	})
}
