package hybrid

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"github.com/leasehold/leasehold/remote"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// TestLoneCallerFliesInline: a lone caller's cold decisions fly their own
// store calls over a go-redis client whose reads end at their context's
// deadline, so no worker starts; over a client without
// ContextTimeoutEnabled (reads bounded by ReadTimeout, not the store
// timeout) or a store that is not a RedisStore, a worker flies them and
// the caller waits at most the store timeout.
func TestLoneCallerFliesInline(t *testing.T) {
	srv := redistest.Standalone(t)
	for _, c := range []struct {
		name   string
		store  func(t *testing.T) remote.Store
		inline bool
	}{
		{"RedisStore, ContextTimeoutEnabled", func(t *testing.T) remote.Store { return remote.NewRedis(srv.Client(t)) }, true},
		{"RedisStore, no ContextTimeoutEnabled", func(t *testing.T) remote.Store {
			return remote.NewRedis(srv.Client(t, func(o *redis.Options) { o.ContextTimeoutEnabled = false }))
		}, false},
		{"MemoryStore", func(t *testing.T) remote.Store { return remote.NewMemory(clock.Real()) }, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			// A store timeout no call nears, however loaded the machine:
			// no call counts as slow.
			l, err := New(c.store(t), runPolicy("inline", Limit{Rate: 10, Period: time.Second, Burst: 10}), quiet, WithStoreTimeout(time.Minute))
			require.NoError(t, err)
			defer l.Close(context.Background())
			ctx := context.Background()
			calls := l.Stats().StoreCalls
			for i := range 100 {
				require.True(t, l.Allow(ctx, fmt.Sprintf("k%d", i)))
			}
			require.GreaterOrEqual(t, l.Stats().StoreCalls-calls, int64(100), "every decision on a new key is a store call")
			if workers := l.leaser.workers.n.Load(); c.inline {
				require.Zero(t, workers, "a lone caller over a deadline-honoring client flies its own calls")
			} else {
				require.Positive(t, workers, "calls are handed to workers")
			}
		})
	}
}

// TestInlineCallCutAtTheStoreTimeout: with Redis paused, a lone caller's
// cold decision flown inline is answered within the store timeout (its
// call cut short there, decided as a caller that left a slow worker's
// flight is); the next cold decisions go to workers, which carry a call
// past the store timeout so its tokens still land; once Redis is back and
// fast for the hold, callers fly inline again.
func TestInlineCallCutAtTheStoreTimeout(t *testing.T) {
	if testing.Short() {
		t.Skip("pauses a Redis")
	}
	t.Parallel()
	srv, l := inlineOnOwnRedis(t, "inline-cut")
	ctx := context.Background()

	require.NoError(t, srv.Pause())
	resumed := false
	defer func() {
		if !resumed {
			_ = srv.Resume()
		}
	}()
	start := time.Now()
	_, err := l.AllowN(ctx, "cold-1", 1)
	took := time.Since(start)
	require.NoError(t, err, "a store slower than the store timeout is no error")
	require.Less(t, took, inlineTimeout+100*time.Millisecond, "the inline call ends at the store timeout")
	require.Zero(t, l.leaser.workers.n.Load(), "the cut call was flown inline")

	// The store was slow: the next caller hands its call to a worker,
	// waits the store timeout, and the call goes on.
	_, err = l.AllowN(ctx, "cold-2", 1)
	require.NoError(t, err)
	require.Positive(t, l.leaser.workers.n.Load(), "after a cut call, flights go to workers")
	require.NoError(t, srv.Resume())
	resumed = true
	// The worker's call lands when Redis answers: cold-2's tokens are in
	// its lease.
	eventually(t, "the worker's call to land", func() bool {
		e := l.keys.load("cold-2")
		return e != nil && e.answer.seen()
	})

	// Redis answers fast again: once the hold has passed and the sweeps
	// have ended the idle workers, a lone caller flies inline again.
	eventually(t, "idle workers to end", func() bool { return l.leaser.workers.n.Load() == 0 })
	eventually(t, "the hold to pass", func() bool { return l.cfg.now() >= l.leaser.inline.slowUntil.Load() })
	for i := range 20 {
		require.True(t, l.Allow(ctx, fmt.Sprintf("after-%d", i)))
	}
	require.Zero(t, l.leaser.workers.n.Load(), "flown inline once Redis is fast again")
}

// TestInlineCallerCancelled: a caller whose context is cancelled while it
// flies its own call to a paused Redis returns ctx.Err() when the call
// ends, within the store timeout, as one that left a worker's flight does
// when its context ends.
func TestInlineCallerCancelled(t *testing.T) {
	if testing.Short() {
		t.Skip("pauses a Redis")
	}
	t.Parallel()
	srv, l := inlineOnOwnRedis(t, "inline-cancel")
	require.NoError(t, srv.Pause())
	defer func() { _ = srv.Resume() }()
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(20*time.Millisecond, cancel)
	start := time.Now()
	_, err := l.AllowN(ctx, "cold", 1)
	took := time.Since(start)
	require.ErrorIs(t, err, context.Canceled)
	require.Less(t, took, inlineTimeout+100*time.Millisecond)
	require.Zero(t, l.leaser.workers.n.Load(), "the call was flown inline")
}

