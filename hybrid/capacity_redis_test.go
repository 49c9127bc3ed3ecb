package hybrid

import (
	"context"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leasehold/leasehold/internal/testkit/storetest"
	"github.com/leasehold/leasehold/remote"
	"github.com/stretchr/testify/require"
)

// sourced is an admission and what decided it.
type sourced struct {
	admission
	src Source
}

// spinAll runs g goroutines per limiter calling AllowN on key until stop
// is closed, and returns every admission, whatever decided it.
func spinAll(lims []*Limiter, g int, key string, stop <-chan struct{}) func() []sourced {
	var mu sync.Mutex
	var all []sourced
	var wg sync.WaitGroup
	var done atomic.Bool
	go func() { <-stop; done.Store(true) }()
	for _, l := range lims {
		for range g {
			wg.Add(1)
			go func() {
				defer wg.Done()
				var mine []sourced
				for !done.Load() {
					asked := time.Now()
					if d, _ := l.AllowN(context.Background(), key, 1); d.Allowed {
						mine = append(mine, sourced{admission{asked, time.Now()}, d.Source})
						continue
					}
					runtime.Gosched()
				}
				mu.Lock()
				all = append(all, mine...)
				mu.Unlock()
			}()
		}
	}
	return func() []sourced {
		wg.Wait()
		slices.SortFunc(all, func(a, b sourced) int { return a.asked.Compare(b.asked) })
		return all
	}
}

func admissionsOf(s []sourced) []admission {
	out := make([]admission, len(s))
	for i, x := range s {
		out[i] = x.admission
	}
	return out
}

// between counts the admissions asked in [from, to).
func between(s []sourced, from, to time.Time) (n int64, bySource map[Source]int64) {
	bySource = map[Source]int64{}
	for _, x := range s {
		if !x.asked.Before(from) && x.asked.Before(to) {
			n++
			bySource[x.src]++
		}
	}
	return n, bySource
}

