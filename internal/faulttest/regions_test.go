package faulttest

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/Shopify/toxiproxy/v2"
	"github.com/leasehold/leasehold/hybrid"
	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"github.com/leasehold/leasehold/remote"
	"github.com/leasehold/leasehold/remote/tiered"
	"github.com/redis/go-redis/v9"
)

// globe is three regions, each with its own Redis and limitersPer
// limiters, leasing from one parent Redis through a toxiproxy link per
// region that adds latency each way.
type globe struct {
	parent    *redis.Client // the world's Redis, read by the tests directly
	proxies   []*toxiproxy.Proxy
	members   []*member
	regionals []*redis.Client // one client per region's Redis, for its counters
}

type member struct {
	region int
	lim    *hybrid.Limiter
	store  *tiered.Store
}

// decision is one recorded AllowN: when it returned (since the run
// began), whether it admitted, from where, and how long it took.
type decision struct {
	at      time.Duration
	allowed bool
	source  hybrid.Source
	took    time.Duration
}

const (
	regionsN    = 3
	limitersPer = 4
)

func newGlobe(t *testing.T, policy hybrid.Policy, oneWay time.Duration, opts ...tiered.Option) *globe {
	t.Helper()
	parent := redistest.NewServer(t)
	g := &globe{parent: parent.Client(t)}
	logger := slog.New(slog.DiscardHandler)
	links := startProxies(t, parent.Addr, "parent-0", "parent-1", "parent-2")[:regionsN]
	for r, proxy := range links {
		for _, stream := range []string{"upstream", "downstream"} {
			if _, err := proxy.Toxics.AddToxicJson(strings.NewReader(fmt.Sprintf(
				`{"name": "ocean-%s", "type": "latency", "stream": %q, "attributes": {"latency": %d}}`,
				stream, stream, oneWay.Milliseconds()))); err != nil {
				t.Fatal(err)
			}
		}
		g.proxies = append(g.proxies, proxy)
		regional := redistest.NewServer(t)
		g.regionals = append(g.regionals, regional.Client(t))
		for i := range limitersPer {
			pc := redis.NewClient(&redis.Options{Addr: proxy.Listen, ContextTimeoutEnabled: true, MaxRetries: -1})
			rc := regional.Client(t)
			ts, err := tiered.New(fmt.Sprintf("region-%d", r), remote.NewRedis(rc), remote.NewRedis(pc), opts...)
			if err != nil {
				t.Fatal(err)
			}
			lim, err := hybrid.New(ts, policy, hybrid.WithLogger(logger), hybrid.WithSeed(uint64(r*100+i)))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				_ = lim.Close(context.Background())
				_ = ts.Close()
				_ = pc.Close()
			})
			g.members = append(g.members, &member{region: r, lim: lim, store: ts})
		}
	}
	return g
}

// event is something done to the world at a time into a run.
type event struct {
	at time.Duration
	do func()
}

// run offers each limiter perLimiter decisions per second, evenly spaced
// and phased apart, on one key for d, doing the events at their times;
// it returns every decision by region.
func (g *globe) run(t *testing.T, key string, perLimiter int, d time.Duration, events ...event) (start time.Time, out [regionsN][]decision) {
	t.Helper()
	ctx := context.Background()
	interval := time.Second / time.Duration(perLimiter)
	per := make([][]decision, len(g.members))
	var wg sync.WaitGroup
	start = time.Now()
	for _, e := range events {
		wg.Add(1)
		tm := time.AfterFunc(e.at, func() {
			defer wg.Done()
			e.do()
		})
		defer tm.Stop()
	}
	for i, m := range g.members {
		wg.Add(1)
		go func() {
			defer wg.Done()
			next := start.Add(interval * time.Duration(i) / time.Duration(len(g.members)))
			for {
				if wait := time.Until(next); wait > 0 {
					time.Sleep(wait) // pacing the offered load, not waiting for a condition
				}
				if time.Since(start) >= d {
					return
				}
				t0 := time.Now()
				dec, err := m.lim.AllowN(ctx, key, 1)
				took := time.Since(t0)
				if err != nil {
					t.Errorf("AllowN: %v", err)
					return
				}
				per[i] = append(per[i], decision{at: time.Since(start), allowed: dec.Allowed, source: dec.Source, took: took})
				next = next.Add(interval)
			}
		}()
	}
	wg.Wait()
	for i, m := range g.members {
		out[m.region] = append(out[m.region], per[i]...)
	}
	return start, out
}

