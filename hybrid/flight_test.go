package hybrid

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/leasehold/leasehold/internal/testkit/allocs"
	"github.com/leasehold/leasehold/internal/testkit/spawn"
	"github.com/leasehold/leasehold/remote"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Cold decisions (every one a store call) run their flights on the
// limiter's workers, kept from one flight to the next: a goroutine per
// flight cost each store call its creation and a stack grown again from
// its smallest (13% of the CPU of the Zipf benchmark, measured).
func TestColdDecisionsStartNoGoroutine(t *testing.T) {
	for _, g := range []int{1, 16} {
		t.Run(fmt.Sprintf("goroutines=%d", g), func(t *testing.T) {
			l, err := New(remote.NewRedis(standaloneDial(t)), runPolicy("cold", Limit{Rate: 10, Period: time.Second, Burst: 10}), quiet,
				// Every decision waits for its call, however loaded the
				// machine: none is decided by the outage mode instead.
				WithStoreTimeout(time.Minute))
			require.NoError(t, err)
			defer l.Close(context.Background())
			ctx := context.Background()
			// Warm-up: the workers start, as many as flights overlap.
			decide := func(round int) {
				var wg sync.WaitGroup
				for w := range g {
					wg.Add(1)
					go func() {
						defer wg.Done()
						for i := range 200 {
							require.True(t, l.Allow(ctx, fmt.Sprintf("k%d-%d-%d", round, w, i)))
						}
					}()
				}
				wg.Wait()
			}
			decide(0)
			before, calls := spawn.Count(), l.Stats().StoreCalls
			decide(1)
			created := spawn.Count() - before - uint64(g) // less the test's own
			calls = l.Stats().StoreCalls - calls
			require.GreaterOrEqual(t, calls, int64(200*g), "every decision on a new key is a store call")
			t.Logf("%d store calls started %d goroutines", calls, created)
			// A worker may still start when more flights overlap than in
			// the warm-up, and the limiter's timers run their callbacks
			// on goroutines of their own (a sweep every 250 ms); a
			// goroutine per flight would be one per call (2 164 for
			// 3 200 calls at 16 goroutines, measured).
			require.LessOrEqual(t, created, uint64(g)+uint64(calls)/50, "%d store calls started %d goroutines", calls, created)
		})
	}
}

// gatedStore grants every lease once its gate is open.
type gatedStore struct {
	grantAll
	gate chan struct{}
}

func (g gatedStore) Lease(ctx context.Context, r remote.Request) (remote.Result, error) {
	<-g.gate
	return g.grantAll.Lease(ctx, r)
}

// TestIdleWorkersEnd: 64 cold decisions at once start 64 workers; once
// the burst is over, the sweeps end the idle ones, and the next cold
// decision starts a worker again.
func TestIdleWorkersEnd(t *testing.T) {
	w := newFakeWorld()
	store := gatedStore{grantAll{w.clk}, make(chan struct{})}
	l, err := New(store, Policy{Name: "burst", Limit: Limit{Rate: 1000, Period: time.Second, Burst: 1000}},
		WithClock(w.clk), quiet, WithStoreTimeout(time.Hour))
	require.NoError(t, err)
	defer l.Close(context.Background())
	ctx := context.Background()
	var wg sync.WaitGroup
	for i := range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			assert.True(t, l.Allow(ctx, fmt.Sprintf("k%d", i)))
		}()
	}
	ws := &l.leaser.workers
	eventually(t, "64 flights at once", func() bool { return ws.busy.Load() == 64 })
	require.Equal(t, int32(64), ws.n.Load(), "workers for 64 flights at once")
	close(store.gate)
	wg.Wait()
	eventually(t, "the idle workers to end", func() bool {
		w.clk.Advance(time.Second) // sweeps
		return ws.n.Load() == 0
	})
	require.True(t, l.Allow(ctx, "after"))
	require.Equal(t, int32(1), ws.n.Load(), "a worker for the next cold decision")
}

// TestFlightAfterCloseEndsInline: a flight handed to the workers once
// Close has begun (a refill a leased decision started meanwhile) ends at
// once with ErrClosed, in the caller, not in a goroutine Close would not
// wait for.
func TestFlightAfterCloseEndsInline(t *testing.T) {
	w := newFakeWorld()
	l := w.limiter(t, Policy{Name: "closing", Limit: Limit{Rate: 10, Period: time.Second, Burst: 10}})
	require.NoError(t, l.Close(context.Background()))
	f, lead := l.leaser.flights.join(&l.leaser, newAccount("k"), 0)
	require.True(t, lead)
	before := spawn.Count()
	l.leaser.workers.run(f)
	select {
	case <-l.leaser.flights.wait(f):
	default:
		t.Fatal("a flight handed over after Close is still under way")
	}
	require.ErrorIs(t, f.err, ErrClosed)
	require.Equal(t, uint64(0), spawn.Count()-before, "goroutines started")
	require.Equal(t, int32(0), l.leaser.workers.busy.Load())
}