// inlineTimeout is the store timeout of inlineOnOwnRedis's limiter.
const inlineTimeout = 200 * time.Millisecond

// TestVirtualClockWaitsForTheStore: under a clock of the caller's
// (clock.Manual, the simulator's), a cold decision waits for the store's
// answer however long it takes in real time (up to the refill timeout),
// as the store timeout is counted on that clock. Flown inline, the call
// was cut at the store timeout in real time: ExampleLimiter_AllowN, on a
// loaded machine, decided its second request by the degraded share.
func TestVirtualClockWaitsForTheStore(t *testing.T) {
	if testing.Short() {
		t.Skip("pauses a Redis")
	}
	t.Parallel()
	srv := redistest.NewServer(t)
	clk := clock.NewManual(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	l, err := New(remote.NewRedis(srv.Client(t)), runPolicy("virtual", Limit{Rate: 10, Period: time.Second, Burst: 10}), quiet,
		WithClock(clk), WithMaxReservation(0))
	require.NoError(t, err)
	defer l.Close(context.Background())
	ctx := context.Background()
	d, err := l.AllowN(ctx, "k", 8)
	require.NoError(t, err)
	require.True(t, d.Allowed)

	require.NoError(t, srv.Pause())
	// Longer than the store timeout (50 ms), within the refill timeout.
	resume := time.AfterFunc(150*time.Millisecond, func() { _ = srv.Resume() })
	defer func() {
		if resume.Stop() {
			_ = srv.Resume()
		}
	}()
	start := time.Now()
	d, err = l.AllowN(ctx, "k", 4)
	require.NoError(t, err)
	require.GreaterOrEqual(t, time.Since(start), 100*time.Millisecond, "the decision waited for Redis")
	require.Equal(t, SourceRemote, d.Source, "decided by the store, not the degraded share")
	require.False(t, d.Allowed, "2 tokens left of 10: the store refuses 4")
	require.Positive(t, l.leaser.workers.n.Load(), "flown by a worker, not inline")
}

// inlineOnOwnRedis starts a Redis of the test's own, to pause, and a
// limiter over it with a store timeout of inlineTimeout, closed when the test
// ends, whose first cold decision was flown inline.
func inlineOnOwnRedis(t *testing.T, name string) (*redistest.Server, *Limiter) {
	srv := redistest.NewServer(t)
	l, err := New(remote.NewRedis(srv.Client(t)), runPolicy(name, Limit{Rate: 1000, Period: time.Second, Burst: 1000}), quiet, WithStoreTimeout(inlineTimeout))
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close(context.Background()) })
	require.True(t, l.Allow(context.Background(), "warm"))
	require.Zero(t, l.leaser.workers.n.Load(), "flown inline while Redis is fast")
	return srv, l
}

// TestConcurrentCallersFlyInline: up to maxInline callers deciding cold
// keys at once each fly their own call, and start no worker; one at a
// time handed every other caller's call to a worker.
func TestConcurrentCallersFlyInline(t *testing.T) {
	l, err := New(remote.NewRedis(standaloneDial(t)), runPolicy("inline-many", Limit{Rate: 10, Period: time.Second, Burst: 10}), quiet,
		WithStoreTimeout(time.Minute)) // no call counts as slow, however loaded the machine
	require.NoError(t, err)
	defer l.Close(context.Background())
	ctx := context.Background()
	var wg sync.WaitGroup
	for g := range maxInline {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 100 {
				if !l.Allow(ctx, fmt.Sprintf("k%d-%d", g, i)) {
					t.Errorf("a cold key's first decision was refused")
					return
				}
			}
		}()
	}
	wg.Wait()
	require.GreaterOrEqual(t, l.Stats().StoreCalls, int64(100*maxInline), "every decision on a new key is a store call")
	require.Zero(t, l.leaser.workers.n.Load(), "%d concurrent callers fly their own calls", maxInline)
}

// TestInlineCap: at most maxInline callers fly inline at once; one more
// goes to a worker until one of them lands.
func TestInlineCap(t *testing.T) {
	in := inline{on: true, timeout: time.Second}
	ctx := context.Background()
	for i := range maxInline {
		require.True(t, in.take(ctx, 0), "caller %d", i)
	}
	require.False(t, in.take(ctx, 0), "one caller more than maxInline")
	in.done()
	require.True(t, in.take(ctx, 0), "a caller after one landed")
	require.False(t, in.take(ctx, 0))
}