// admittedTimes returns the sorted admission times of every region.
func admittedTimes(all [regionsN][]decision) []time.Duration {
	var at []time.Duration
	for _, ds := range all {
		for _, d := range ds {
			if d.allowed {
				at = append(at, d.at)
			}
		}
	}
	slices.Sort(at)
	return at
}

// worstOver returns the most that admissions by any moment exceeded
// Burst + Rate·t since the run began.
func worstOver(at []time.Duration, lim hybrid.Limit) float64 {
	worst := -float64(lim.Burst)
	for k, t := range at {
		bound := float64(lim.Burst) + float64(lim.Rate)*float64(t)/float64(lim.Period)
		worst = max(worst, float64(k+1)-bound)
	}
	return worst
}

func percentile(ds []time.Duration, p float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	slices.Sort(ds)
	return ds[min(len(ds)-1, int(p*float64(len(ds))))]
}

// regionCommands returns the commands each region's Redis has served.
func regionCommands(t *testing.T, g *globe) [regionsN]int64 {
	var out [regionsN]int64
	for r, c := range g.regionals {
		info, err := c.Info(context.Background(), "stats").Result()
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(info, "\r\n") {
			if v, ok := strings.CutPrefix(line, "total_commands_processed:"); ok {
				out[r], _ = strconv.ParseInt(v, 10, 64)
			}
		}
	}
	return out
}

func parentCallsByRegion(g *globe) [regionsN]int64 {
	var calls [regionsN]int64
	for _, m := range g.members {
		calls[m.region] += m.store.Stats().ParentCalls
	}
	return calls
}