// TestRefillsStartNoGoroutine: a background refill at the low-water mark
// flies on the workers, as a caller's flight does; run as a clock
// callback it started a goroutine per refill.
func TestRefillsStartNoGoroutine(t *testing.T) {
	// Far below its limit, in company: leases of 1 ms of demand,
	// hundreds of refills a second.
	lim := Limit{Rate: 1e8, Period: time.Second, Burst: 1e7}
	l, err := New(remote.NewRedis(standaloneDial(t)), runPolicy("refills", lim), quiet, WithStoreTimeout(time.Minute),
		WithRefillHorizon(time.Millisecond), WithFleetSize(2))
	require.NoError(t, err)
	defer l.Close(context.Background())
	ctx := context.Background()
	admitted, decided := 0, 0
	run := func(d time.Duration) {
		for end := time.Now().Add(d); time.Now().Before(end); {
			for range 100 {
				if l.Allow(ctx, "busy") {
					admitted++
				}
				decided++
			}
		}
	}
	run(200 * time.Millisecond) // warm-up: a worker starts
	before, s0 := spawn.Count(), l.Stats()
	run(time.Second)
	created, calls := spawn.Count()-before, l.Stats().StoreCalls-s0.StoreCalls
	t.Logf("%d of %d admitted; %d store calls started %d goroutines", admitted, decided, calls, created)
	require.Greater(t, calls, int64(20), "the lease is refilled in the background")
	// The limiter's tickers (sweep, heartbeat, policy reads) run a
	// few callbacks a second, each in a goroutine.
	require.LessOrEqual(t, created, uint64(calls)/10+20, "%d store calls started %d goroutines", calls, created)
}

// TestHandoutNoCallerTookIsDropped: the tokens a call brings for the
// callers waiting on it that no caller takes (one left at its store
// timeout, before or after the call landed) are dropped out of the key's
// books by the flight's last reference, their callers' demand back to
// misses, and counted as expired; a caller that stays takes its own.
func TestHandoutNoCallerTookIsDropped(t *testing.T) {
	for _, leavesFirst := range []bool{true, false} {
		t.Run(fmt.Sprintf("leaves-before-landing=%v", leavesFirst), func(t *testing.T) {
			w := newFakeWorld()
			l := w.limiter(t, Policy{Name: "handout", Limit: Limit{Rate: 10, Period: time.Second, Burst: 10}})
			e := newAccount("k")
			e.inflow.Store(2) // as granted leaves it: 2 handed, from 2 misses
			f, lead := l.leaser.flights.join(&l.leaser, e, 1)
			require.True(t, lead)
			g, lead := l.leaser.flights.join(&l.leaser, e, 1)
			require.False(t, lead)
			require.Same(t, f, g)
			expired := l.Stats().TokensExpired
			if leavesFirst {
				g.leave() // timed out while the call was under way
			}
			l.leaser.flights.finish(e.key, f, fetchOutcome{deposited: true, handout: 2}, nil)
			require.True(t, f.outcomeFor(1).handed, "the caller that stayed takes its token")
			f.leave()
			if !leavesFirst {
				require.Equal(t, int64(2), e.inflow.Load(), "dropped while a caller may still take it")
				g.leave() // timed out just as the call landed
			}
			require.Equal(t, int64(1), e.inflow.Load(), "tokens in the key's books")
			require.Equal(t, int64(1), e.misses.Load(), "the demand of the caller that left")
			require.Equal(t, int64(1), l.Stats().TokensExpired-expired)
			require.Zero(t, f.handout.Load())
		})
	}
}

// TestColdDecisionAllocations: a decision on a key the process has not
// seen, flown by its caller, allocates at most 3 times more than the
// store's lease on an unseen bucket (TestLeaseAllocationsOnRealRedis
// bounds that against go-redis's own): the key's account, its key's copy
// (the caller's string may share a larger buffer the table would keep
// alive) and the flight. The flight's channel, made for every flight
// though a caller flying its own waits on nothing, was a 4th, and
// gobreaker's two-step completion callback a 5th.
func TestColdDecisionAllocations(t *testing.T) {
	ctx := context.Background()
	c := standaloneDial(t)
	p := runPolicy("cold-allocs", Limit{Rate: 10, Period: time.Second, Burst: 10})
	l, err := New(remote.NewRedis(c), p, quiet, WithStoreTimeout(time.Minute))
	require.NoError(t, err)
	defer l.Close(context.Background())
	// The fewest of 6 batches (allocs.Fewest): one batch of 500 read 16
	// under a fresh clone's make test, 15 whenever run alone; 16 alone
	// since, and the fewest of 3 batches of 300 read 17 once under make
	// test's load (at d4a3929 as now: 16 alone; what allocates more under
	// load is not found yet).
	const batches, runs = 6, 300
	const calls = batches * (runs + 1)
	keys := make([]string, 2*calls)
	for i := range keys {
		keys[i] = fmt.Sprintf("k%d", i)
	}
	require.True(t, l.Allow(ctx, "warm"))
	decisions := allocs.Fewest(batches, runs, func(i int) {
		if !l.Allow(ctx, keys[i]) {
			t.Fatal("a cold key's first decision was refused")
		}
	})
	require.Equal(t, int64(calls+1), l.Stats().StoreCalls, "every decision is a store call")
	store := remote.NewRedis(c)
	reqs := make([]remote.Request, calls)
	for i := range reqs {
		reqs[i] = remote.Request{Prefix: l.cfg.prefix, Policy: p.Name, Key: keys[calls+i], Limit: p.Limit,
			Version: 1, N: 2, Min: 1, Need: 1}
		if l.cfg.stock { // the same request, with its record
			reqs[i].Stock = remote.Stock{Holder: l.outage.id, Spend: 1, Seq: int64(i + 1), Term: 2 * time.Second}
		}
	}
	leases := allocs.Fewest(batches, runs, func(i int) {
		if _, err := store.Lease(ctx, reqs[i]); err != nil {
			t.Fatal(err)
		}
	})
	t.Logf("cold decision: %v allocations; the store's lease alone: %v", decisions, leases)
	require.LessOrEqual(t, decisions, leases+3, "a cold decision allocates %v times, the store's lease %v", decisions, leases)
}