// TestCapacityLeasesAtLimit: 4 limiters with their own clients, 16
// goroutines each, hammer one key of 2 000/s burst 200 for 6 s, with
// capacity leases. Grants keep the bound in every window; the first 4 s,
// start-up included, cost about 3 store calls per 1 000 admitted; once
// every limiter holds its grant (from 2 s on) they use ≥ 95% of the bound
// and cost at most 3 store calls per 1 000 admitted. Over the first 4 s
// the start-up's stock leases, from a bucket its 4 processes drain at
// once, cost more (measured 4.9–5.9 per 1 000 idle, 6.1–6.7 beside two
// CPU hogs), and 2.1–2.4 once held.
func TestCapacityLeasesAtLimit(t *testing.T) {
	if testing.Short() {
		t.Skip("4 s of load per case")
	}
	lim := Limit{Rate: 2000, Period: time.Second, Burst: 200}
	cases := backends("grant-at-limit", "tenant:{9}:grant")
	for i := range cases {
		cases[i].firstMost = 12
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			lims := newFleet(t, 4, runPolicy("grants-"+tc.name, lim), tc.dial, append(tc.opts, WithCapacityLeases(10*time.Second))...)
			stop := make(chan struct{})
			start := time.Now()
			collect := spinAll(lims, 16, tc.key, stop)
			time.Sleep(2 * time.Second)
			steadyAt, callsAt := time.Now(), fleetStats(lims).StoreCalls
			grantsAt := make([]int64, len(lims))
			for i, l := range lims {
				grantsAt[i] = l.Stats().Source(SourceGrant).Admitted
			}
			time.Sleep(2 * time.Second)
			firstAt, firstCalls := time.Now(), fleetStats(lims).StoreCalls
			time.Sleep(2 * time.Second)
			close(stop)
			adm := collect()
			end := time.Now()
			s := fleetStats(lims)
			firstN, _ := between(adm, start, firstAt)
			firstK := 1000 * float64(firstCalls) / float64(firstN)
			t.Logf("%s: the first %v, start-up included: %d admitted of bound %d (%.1f%%), %d store calls = %.2f per 1000 admitted",
				tc.name, firstAt.Sub(start).Round(time.Millisecond), firstN, lim.Burst+lim.TokensIn(firstAt.Sub(start)),
				100*float64(firstN)/float64(lim.Burst+lim.TokensIn(firstAt.Sub(start))), firstCalls, firstK)
			// The target is 3 (measured 2.3–3.0 on an idle machine);
			// beside make test's parallel load a slow renewal or a
			// starved first ask costs a few more (3.6 measured beside a
			// CPU hog): the slack is twice the target.
			if most := max(tc.firstMost, 6); firstK > most {
				t.Fatalf("%.2f store calls per 1000 admitted in the first 4 s, want ≤ %.0f under load", firstK, most)
			}
			got, bound := int64(len(adm)), lim.Burst+lim.TokensIn(end.Sub(start))
			perK := 1000 * float64(s.StoreCalls) / float64(got)
			worst, _, at := worstWindow(admissionsOf(adm), lim, start)
			steadyN, by := between(adm, steadyAt, end)
			steadyBound := lim.TokensIn(end.Sub(steadyAt))
			steadyK := 1000 * float64(s.StoreCalls-callsAt) / float64(steadyN)
			t.Logf("%s: whole run: admitted %d of bound %d (%.1f%%), %d store calls = %.2f per 1000 admitted; from 2 s on: %d of %d (%.1f%%), %.2f store calls per 1000, by source %v; worst window %+d tokens vs its bound (at %v)",
				tc.name, got, bound, 100*float64(got)/float64(bound), s.StoreCalls, perK,
				steadyN, steadyBound, 100*float64(steadyN)/float64(steadyBound), steadyK, by, worst, at.Round(time.Millisecond))
			if worst > 0 {
				t.Fatalf("a window admitted %d more than Burst + Rate·w", worst)
			}
			// Under-use once grants are held: 99.7% idle, 94.8% beside
			// make test's parallel load on 2 cores; the floor is 90%.
			if float64(steadyN) < 0.90*float64(steadyBound) {
				t.Fatalf("admitted %d < 90%% of Rate·w = %d once grants are held", steadyN, steadyBound)
			}
			if steadyK > 3 {
				t.Fatalf("%.2f store calls per 1000 admitted once grants are held, want ≤ 3", steadyK)
			}
			if by[SourceGrant] < steadyN*9/10 {
				t.Fatalf("grants decided %d of %d admissions once held", by[SourceGrant], steadyN)
			}
			// Equal demand, equal grants: each limiter's grant admissions
			// from 2 s on within 5% of the mean when the machine is idle
			// (measured within 0.1%); 15% under make test's parallel
			// load, where one limiter's renewals can lag (measured 7.8%).
			// The default divides by measured demand, and a limiter
			// starved of CPU there measures and asks less (-20.7% once
			// under that load): 25%.
			fair := 0.15
			if tc.opts == nil {
				fair = 0.25
			}
			per := make([]int64, len(lims))
			var sum int64
			for i, l := range lims {
				per[i] = l.Stats().Source(SourceGrant).Admitted - grantsAt[i]
				sum += per[i]
			}
			mean := float64(sum) / float64(len(per))
			t.Logf("grant admissions per limiter from 2 s on %v", per)
			for i, n := range per {
				if d := float64(n)/mean - 1; d > fair || d < -fair {
					t.Fatalf("limiter %d: %d grant admissions, %+.1f%% off the mean", i, n, 100*d)
				}
			}
			// Close gives every grant back at once.
			for _, l := range lims {
				require.NoError(t, l.Close(context.Background()))
			}
			res, err := remote.NewRedis(tc.dial(t)).Return(context.Background(), remote.Request{Policy: lims[0].Policy().Name,
				Key: tc.key, Limit: lim, Version: lims[0].Policy().Version, N: 1})
			require.NoError(t, err)
			if res.Holders != 0 {
				t.Fatalf("%d grants left in the bucket after every limiter closed", res.Holders)
			}
		})
	}
}