// TestRegionsShareOneGlobalLimit: three regions, 50 ms each way to the
// parent, four limiters each at 2× the global rate in all: the world's
// admissions stay within Burst + Rate·t, use at least 95% of it, each
// region calls the parent at most 5 times a second, and no decision waits
// for the parent.
func TestRegionsShareOneGlobalLimit(t *testing.T) {
	t.Parallel() // the regions tests wait on real time, and use little CPU
	lim := hybrid.PerSecond(1000)
	policy := hybrid.Policy{Name: "world", Limit: lim}
	g := newGlobe(t, policy, 50*time.Millisecond)
	const d = 20 * time.Second
	perLimiter := int(2 * lim.Rate / (regionsN * limitersPer))
	before, cmdsBefore := parentCallsByRegion(g), regionCommands(t, g)
	start, all := g.run(t, "tenant", perLimiter, d)
	elapsed := time.Since(start)
	after, cmdsAfter := parentCallsByRegion(g), regionCommands(t, g)

	at := admittedTimes(all)
	over := worstOver(at, lim)
	bound := float64(lim.Burst) + float64(lim.Rate)*elapsed.Seconds()
	util := float64(len(at)) / bound
	var leased, every []time.Duration
	var byRegion [regionsN]int
	for r, ds := range all {
		n, degraded := 0, 0
		first := time.Duration(-1)
		for _, x := range ds {
			every = append(every, x.took)
			if x.allowed {
				n++
				if first < 0 || x.at < first {
					first = x.at
				}
			}
			if x.source == hybrid.SourceLease {
				leased = append(leased, x.took)
			}
			if x.source == hybrid.SourceDegraded {
				degraded++
			}
		}
		// A store call that misses its timeout is decided by the
		// degraded share (slowness is not a reason to refuse): on a
		// CPU-starved make test a fresh clone saw 18 of ~13 000 in one
		// region, with the bound kept (−455). More than 1 in 500 would be
		// a region that lost its store, not a slow moment.
		if degraded*500 > len(ds) {
			t.Errorf("region %d: %d of %d decisions degraded in healthy mode", r, degraded, len(ds))
		} else if degraded > 0 {
			t.Logf("region %d: %d of %d decisions degraded (store calls past their timeout)", r, degraded, len(ds))
		}
		byRegion[r] = n
		calls := float64(after[r]-before[r]) / elapsed.Seconds()
		t.Logf("region %d: %d admitted of %d offered, the first %v into the run; %.2f parent calls/s, %.1f commands/s on its own Redis",
			r, n, len(ds), first.Round(time.Millisecond), calls, float64(cmdsAfter[r]-cmdsBefore[r])/elapsed.Seconds())
		if calls > 5 {
			t.Errorf("region %d: %.2f parent calls per second, want ≤ 5", r, calls)
		}
	}
	t.Logf("world: %d admitted in %v, bound %.0f: utilization %.1f%%, worst excess over Burst+Rate·t %+.0f",
		len(at), elapsed.Round(time.Millisecond), bound, 100*util, over)
	p99, p999, worst := percentile(leased, 0.99), percentile(every, 0.999), slices.Max(every)
	t.Logf("leased decisions p99 %v; all decisions p99.9 %v, max %v", p99, p999, worst)
	if over > 0 {
		t.Errorf("admitted %+.0f over the exact bound", over)
	}
	// Same demand everywhere: no region starves. (The parent serves
	// whoever asks first, so the split is even on average, not run by
	// run: a fresh-clone run measured 58% for one region. 50% is a floor
	// against starvation, not fairness; a division by wants is issue 22's.)
	for r, n := range byRegion {
		if fair := float64(len(at)) / regionsN; float64(n) < 0.5*fair {
			t.Errorf("region %d admitted %d, under 50%% of an even split (%.0f)", r, n, fair)
		}
	}
	if util < 0.95 {
		t.Errorf("utilization %.1f%%, want ≥ 95%%", 100*util)
	}
	// A round trip to the parent is 100 ms: a decision that waited for
	// one would show it.
	if p99 > 5*time.Millisecond || p999 > 50*time.Millisecond {
		t.Errorf("decisions paid the parent's latency: leased p99 %v, all p99.9 %v", p99, p999)
	}
	// The same load on limiters of one flat Redis, for the leased p99
	// without tiers.
	flat := flatLeasedP99(t, lim, perLimiter)
	t.Logf("leased decisions p99 on one flat Redis, same load: %v", flat)
	if p99 > 3*flat+100*time.Microsecond {
		t.Errorf("leased p99 %v with tiers, %v flat", p99, flat)
	}
}

// flatLeasedP99 runs limitersPer limiters on one Redis of their own, at
// perLimiter decisions per second each for 5 s, and returns the p99 of
// their leased decisions.
func flatLeasedP99(t *testing.T, lim hybrid.Limit, perLimiter int) time.Duration {
	srv := redistest.NewServer(t)
	g := &globe{}
	for i := range limitersPer {
		l, err := hybrid.New(remote.NewRedis(srv.Client(t)), hybrid.Policy{Name: "flat", Limit: lim},
			hybrid.WithLogger(slog.New(slog.DiscardHandler)), hybrid.WithSeed(uint64(900+i)))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = l.Close(context.Background()) })
		g.members = append(g.members, &member{lim: l})
	}
	_, all := g.run(t, "tenant", perLimiter, 5*time.Second)
	var leased []time.Duration
	for _, x := range all[0] {
		if x.source == hybrid.SourceLease {
			leased = append(leased, x.took)
		}
	}
	return percentile(leased, 0.99)
}

// TestRegionsThroughParentCut: every region's link to the parent is cut
// for 10 s under 2× demand. Each region goes on at its share of the limit
// (its live limiters of the world's, 4 of 12), within ±10%; once the link
// is back, the outage's admissions are charged to the parent, and over the
// whole run the world admits at most one Burst over Burst + Rate·t.
func TestRegionsThroughParentCut(t *testing.T) {
	regionsThroughCut(t, "world-cut", 8*time.Second, 10*time.Second, 34*time.Second, func(t *testing.T, p *toxiproxy.Proxy, on bool) {
		if on {
			p.Stop()
		} else if err := p.Start(); err != nil {
			t.Errorf("link back: %v", err)
		}
	}, 0.1)
}

