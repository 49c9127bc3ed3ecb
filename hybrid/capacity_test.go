package hybrid

import (
	"context"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/internal/testkit/storetest"
	"github.com/leasehold/leasehold/local"
	"github.com/leasehold/leasehold/remote"
	"github.com/stretchr/testify/require"
)

// TestGrantAdmitsSurviveEviction: Stats never counts fewer grant
// admissions than before, even once the key that made them is forgotten
// (a fresh entry for the key starts its count at 0; a test beside a CPU
// hog saw the fleet's grant admissions go down by hundreds).
func TestGrantAdmitsSurviveEviction(t *testing.T) {
	l := grantLimiterOf(t)
	ctx := context.Background()
	for range 10 {
		if d, _ := l.AllowN(ctx, "hot", 1); d.Source != SourceGrant {
			t.Fatalf("decision %+v, want the grant's", d)
		}
	}
	before := l.Stats()
	if !l.keys.evict(l.keys.load("hot")) {
		t.Fatal("evict found no entry")
	}
	after := l.Stats()
	if g := after.Source(SourceGrant).Admitted; g != before.Source(SourceGrant).Admitted || g != 10 {
		t.Fatalf("grant admissions %d after eviction, %d before; want 10", g, before.Source(SourceGrant).Admitted)
	}
	if after.Admitted != before.Admitted {
		t.Fatalf("admitted %d after eviction, %d before", after.Admitted, before.Admitted)
	}
}

// TestGrantRetryAfterIsForN: a refusal by a key's grant names the wait for
// the caller's n, not for the next token: asking again after exactly
// RetryAfter is admitted, a microsecond sooner is not (the grant's GCRA
// at 20/s, burst 5; nobody else spends it).
func TestGrantRetryAfterIsForN(t *testing.T) {
	l := grantLimiterOf(t)
	clk := l.cfg.clk.(*clock.Manual)
	b, err := local.NewBucket(local.Limit{Rate: 20, Period: time.Second, Burst: 5})
	require.NoError(t, err)
	e := l.keys.load("hot")
	// The bucket is known dry for good: a refusal by the grant stands,
	// with no stock asked for after it (Limiter.stockAfterGrant).
	e.answer.refuse(1, mono(math.MaxInt64))
	e.extra().grant.held.Store(&holding{bucket: b, share: 1, until: mono(math.MaxInt64)})
	ctx := context.Background()
	b.SetTokens(int64(l.cfg.now()), 5)
	for range 5 {
		d, _ := l.AllowN(ctx, "hot", 1)
		require.True(t, d.Allowed && d.Source == SourceGrant, "%+v", d)
	}
	for _, n := range []int64{1, 2, 3, 5} {
		d, _ := l.AllowN(ctx, "hot", n)
		require.False(t, d.Allowed, "n=%d admitted on an empty grant", n)
		require.Equal(t, SourceGrant, d.Source)
		want := time.Duration(n) * 50 * time.Millisecond
		require.InDelta(t, float64(want), float64(d.RetryAfter), float64(time.Millisecond), "n=%d: RetryAfter %v, want the wait for n, %v", n, d.RetryAfter, want)
		clk.Advance(d.RetryAfter - time.Microsecond)
		early, _ := l.AllowN(ctx, "hot", n)
		require.False(t, early.Allowed, "n=%d admitted a microsecond before RetryAfter", n)
		clk.Advance(time.Microsecond)
		again, _ := l.AllowN(ctx, "hot", n)
		require.True(t, again.Allowed, "n=%d refused after exactly RetryAfter: %+v", n, again)
	}
}

// TestFirstGrantAskCountsTheFleet: processes started together each
// counted, in New, only the peers announced before it. A newborn
// limiter's first grant ask counts the fleet again, so it wants an even
// part of the four (256 of 1 024 units), not the whole rate that kept the
// others waiting for its re-ask (4 OS processes at the limit: 3.5–4.8
// bucket calls per 1 000 admitted, 2.6–3.1 with the recount).
func TestFirstGrantAskCountsTheFleet(t *testing.T) {
	w := newFakeWorld()
	p := Policy{Name: "first-ask", Limit: PerSecond(1000)}
	l := w.limiter(t, p, WithCapacityLeases(15*time.Second))
	ctx := context.Background()
	require.True(t, l.Allow(ctx, "hot"))
	w.clk.Advance(time.Nanosecond) // New's first heartbeat is due at once
	eventually(t, "the first heartbeat", func() bool { return l.outage.countedAt.Load() != 0 })
	for i := range 3 { // peers that started just after l
		_, err := w.store.Heartbeat(ctx, l.cfg.prefix, p.Name, fmt.Sprintf("peer-%d", i), l.cfg.hbExpiry)
		require.NoError(t, err)
	}
	if got := l.grants.fleetSize(); got != 1 {
		t.Fatalf("fleet counted: %d, want 1 (the peers came after)", got)
	}
	w.clk.Advance(2 * recountWithin)
	e := l.keys.load("hot")
	e.extra().grant.hotFrom.Store(1)
	l.grants.ask(e)
	h := e.held()
	require.NotNil(t, h, "no grant after the first ask")
	if want := int64(remote.GrantUnits / 4); h.share != want {
		t.Fatalf("first grant share %d units, want an even part of the 4 counted, %d", h.share, want)
	}
}