// TestCapacityLeasesPartition: 6 limiters share a key of 1 000/s burst
// 100 on one real Redis, each at more than the whole limit. Two of them
// are cut off from Redis for 4 s, shorter than the 10 s term, while the
// other four keep it. The cut-off ones spend their grants; the bucket
// refills the others with what the grants leave: no window over the
// bound, before, during or after the cut.
func TestCapacityLeasesPartition(t *testing.T) {
	if testing.Short() {
		t.Skip("9 s of load")
	}
	lim := Limit{Rate: 1000, Period: time.Second, Burst: 100}
	c := standaloneDial(t)
	cuts := make([]*storetest.Cut, 6)
	lims := make([]*Limiter, 6)
	p := runPolicy("partition", lim)
	for i := range lims {
		cuts[i] = &storetest.Cut{Store: remote.NewRedis(c)}
		l, err := New(cuts[i], p, quiet, WithCapacityLeases(10*time.Second), WithFleetSize(6))
		require.NoError(t, err)
		lims[i] = l
		t.Cleanup(func() { _ = l.Close(context.Background()) })
	}
	stop := make(chan struct{})
	start := time.Now()
	collect := spinAll(lims, 4, "partitioned", stop)
	time.Sleep(5 * time.Second)
	cutAt := time.Now()
	cuts[0].Down.Store(true)
	cuts[1].Down.Store(true)
	time.Sleep(4 * time.Second)
	healAt := time.Now()
	cuts[0].Down.Store(false)
	cuts[1].Down.Store(false)
	time.Sleep(2 * time.Second)
	close(stop)
	adm := collect()
	end := time.Now()

	during, by := between(adm, cutAt, healAt)
	duringBound := lim.Burst + lim.TokensIn(healAt.Sub(cutAt))
	total := int64(len(adm))
	totalBound := lim.Burst + lim.TokensIn(end.Sub(start))
	worst, settled, at := worstWindow(admissionsOf(adm), lim, start.Add(time.Second))
	t.Logf("cut 2 of 6 for %v: admitted %d during the cut against a bound of %d (%+.2f%%), by source %v; whole run %d of %d (%.1f%%); worst window %+d (at %v), %+d after the first second",
		healAt.Sub(cutAt).Round(time.Millisecond), during, duringBound, 100*float64(during-duringBound)/float64(duringBound), by,
		total, totalBound, 100*float64(total)/float64(totalBound), worst, at.Round(time.Millisecond), settled)
	if float64(during) > 1.01*float64(duringBound) {
		t.Fatalf("admitted %d during the cut, over the bound %d by more than 1%%", during, duringBound)
	}
	if float64(total) < 0.95*float64(totalBound) {
		t.Fatalf("admitted %d of %d: under 95%%", total, totalBound)
	}
	if by[SourceDegraded] > 0 {
		t.Fatalf("%d decided by the degraded share: a grant should have served the cut-off limiters", by[SourceDegraded])
	}
	if settled > 0 {
		t.Fatalf("a window after the first second admitted %d over Burst + Rate·w", settled)
	}
	_ = fmt.Sprint
}

// grantedShare is the part of the rate the fleet's live grants hold
// together.
func grantedShare(lims []*Limiter) float64 {
	var units int64
	for _, l := range lims {
		l.keys.each(func(e *account) {
			if h := e.held(); h != nil {
				units += h.share
			}
		})
	}
	return float64(units) / remote.GrantUnits
}

// cutFleet is n limiters on one real Redis, each behind its own Cut, with
// capacity leases of the given term.
func cutFleet(t *testing.T, n int, p Policy, term time.Duration, opts ...Option) ([]*Limiter, []*storetest.Cut) {
	t.Helper()
	c := standaloneDial(t)
	cuts := make([]*storetest.Cut, n)
	lims := make([]*Limiter, n)
	for i := range lims {
		cuts[i] = &storetest.Cut{Store: remote.NewRedis(c)}
		l, err := New(cuts[i], p, append([]Option{quiet, WithCapacityLeases(term)}, opts...)...)
		require.NoError(t, err)
		lims[i] = l
		t.Cleanup(func() { _ = l.Close(context.Background()) })
	}
	return lims, cuts
}