// TestRegionsThroughSilentParent: the same (an 8 s cut), with every link
// silent rather than refused: a timeout toxic drops every byte and keeps
// the connection open, so parent calls time out instead of failing at
// once. Each region must go on at its share all the same. (It starved:
// the failure mark was written with the context of the parent call that
// had just timed out, so it never reached the region's Redis; 25–360 of
// a 3 333 share in a 10 s cut.)
func TestRegionsThroughSilentParent(t *testing.T) {
	// A silent link is known only once a refill has gone unanswered for a
	// quarter of the parent timeout, and the region admits little
	// meanwhile: −3.6% to −10.4% of the share measured (the last in a
	// fresh-clone make test). Over the share stays held to +10%.
	regionsThroughCut(t, "world-silent", 6*time.Second, 8*time.Second, 24*time.Second, silentLink, 0.15)
}

// silentLink makes p drop every byte and keep its connections (on), or
// mends it, so calls over it time out rather than fail.
func silentLink(t *testing.T, p *toxiproxy.Proxy, on bool) {
	var err error
	if on {
		_, err = p.Toxics.AddToxicJson(strings.NewReader(
			`{"name": "silent", "type": "silence", "stream": "downstream"}`))
	} else {
		err = p.Toxics.RemoveToxic(context.Background(), "silent")
	}
	if err != nil {
		t.Errorf("link toxic: %v", err)
	}
}

// regionsThroughCut runs the parent-cut scenario for d, cutting each
// region's link with cut at cutAt for cutFor; each region must admit its
// share while cut, within +10% and −under.
func regionsThroughCut(t *testing.T, name string, cutAt, cutFor, d time.Duration, cut func(t *testing.T, p *toxiproxy.Proxy, on bool), under float64) {
	t.Parallel() // as the other regions tests
	lim := hybrid.PerSecond(1000)
	policy := hybrid.Policy{Name: name, Limit: lim}
	g := newGlobe(t, policy, 50*time.Millisecond)
	perLimiter := int(2 * lim.Rate / (regionsN * limitersPer))
	links := func(on bool) func() {
		return func() {
			for _, p := range g.proxies {
				cut(t, p, on)
			}
		}
	}
	_, all := g.run(t, "tenant", perLimiter, d, event{cutAt, links(true)}, event{cutAt + cutFor, links(false)})

	share := float64(lim.Rate) * cutFor.Seconds() * limitersPer / (regionsN * limitersPer)
	for r, ds := range all {
		n, degraded := 0, 0
		for _, x := range ds {
			if x.allowed && x.at >= cutAt && x.at < cutAt+cutFor {
				n++
				if x.source == hybrid.SourceDegraded {
					degraded++
				}
			}
		}
		t.Logf("region %d: %d admitted during the cut (%d degraded), share %.0f: %+.1f%%", r, n, degraded, share, 100*(float64(n)/share-1))
		if float64(n) < (1-under)*share || float64(n) > 1.1*share {
			t.Errorf("region %d admitted %d during the cut, want %.0f, −%.0f%% to +10%%", r, n, share, 100*under)
		}
	}
	at := admittedTimes(all)
	over := worstOver(at, lim)
	t.Logf("world: %d admitted in %v; worst excess over Burst+Rate·t %+.0f (Burst %d)", len(at), d, over, lim.Burst)
	if over > float64(lim.Burst) {
		t.Errorf("admitted %+.0f over the exact bound, want at most one Burst (%d)", over, lim.Burst)
	}
	for _, m := range g.members {
		if m.lim.Mode() != hybrid.ModeHealthy {
			t.Errorf("region %d limiter still %v at the end", m.region, m.lim.Mode())
		}
	}
}