// holderOf returns a limiter of a fake world under policy name (1 000/s,
// capacity leases of a 15 s term) whose key "hot" holds a grant.
func holderOf(t *testing.T, name string, opts ...Option) (*fakeWorld, *Limiter, *account) {
	t.Helper()
	w := newFakeWorld()
	l := w.limiter(t, Policy{Name: name, Limit: PerSecond(1000)}, append([]Option{WithCapacityLeases(15 * time.Second)}, opts...)...)
	require.True(t, l.Allow(context.Background(), "hot"))
	e := l.keys.load("hot")
	e.extra().grant.hotFrom.Store(1)
	l.grants.ask(e)
	require.NotNil(t, e.held(), "no grant after the ask")
	return w, l, e
}

// TestHolderLeasesNothing: once a key holds a grant, its lease flights make
// no store call, whether a background refill (the tokens leased before the
// grant ran low) or a caller's flight that started before the grant came
// and ran after. Each found the bucket emptied by the grants: 4 OS
// processes at the limit made one such call per process, 2.9 bucket calls
// per 1 000 admitted, 2.1–2.3 without.
func TestHolderLeasesNothing(t *testing.T) {
	_, l, e := holderOf(t, "holder")
	ctx := context.Background()
	calls := l.Stats().StoreCalls
	for _, need := range []int64{0, 1} {
		out, err := l.leaser.fetch(ctx, e, need)
		require.NoError(t, err)
		require.True(t, out.deposited, "need %d: %+v, want the caller sent back to its grant", need, out)
		if got := l.Stats().StoreCalls; got != calls {
			t.Fatalf("need %d: a holder's lease flight made %d store calls", need, got-calls)
		}
	}
	d, err := l.AllowN(ctx, "hot", 1)
	require.NoError(t, err)
	require.Equal(t, SourceGrant, d.Source, "%+v", d)
	// n past the grant's burst is the lease's to serve: it still asks.
	d, err = l.AllowN(ctx, "hot", e.held().bucket.Limit().Burst+1)
	require.NoError(t, err)
	require.NotEqual(t, SourceGrant, d.Source, "%+v", d)
	require.Greater(t, l.Stats().StoreCalls, calls, "n past the grant's burst made no store call")
}

// TestStockServesWhatFlowCannot: under stock records a decision the key's
// grant has no tokens for is the bucket's to serve while the store
// answers. Once the store call fails, the grant's refusal stands: a holder
// cut off spends its grant and nothing else, where the degraded share
// would admit on top of the others' grants (2 of 6 cut off at twice the
// limit: +30.9% during the cut, -1.2% with it).
func TestStockServesWhatFlowCannot(t *testing.T) {
	w := newFakeWorld()
	cut := &storetest.Cut{Store: w.store}
	l, err := New(cut, Policy{Name: "flow-stock", Limit: PerSecond(1000)}, quiet, WithClock(w.clk), lenient, WithCapacityLeases(15*time.Second), WithFleetSize(4))
	require.NoError(t, err)
	defer l.Close(context.Background())
	ctx := context.Background()
	require.True(t, l.Allow(ctx, "hot"))
	e := l.keys.load("hot")
	e.extra().grant.hotFrom.Store(1)
	l.grants.ask(e)
	h := e.held()
	require.NotNil(t, h, "no grant after the ask")
	w.clk.Advance(time.Millisecond)
	h.bucket.Drain(int64(l.cfg.now()))

	d, err := l.AllowN(ctx, "hot", 1)
	require.NoError(t, err)
	require.True(t, d.Allowed, "the bucket has tokens: %+v", d)
	require.Equal(t, SourceRemote, d.Source, "served by a stock lease")

	// The lease's tokens spent and the grant dry: the store is cut off.
	for l.leaser.spend(e, 1, l.spendAt()); e.live(l.spendAt()) > 0; l.leaser.spend(e, 1, l.spendAt()) {
	}
	w.clk.Advance(10 * time.Millisecond) // past any refusal cached meanwhile
	h.bucket.Drain(int64(l.cfg.now()))
	// The store's last answer refused as many: the grant's refusal
	// stands, with no store call (a flood on a key at its limit: 3.04×
	// x/time/rate a decision going on to the stock each time, 1.24× not).
	e.answer.refuse(1, l.cfg.now().add(time.Millisecond))
	calls := l.Stats().StoreCalls
	d, err = l.AllowN(ctx, "hot", 1)
	require.NoError(t, err)
	require.False(t, d.Allowed)
	require.Equal(t, SourceGrant, d.Source, "%+v", d)
	require.Equal(t, calls, l.Stats().StoreCalls, "a store call past a cached refusal")
	w.clk.Advance(time.Millisecond)
	h.bucket.Drain(int64(l.cfg.now()))
	cut.Down.Store(true)
	errs := l.Stats().StoreErrors
	for i := range 20 {
		d, err = l.AllowN(ctx, "hot", 1)
		require.NoError(t, err)
		require.False(t, d.Allowed, "decision %d admitted while cut off with the grant dry: %+v", i, d)
		require.Equal(t, SourceGrant, d.Source, "decision %d: %+v", i, d)
	}
	require.Zero(t, l.Stats().Source(SourceDegraded).Admitted)
	require.Greater(t, l.Stats().StoreErrors, errs, "no store call was tried")
	// The grant refills at its rate and admits while cut off.
	w.clk.Advance(100 * time.Millisecond)
	d, err = l.AllowN(ctx, "hot", 1)
	require.NoError(t, err)
	require.True(t, d.Allowed, "%+v", d)
	require.Equal(t, SourceGrant, d.Source)
}