// TestCapacityLeasesFullOutage: 4 limiters at their limit lose Redis
// together for 4 s, shorter than the 10 s term. Each keeps admitting by its
// grant: once the grants cover the rate, the fleet admits it within 2%
// (10% under, for CPU starvation under make test), with no heartbeat
// count (the fleet size is never configured), nothing decided by the
// degraded share and nothing to charge afterwards.
func TestCapacityLeasesFullOutage(t *testing.T) {
	if testing.Short() {
		t.Skip("7 s of load")
	}
	lim := Limit{Rate: 1000, Period: time.Second, Burst: 100}
	lims, cuts := cutFleet(t, 4, runPolicy("full-outage", lim), 10*time.Second)
	stop := make(chan struct{})
	collect := spinAll(lims, 4, "outage", stop)
	time.Sleep(3 * time.Second)
	// The first grants are sized by the demand each holder measured before
	// it had one; under make test's parallel load that can be short of the
	// rate (once in CI the fleet admitted 62.6% of the rate during the cut, all of it by grants), and the renewal a third of a term later
	// fills it. The outage is what is measured here, so it begins once the
	// grants cover the rate.
	eventually(t, "the grants to cover the rate", func() bool { return grantedShare(lims) >= 0.98 })
	granted := grantedShare(lims)
	cutAt := time.Now()
	for _, c := range cuts {
		c.Down.Store(true)
	}
	time.Sleep(4 * time.Second)
	healAt := time.Now()
	close(stop)
	adm := collect()
	for _, c := range cuts {
		c.Down.Store(false)
	}
	during, by := between(adm, cutAt, healAt)
	want := lim.TokensIn(healAt.Sub(cutAt))
	debt := fleetStats(lims).OutageDebt
	t.Logf("all 4 cut for %v with %.1f%% of the rate granted: admitted %d, Rate·w %d (%+.2f%%), by source %v, outage debt %d",
		healAt.Sub(cutAt).Round(time.Millisecond), 100*granted, during, want, 100*float64(during-want)/float64(want), by, debt)
	// Over is the bound and must never happen; under is a holder starved
	// of CPU by make test's parallel load while its grant refills.
	if d := float64(during-want) / float64(want); d > 0.02 || d < -0.10 {
		t.Fatalf("admitted %d during the outage, %+.2f%% off the limit's %d", during, 100*d, want)
	}
	if by[SourceDegraded] != 0 || debt != 0 {
		t.Fatalf("%d decided by the degraded share, debt %d: grants should have served", by[SourceDegraded], debt)
	}
}

// TestCapacityLeasesCrash: one of 4 limiters at the limit crashes (it
// stops deciding and never gives its grant back; its store is cut so no
// renewal reaches Redis). Its grant stays counted until its term ends: the
// other three lose that share for the rest of the term, then take it
// back. The test measures the capacity lost.
func TestCapacityLeasesCrash(t *testing.T) {
	if testing.Short() {
		t.Skip("14 s of load")
	}
	lim := Limit{Rate: 1000, Period: time.Second, Burst: 100}
	const term = 6 * time.Second
	lims, cuts := cutFleet(t, 4, runPolicy("crash", lim), term)
	stopDead := make(chan struct{})
	collectDead := spinAll(lims[:1], 4, "crash", stopDead)
	stop := make(chan struct{})
	collect := spinAll(lims[1:], 4, "crash", stop)
	time.Sleep(3 * time.Second)
	crashAt := time.Now()
	cuts[0].Down.Store(true)
	close(stopDead)
	collectDead()
	time.Sleep(term + 3*time.Second)
	close(stop)
	adm := collect()
	end := time.Now()
	inTerm, _ := between(adm, crashAt, crashAt.Add(term))
	after, _ := between(adm, crashAt.Add(term+time.Second), end)
	termRate := float64(inTerm) / term.Seconds()
	afterRate := float64(after) / end.Sub(crashAt.Add(term+time.Second)).Seconds()
	lost := lim.TokensIn(term) - inTerm
	t.Logf("one of 4 crashed: the other 3 admitted %.0f/s during the dead grant's term (%v), %.0f/s a second after it ended; capacity lost %d tokens (%.0f%% of Rate·term)",
		termRate, term, afterRate, lost, 100*float64(lost)/float64(lim.TokensIn(term)))
	// Without the dead grant's share the three admit what they did in its
	// term (787–808/s measured); with it, the rate (961–979/s alone, 947/s
	// once under make test's parallel load, where a holder starved of CPU
	// admits less). 90% tells the two apart with room for that load.
	if afterRate < 0.90*float64(lim.Rate) {
		t.Fatalf("after the dead grant's term the others admit %.0f/s, want ≥ 90%% of %d", afterRate, lim.Rate)
	}
	// The dead grant ends a term after its last renewal, which came up to
	// a quarter of the term before the crash: the others get at most
	// 3/4 of the rate for 3/4 of the window and all of it after, 81%.
	// Uncounted, they would get all of it.
	if termRate > float64(lim.Rate)*0.85 {
		t.Fatalf("during the dead grant's term the others admitted %.0f/s: the dead grant was not counted", termRate)
	}
}