// TestRegionsPolicyChange: a policy change made by a limiter of one region
// reaches every limiter of every region within one poll interval plus one
// lease TTL (1 s each by default), and the world then admits at the new
// rate.
func TestRegionsPolicyChange(t *testing.T) {
	t.Parallel() // the regions tests wait on real time, and use little CPU
	lim := hybrid.PerSecond(1000)
	policy := hybrid.Policy{Name: "world-policy", Limit: lim}
	g := newGlobe(t, policy, 50*time.Millisecond)
	const changeAt, d = 4 * time.Second, 10 * time.Second
	next := policy
	next.Version, next.Limit = 2, hybrid.PerSecond(300)
	var (
		mu      sync.Mutex
		adopted = make([]time.Duration, len(g.members))
	)
	watch := func() {
		ctx := context.Background()
		if err := g.members[0].lim.SetPolicy(ctx, next); err != nil {
			t.Errorf("SetPolicy: %v", err)
			return
		}
		changed := time.Now()
		deadline := changed.Add(5 * time.Second)
		for time.Now().Before(deadline) {
			done := true
			mu.Lock()
			for i, m := range g.members {
				if adopted[i] == 0 && m.lim.Policy().Version == 2 {
					adopted[i] = max(time.Since(changed), 1) // 0 means not yet
				}
				done = done && adopted[i] != 0
			}
			mu.Unlock()
			if done {
				return
			}
			time.Sleep(time.Millisecond) // polling with a deadline
		}
	}
	perLimiter := int(2 * lim.Rate / (regionsN * limitersPer))
	_, all := g.run(t, "tenant", perLimiter, d, event{changeAt, watch})
	mu.Lock()
	defer mu.Unlock()
	for i, m := range g.members {
		t.Logf("region %d limiter %d on version 2 after %v", m.region, i%limitersPer, adopted[i].Round(time.Millisecond))
		if adopted[i] == 0 || adopted[i] > 2*time.Second {
			t.Errorf("region %d limiter %d: version 2 after %v, want within 2 s", m.region, i%limitersPer, adopted[i])
		}
	}
	// From one lease TTL after the change to the end: the new rate, plus
	// what the parent's bucket held (at most its new Burst).
	from := changeAt + time.Second
	n := 0
	for _, ds := range all {
		for _, x := range ds {
			if x.allowed && x.at >= from {
				n++
			}
		}
	}
	bound := float64(next.Limit.Burst) + float64(next.Limit.Rate)*(d-from).Seconds()
	t.Logf("admitted %d from %v to %v, bound %.0f at the new rate", n, from, d, bound)
	if float64(n) > bound {
		t.Errorf("admitted %d after the change, over the new bound %.0f", n, bound)
	}
	if float64(n) < 0.8*float64(next.Limit.Rate)*(d-from).Seconds() {
		t.Errorf("admitted %d after the change, well under the new rate", n)
	}
}

// TestRegionsSlidingWindow: a sliding window through tiers on real Redis.
// Every window of the period, ending at 100 ms steps, holds at most the
// limit across all regions; what a region does not hand out in time goes
// back to the world's window, so full windows stay well used.
func TestRegionsSlidingWindow(t *testing.T) {
	t.Parallel() // the regions tests wait on real time, and use little CPU
	lim := hybrid.Limit{Rate: 2000, Period: 5 * time.Second, Burst: 2000}
	policy := hybrid.Policy{Name: "world-window", Limit: lim, Algorithm: hybrid.SlidingWindow}
	g := newGlobe(t, policy, 50*time.Millisecond)
	const d = 20 * time.Second
	perLimiter := int(2 * float64(lim.Rate) / lim.Period.Seconds() / (regionsN * limitersPer))
	_, all := g.run(t, "tenant", perLimiter, d)
	at := admittedTimes(all)
	most, least := 0, -1
	for end := 100 * time.Millisecond; end <= d; end += 100 * time.Millisecond {
		from := end - lim.Period
		n := 0
		for _, x := range at {
			if x > from && x <= end {
				n++
			}
		}
		most = max(most, n)
		if from >= 0 && (least < 0 || n < least) {
			least = n
		}
	}
	t.Logf("%d admitted in %v; the fullest window of %v held %d, the emptiest full one %d (%.1f%% of %d)",
		len(at), d, lim.Period, most, least, 100*float64(least)/float64(lim.Rate), lim.Rate)
	if most > int(lim.Rate) {
		t.Errorf("a window held %d, over the limit of %d", most, lim.Rate)
	}
	if float64(least) < 0.5*float64(lim.Rate) {
		t.Errorf("the emptiest full window held %d, under half the limit", least)
	}
}