// TestStockAsksForFlowAtTheLimit: under stock records a key asks for flow
// only when its bucket came back dry and this process's sustained demand
// is at least an even part of the rate (a fleet of 4 on a key of
// 1 000/s: 250/s), whether its own lease call was refused or not: at once
// from 3 even parts, else once the bucket has stayed dry for
// stockFlowDryFor (flow taken at an even part on the first dry answer
// split the burst of keys below their limit). Below an even part, stock
// serves the fleet's uneven demand. A holder whose demand falls below
// three quarters of an even part gives its flow back at the next renewal.
// Each grant asks for an even part of Burst (250). A fleet larger than
// the grants a bucket keeps (32 under stock) holds no flow.
func TestStockAsksForFlowAtTheLimit(t *testing.T) {
	for _, tc := range []struct {
		name   string
		level  int64   // the last answer's
		mean   float32 // tokens a second
		dryFor time.Duration
		refuse bool // the key's lease call was refused, others holding flow
		asks   bool
	}{
		{"below the limit", 100, 1000, time.Second, false, false},
		{"at the limit, under an even part", 0, 200, time.Second, false, false},
		{"at the limit a moment, an even part", 0, 250, 0, false, false},
		{"at the limit a moment, 1.5 even parts", 0, 375, stockFlowDryFor / 2, false, false},
		{"at the limit a moment, 3 even parts", 0, 750, 0, false, true},
		{"at the limit for a while, an even part", 0, 250, stockFlowDryFor, false, true},
		{"at the limit for a while, 1.5 even parts", 0, 375, time.Second, false, true},
		{"refused, under an even part", 0, 200, 0, true, false},
		{"refused, an even part", 0, 250, 0, true, true},
		// Past the 32 grants a bucket keeps under stock records, flow
		// would leave most of the fleet on stock a token a lease.
		{"a fleet of 40, 1.5 even parts", 0, 40, time.Second, false, false},
		{"a fleet of 40, refused", 0, 40, 0, true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newFakeWorld()
			fleet := 4
			if strings.HasPrefix(tc.name, "a fleet of 40") {
				fleet = 40
			}
			l := w.limiter(t, Policy{Name: "flow-ask", Limit: PerSecond(1000)}, lenient, WithCapacityLeases(15*time.Second), WithFleetSize(fleet))
			require.True(t, l.Allow(context.Background(), "k"))
			e := l.keys.load("k")
			e.mu.Lock()
			e.demand.mean = tc.mean
			e.mu.Unlock()
			e.answer.level.Store(tc.level)
			p := l.policy.load()
			if tc.refuse {
				l.grants.refused(e, p, 1, l.cfg.now())
			} else {
				// The store's answers say the same for dryFor: the first
				// lease call, then the one this decision makes.
				l.grants.consider(e, p, float64(tc.mean), l.cfg.now())
				if tc.dryFor > 0 {
					w.clk.Advance(tc.dryFor)
					l.grants.consider(e, p, float64(tc.mean), l.cfg.now())
				}
				l.grants.leased(e) // it asks once the lease call under way lands
			}
			eventually(t, "the grant call to end", func() bool { return !e.extra().grant.asking.Load() })
			if got := e.held() != nil; got != tc.asks {
				t.Fatalf("holds a grant: %v, want %v", got, tc.asks)
			}
			if !tc.asks {
				return
			}
			require.Equal(t, int64(250), e.held().bucket.Limit().Burst, "an even part of Burst")
			// Demand gone below three quarters of an even part: the
			// renewal gives it back.
			e.mu.Lock()
			e.demand.mean = 150
			e.mu.Unlock()
			now := l.cfg.now()
			l.grants.consider(e, p, 150, now)
			l.grants.ask(e)
			require.Nil(t, e.held(), "the flow was not given back")
		})
	}
}