// TestCapacityLeasesLongPartition: 4 limiters at several times the limit
// with a 1.5 s term; one of them is cut off for 4 s, longer than its
// term. It spends its grant until the term ends, then its degraded share
// (Rate/N, burst Burst/N): while the cut lasts the fleet admits at most
// Burst + Rate·w + (Rate/N)·(w − term) + Burst/N, the bound RELIABILITY
// states for a partition
// longer than the term. The test measures it, and how the whole run
// compares with Burst + Rate·t after the heal: recovery charges the
// cut-off process only what its share had not covered with elapsed time,
// so the excess is not paid back (a known limit).
func TestCapacityLeasesLongPartition(t *testing.T) {
	if testing.Short() {
		t.Skip("9 s of load")
	}
	lim := Limit{Rate: 1000, Period: time.Second, Burst: 100}
	const term, n = 1500 * time.Millisecond, 4
	lims, cuts := cutFleet(t, n, runPolicy("long-partition", lim), term, WithFleetSize(n))
	stop := make(chan struct{})
	start := time.Now()
	collect := spinAll(lims, 4, "long", stop)
	time.Sleep(3 * time.Second)
	cutAt := time.Now()
	cuts[0].Down.Store(true)
	time.Sleep(4 * time.Second)
	healAt := time.Now()
	cuts[0].Down.Store(false)
	time.Sleep(4 * time.Second)
	close(stop)
	adm := collect()
	end := time.Now()

	w := healAt.Sub(cutAt)
	during, by := between(adm, cutAt, healAt)
	plain := lim.Burst + lim.TokensIn(w)
	stated := plain + lim.TokensIn(w-term)/n + lim.Burst/n // the share's own burst too
	total, totalBound := int64(len(adm)), lim.Burst+lim.TokensIn(end.Sub(start))
	after, byAfter := between(adm, healAt, end)
	t.Logf("1 of %d cut for %v (term %v): admitted %d during the cut against Burst + Rate·w = %d (%+.1f%%) and the stated bound %d, by source %v; %d in the %v after the heal against Rate·w = %d, by source %v; whole run %d against Burst + Rate·t = %d (%+d)",
		n, w.Round(time.Millisecond), term, during, plain, 100*float64(during-plain)/float64(plain), stated, by,
		after, end.Sub(healAt).Round(time.Millisecond), lim.TokensIn(end.Sub(healAt)), byAfter,
		total, totalBound, total-totalBound)
	if during > stated {
		t.Fatalf("admitted %d during the cut, over the stated bound %d", during, stated)
	}
	if by[SourceDegraded] == 0 {
		t.Fatalf("nothing decided by the degraded share: the cut-off limiter's grant outlived its term")
	}
	// Paid back: the heal charges every degraded admission (the bucket
	// spilled nothing, the others drew it all along); while the debt is
	// out the grants get half their allocation, so the bucket refills at
	// half the rate at least. The cumulative count is back under
	// Burst + Rate·t within the time half the rate takes to pay the
	// excess, plus 2 s: the breaker's probe finds the store back, the
	// settlement runs, the holders renew (term/4) and the cut-off one's
	// degraded admissions before its recovery join the debt.
	excess := overAt(adm, start, healAt, lim)
	back := backUnder(adm, start, lim)
	stay := time.Duration(2*float64(excess)/float64(lim.Rate)*float64(time.Second)) + 2*time.Second
	t.Logf("over Burst + Rate·t by %d at the heal; back under it for good %v after the heal (stated: within %v)",
		excess, back.Sub(healAt).Round(time.Millisecond), stay.Round(time.Millisecond))
	if total > totalBound {
		t.Errorf("the run ends %d over Burst + Rate·t: the partition's excess was not paid back", total-totalBound)
	}
	if back.Sub(healAt) > stay {
		t.Errorf("back under Burst + Rate·t %v after the heal, want within %v", back.Sub(healAt), stay)
	}
}

