package hybrid

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/leasehold/leasehold/breaker"
	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/remote"
	"github.com/leasehold/leasehold/remote/tiered"
	"github.com/stretchr/testify/require"
)

// TestStockOffThroughTiers: leases are plain, not stock, for a limiter
// over a region's store (tiered), found behind wrappers that Unwrap: its
// pools hold the parent's tokens (see regional). A wrapper that hides the
// store keeps stock on.
func TestStockOffThroughTiers(t *testing.T) {
	clk := clock.NewManual(t0)
	region, err := tiered.New("eu", remote.NewMemory(clk), remote.NewMemory(clk), tiered.WithClock(clk))
	require.NoError(t, err)
	t.Cleanup(func() { _ = region.Close() })
	mem := remote.NewMemory(clk)
	for _, tc := range []struct {
		name  string
		store remote.Store
		stock bool
	}{
		{"memory", mem, true},
		{"breaker over memory", breaker.NewStore(mem, breaker.Settings{Clock: clk}), true},
		{"tiered", region, false},
		{"breaker over tiered", breaker.NewStore(region, breaker.Settings{Clock: clk}), false},
		{"unwrapping wrapper over tiered", unwrapping{region}, false},
		{"opaque wrapper over tiered", opaque{region}, true},
		{"wrapper that unwraps to itself", selfWrap{mem}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l, err := New(tc.store, Policy{Name: "tiers", Limit: Limit{Rate: 10, Period: time.Second, Burst: 10}},
				WithClock(clk), quiet)
			require.NoError(t, err)
			defer l.Close(context.Background())
			if l.cfg.stock != tc.stock {
				t.Fatalf("stock %v over %s, want %v", l.cfg.stock, tc.name, tc.stock)
			}
		})
	}
}

// unwrapping, opaque and selfWrap wrap a store: the first says what it
// wraps, the second does not, the third says it wraps itself.
type (
	unwrapping struct{ remote.Store }
	opaque     struct{ remote.Store }
	selfWrap   struct{ remote.Store }
)

func (u unwrapping) Unwrap() remote.Store { return u.Store }
func (s selfWrap) Unwrap() remote.Store   { return s }

// TestKeySpreadBelowItsLimit: 4 limiters share one key of 100/s burst 100,
// each asked 12.5 times a second (half the limit in all). All must be
// admitted. It guards the lease
// design against schemes that hold the bound by spending the bucket faster
// than the fleet admits: leases that decay at the bucket's rate in every
// process (held ≤ granted − Rate·age, the proposal of the cold-keys issue)
// admitted 8.5% here, each process's leases decaying 8 times faster than
// it spent them and draining the bucket 4 times over.
func TestKeySpreadBelowItsLimit(t *testing.T) {
	if testing.Short() {
		t.Skip("3 s of load")
	}
	lim := Limit{Rate: 100, Period: time.Second, Burst: 100}
	// Measured 0.47 store calls per decision.
	spreadBelowLimit(t, newFleet(t, 4, runPolicy("spread", lim), standaloneDial))
}