// TestDemandIsCountedOneWay: a key's demand estimate is fed by the lease
// sizing and by each grant renewal, and both must count the same thing:
// tokens. Renewals used to count a grant's admissions in decisions on
// top of what the lease sizing counted, so the count the estimate saw
// jumped at each renewal and fell back at the next sizing: a holder
// asking 300 tokens a second asked for the whole rate (4 holders at
// 0.9× a key's limit wanted 1 024, 922, 256 and 231 units where their
// demand was 230 each).
func TestDemandIsCountedOneWay(t *testing.T) {
	w, l, e := holderOf(t, "demand")
	ctx := context.Background()
	const n, every = 3, 10 * time.Millisecond // 300 tokens a second
	for step := range 300 {
		w.clk.Advance(every)
		d, err := l.AllowN(ctx, "hot", n)
		require.NoError(t, err)
		require.True(t, d.Allowed, "step %d: %+v", step, d)
		l.leaser.sizeLease(e, l.policy.load(), 0, l.cfg.now())
		if step%10 == 9 {
			l.grants.ask(e)
		}
	}
	e.mu.Lock()
	rate, mean := float64(e.demand.rate), float64(e.demand.mean)
	e.mu.Unlock()
	t.Logf("demand rate %.0f, mean %.0f tokens/s; %d decisions by grants", rate, mean, e.grantAdmits())
	// The mean is what a renewal asks for (the fast-attack rate sizes
	// leases, and keeps a burst for a while).
	if mean < 250 || mean > 350 {
		t.Errorf("demand mean %.0f tokens/s, want about 300", mean)
	}
	req := l.grants.request(e, l.policy.load(), e.held())
	if want := int64(math.Ceil(300 * grantHeadroom / 1000 * remote.GrantUnits)); req.Want > want*6/5 {
		t.Errorf("a renewal wants %d units, want about %d (300 of 1 000/s, with headroom)", req.Want, want)
	}
}

// TestFlowAskRidesTheLeaseCall: under stock records a key found at its
// limit asks for flow once the lease call that found it lands, with no
// timer between. It was asked on a 5 ms timer that each later lease
// call re-armed: with callers spinning on refusals the timer kept
// losing the CPU, and 4 processes at a key's limit asked 40–260 ms late,
// a lease call every 5 ms each meanwhile (95 bucket calls in a 5 s
// at-limit run, 48 since).
func TestFlowAskRidesTheLeaseCall(t *testing.T) {
	w := newFakeWorld()
	l := w.limiter(t, Policy{Name: "flow-rides", Limit: PerSecond(1000)}, WithFleetSize(4))
	ctx := context.Background()
	require.True(t, l.Allow(ctx, "k"))
	e := l.keys.load("k")
	e.lease.Drain()
	e.mu.Lock()
	e.demand.mean = 800 // over 3 even parts (250/s): flow on the first dry answer
	e.mu.Unlock()
	e.answer.level.Store(0)
	// The clock stands still: only the lease call can start the ask.
	l.Allow(ctx, "k")
	eventually(t, "the flow", func() bool { return e.held() != nil })
}

// TestSlowPathCountsDemandOnce: a request the lease cannot serve is
// counted in the key's demand as asked for; when a lease call then fills
// the lease and the request spends from it (a sliding window's lease, or
// a lease another caller's call brought), that spending must replace the
// first count, not add to it. Counted twice, 4 processes at 0.9× a key's
// limit measured more than their demand.
func TestSlowPathCountsDemandOnce(t *testing.T) {
	w := newFakeWorld()
	l := w.limiter(t, Policy{Name: "once", Limit: Limit{Rate: 200, Period: time.Second, Burst: 200}, Algorithm: SlidingWindow}, WithFleetSize(4))
	ctx := context.Background()
	require.True(t, l.Allow(ctx, "k"))
	e := l.keys.load("k")
	for i := range 20 {
		w.clk.Advance(100 * time.Millisecond)
		e.lease.Drain() // the next request takes the slow path
		before := e.demandCount()
		d, err := l.AllowN(ctx, "k", 3)
		require.NoError(t, err)
		require.True(t, d.Allowed, "request %d: %+v", i, d)
		if got := e.demandCount() - before; got != 3 {
			t.Fatalf("request %d of 3 tokens, served by a lease call: demand counted %d", i, got)
		}
	}
}