// overAt is how far the admissions up to at ran over Burst + Rate·t since
// start.
func overAt(adm []sourced, start, at time.Time, lim Limit) int64 {
	var n int64
	for _, x := range adm {
		if x.asked.Before(at) {
			n++
		}
	}
	return n - lim.Burst - lim.TokensIn(at.Sub(start))
}

// backUnder is the time of the last admission that took the count over
// Burst + Rate·t since start (start itself if none did).
func backUnder(adm []sourced, start time.Time, lim Limit) time.Time {
	ts := make([]time.Time, len(adm))
	for i, x := range adm {
		ts[i] = x.asked
	}
	slices.SortFunc(ts, func(a, b time.Time) int { return a.Compare(b) })
	last := start
	for k, at := range ts {
		if int64(k+1) > lim.Burst+lim.TokensIn(at.Sub(start)) {
			last = at
		}
	}
	return last
}

// TestPartialPartitionPaidBack: without capacity leases, 1 of 4 limiters
// at more than the limit loses Redis for 3 s while the others keep it.
// The others draw the whole bucket meanwhile and the cut-off one adds its
// degraded share on top; at the heal its debit names the bucket's spill
// mark from before the cut, the bucket spilled nothing since (it was
// drawn all along), so every degraded admission is charged, and the
// excess is paid back: the run ends under Burst + Rate·t, back under it
// within the time the rate takes to pay the excess plus 2 s. (Before
// spill marks the heal charged only what the share had not covered with
// elapsed time, and the excess stayed: +814 over a 9 s run.)
func TestPartialPartitionPaidBack(t *testing.T) {
	if testing.Short() {
		t.Skip("9 s of load")
	}
	lim := Limit{Rate: 1000, Period: time.Second, Burst: 100}
	const n = 4
	lims, cuts := cutFleet(t, n, runPolicy("paid-back", lim), 0, WithFleetSize(n))
	stop := make(chan struct{})
	start := time.Now()
	collect := spinAll(lims, 4, "paid", stop)
	time.Sleep(2 * time.Second)
	cutAt := time.Now()
	cuts[0].Down.Store(true)
	time.Sleep(3 * time.Second)
	healAt := time.Now()
	cuts[0].Down.Store(false)
	time.Sleep(4 * time.Second)
	close(stop)
	adm := collect()
	end := time.Now()

	during, by := between(adm, cutAt, healAt)
	excess := overAt(adm, start, healAt, lim)
	back := backUnder(adm, start, lim)
	total, totalBound := int64(len(adm)), lim.Burst+lim.TokensIn(end.Sub(start))
	stay := time.Duration(float64(excess)/float64(lim.Rate)*float64(time.Second)) + 2*time.Second
	t.Logf("1 of %d cut for %v: %d admitted during the cut (by source %v), %d over Burst + Rate·t at the heal; back under it for good %v after the heal (stated: within %v); whole run %d against %d (%+d)",
		n, healAt.Sub(cutAt).Round(time.Millisecond), during, by, excess, back.Sub(healAt).Round(time.Millisecond),
		stay.Round(time.Millisecond), total, totalBound, total-totalBound)
	if by[SourceDegraded] == 0 || excess <= 0 {
		t.Fatalf("the cut-off limiter added nothing on top (degraded %d, excess %d): the test shows no payback", by[SourceDegraded], excess)
	}
	if total > totalBound {
		t.Errorf("the run ends %d over Burst + Rate·t: the partition's excess was not paid back", total-totalBound)
	}
	if back.Sub(healAt) > stay {
		t.Errorf("back under Burst + Rate·t %v after the heal, want within %v", back.Sub(healAt), stay)
	}
}