// spreadBelowLimit offers 12.5 decisions a second to each of lims on one
// key for about 3 s, requires all but 2% admitted, and returns the store
// calls per decision.
func spreadBelowLimit(t *testing.T, lims []*Limiter) float64 {
	var offered, admitted int
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, l := range lims {
		wg.Add(1)
		go func() {
			defer wg.Done()
			tick := time.NewTicker(80 * time.Millisecond) // open loop: 12.5/s
			defer tick.Stop()
			for range 38 { // about 3 s
				<-tick.C
				ok := l.Allow(context.Background(), "spread-key")
				mu.Lock()
				offered++
				if ok {
					admitted++
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	s := fleetStats(lims)
	t.Logf("admitted %d of %d at half the limit, %.2f store calls per decision", admitted, offered, float64(s.StoreCalls)/float64(offered))
	// All, but for a first decision whose store call outlasts the store
	// timeout on a starved machine (refused: the key's level is not
	// known yet); leases that decay at the rate admitted 8.5%.
	if float64(admitted) < 0.98*float64(offered) {
		t.Fatalf("admitted %d of %d on a key at half its limit, want all (at least 98%%)", admitted, offered)
	}
	return float64(s.StoreCalls) / float64(offered)
}

// TestEdgeOfLaterWindows: keys emptied by 1 to 8 limiters in turn, then
// idle, five times over; every window spanned by two admissions is checked
// against Burst + Rate·w. No window may see more, for any fleet size,
// including a burst of 10 spread over 8 limiters (leases of level/N
// without an end to them once admitted 11 in one instant there), and
// limiters that close and give their stock back.
func TestEdgeOfLaterWindows(t *testing.T) {
	if testing.Short() {
		t.Skip("bursts and pauses")
	}
	fast := Limit{Rate: 200, Period: time.Second, Burst: 50}
	small := Limit{Rate: 10, Period: time.Second, Burst: 10}
	for _, tc := range []struct {
		n       int
		lim     Limit
		restart bool // each limiter admits at most 20, then closes and a new one takes its place
	}{
		{1, fast, false}, {2, fast, false}, {4, fast, false}, {8, fast, false}, {8, small, false},
		{1, fast, true}, {4, fast, true},
	} {
		name := fmt.Sprintf("limiters=%d/%v", tc.n, tc.lim)
		if tc.restart {
			name += "/restarts"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel() // mostly pauses; each case its own policy
			p := runPolicy("edge", tc.lim)
			lims := newFleet(t, tc.n, p, standaloneDial)
			all := slices.Clone(lims)
			most, after := 1000, func(int, *Limiter) *Limiter { return nil }
			if tc.restart {
				// Close releases a lease's record: the bucket counted its
				// tokens as held, so no window may see them twice.
				most = 20
				after = func(_ int, l *Limiter) *Limiter {
					require.NoError(t, l.Close(context.Background()))
					next := newFleet(t, 1, p, standaloneDial)[0]
					all = append(all, next)
					return next
				}
			}
			adm := burstsAndPauses(lims, "edge-key", 5, 350*time.Millisecond, most, after)
			later, _, at := worstWindow(adm, tc.lim, adm[0].asked)
			if over := overFromStart(adm, tc.lim); over > 0 {
				t.Fatalf("%d over Burst + Rate·t from the start", over)
			}
			s := fleetStats(all)
			t.Logf("%s: %d admitted, %d store calls, %d leased tokens expired, %d returned; worst window %+d tokens against Burst + Rate·w (at %v)",
				name, len(adm), s.StoreCalls, s.TokensExpired, s.TokensReturned, later, at.Round(time.Millisecond))
			if tc.restart && s.TokensReturned == 0 {
				t.Fatal("no limiter gave tokens back at Close: the case proves nothing")
			}
			if later > 0 {
				t.Fatalf("a window admitted %d more than Burst + Rate·w", later)
			}
		})
	}
}

// TestCloseReturnKeepsEveryWindow: a lease's tokens given back at Close
// under a lease someone took after must not let a window see them twice.
// A (alone) admits from a full bucket of 10 at 10/s until its lease keeps
// a token for its next decision; 500 ms later B leases from what
// refilled; A closes, releasing its record; 450 ms later B spends what it
// holds and a third limiter drains the bucket. Under decaying leases an
// unconditional return made a window 4 over Burst + Rate·w here (16
// admitted); a stock record's release gives back only what the bucket
// counted as held, and no window is over.
func TestCloseReturnKeepsEveryWindow(t *testing.T) {
	t.Parallel()
	lim := Limit{Rate: 10, Period: time.Second, Burst: 10}
	a, b, c := loneTrio(t, "close-window", lim)
	ctx := context.Background()
	var adm []admission
	admit := admitOn(&adm)
	held := int64(0)
	for range 8 { // until its lease keeps a token for its next decision
		admit(a, 1)
		quiesce(t, a)
		if held = a.keys.load("k").lease.Tokens(); held > 0 {
			break
		}
	}
	time.Sleep(500 * time.Millisecond)
	admit(b, 1)
	took := time.Now()
	require.NoError(t, a.Close(ctx))
	time.Sleep(time.Until(took.Add(450 * time.Millisecond)))
	admit(b, 100)
	admit(c, 100)
	worst, _, at := worstWindow(adm, lim, adm[0].asked)
	t.Logf("%d admitted; A held %d at Close; worst window %+d against Burst + Rate·w (at %v)",
		len(adm), held, worst, at.Round(time.Millisecond))
	require.Positive(t, held, "A closed holding nothing: the case proves nothing")
	require.LessOrEqual(t, worst, int64(0), "a window over Burst + Rate·w")
}

// loneTrio returns three limiters of a policy of lim on standalone Redis,
// each counting itself alone in the fleet (WithFleetSize(1)): each takes
// a bucket's whole level as its lease.
func loneTrio(t *testing.T, name string, lim Limit, opts ...Option) (a, b, c *Limiter) {
	lims := newFleet(t, 3, runPolicy(name, lim), standaloneDial, append([]Option{WithFleetSize(1)}, opts...)...)
	return lims[0], lims[1], lims[2]
}

// admitOn returns a function that has a limiter admit one token at a
// time on key "k", until refused or most times, adding each admission to
// *adm.
func admitOn(adm *[]admission) func(l *Limiter, most int) {
	return func(l *Limiter, most int) {
		for range most {
			asked := time.Now()
			if d, err := l.AllowN(context.Background(), "k", 1); err != nil || !d.Allowed {
				return
			}
			*adm = append(*adm, admission{asked, time.Now()})
		}
	}
}

// burstsAndPauses has each limiter in turn admit on key until refused (at
// most most times), then hands it to after, which may put another in its
// place (nil: none); then pauses, rounds times, and returns every
// admission.
func burstsAndPauses(lims []*Limiter, key string, rounds int, pause time.Duration, most int, after func(i int, l *Limiter) *Limiter) []admission {
	ctx := context.Background()
	var adm []admission
	for range rounds {
		for i, l := range lims {
			for range most {
				asked := time.Now()
				d, err := l.AllowN(ctx, key, 1)
				if err != nil || !d.Allowed {
					break
				}
				adm = append(adm, admission{asked, time.Now()})
			}
			if next := after(i, l); next != nil {
				lims[i] = next
			}
		}
		time.Sleep(pause) // the leases sit idle
	}
	return adm
}

// overFromStart returns how far the admissions from the first one exceed
// Burst + Rate·t at worst, each prefix timed to its latest answer (≤ 0:
// never).
func overFromStart(adm []admission, lim Limit) int64 {
	first := adm[0].asked
	var last time.Time
	worst := -lim.Burst
	for i, a := range adm {
		if a.answered.After(last) {
			last = a.answered
		}
		worst = max(worst, int64(i+1)-lim.Burst-lim.TokensIn(last.Sub(first)))
	}
	return worst
}

// TestLoneProcessReservesFourFifths: a key at its limit is granted paced
// future-dated tokens, this process's share of half the maximum
// reservation; a process alone takes four fifths of it, whose next grant,
// asked for when a quarter is left, still fits the horizon: fewer store
// calls per token at the limit.
func TestLoneProcessReservesFourFifths(t *testing.T) {
	lim := Limit{Rate: 10, Period: time.Second, Burst: 10} // 100 ms a token
	for _, tc := range []struct {
		name  string
		fleet int
		want  int64 // tokens of the first reservation, at the 500 ms default
	}{
		{"alone", 1, 4}, // 400 ms (250 ms before: 2)
		// 250 ms / 2 is 1 token: the lease's own size (a token and a
		// spare) is more.
		{"one of 2", 2, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newFakeWorld()
			l := w.limiter(t, Policy{Name: "share", Limit: lim}, WithFleetSize(tc.fleet), lenient)
			ctx := context.Background()
			for range 40 {
				if l.Stats().TokensReserved > 0 {
					break
				}
				l.Allow(ctx, "hot")
			}
			if got := l.Stats().TokensReserved; got != tc.want {
				t.Fatalf("first reservation %d tokens, want %d", got, tc.want)
			}
		})
	}
}
