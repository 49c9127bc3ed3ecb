package faulttest

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/Shopify/toxiproxy/v2"
	"github.com/leasehold/leasehold/hybrid"
	"github.com/leasehold/leasehold/remote"
	"github.com/leasehold/leasehold/remote/tiered"
	"github.com/redis/go-redis/v9"
)

// grantTerm is the term of the regions' capacity grants in these tests:
// longer than every cut, so that a cut-off region spends its grant.
const grantTerm = 15 * time.Second

// TestRegionsDivideByWantsWithGrants: three regions with the same demand
// (2× the limit in all), each holding a capacity grant from the world:
// their grants, read from the world's Redis, are even (each a third ±
// 10%) within evenBy of the start, and from then on each region's part
// of the world's admissions is within ±5 points of a third (first come,
// first served gave 26–42% in 20 s runs). The world never goes over
// Burst + Rate·t, admits at least 95% of Rate·t once settled and 90% of
// Burst + Rate·t over the whole run, start-up included, and each region
// calls the world at most 5 times a second.
func TestRegionsDivideByWantsWithGrants(t *testing.T) {
	t.Parallel() // as the other regions tests
	lim := hybrid.PerSecond(1000)
	g := newGlobe(t, hybrid.Policy{Name: "world-grants", Limit: lim}, 50*time.Millisecond, tiered.WithCapacityLeases(grantTerm))
	const d = 16 * time.Second
	perLimiter := int(2 * lim.Rate / (regionsN * limitersPer))
	before := parentCallsByRegion(g)
	even, sample := evenGrants(g, d)
	start, all := g.run(t, "tenant", perLimiter, d, sample...)
	elapsed := time.Since(start)
	after := parentCallsByRegion(g)
	at := admittedTimes(all)
	bound := float64(lim.Burst) + float64(lim.Rate)*elapsed.Seconds()
	over, util := worstOver(at, lim), float64(len(at))/bound
	t.Logf("world: %d admitted in %v, bound %.0f: utilization %.1f%%, worst excess over Burst+Rate·t %+.0f",
		len(at), elapsed.Round(time.Millisecond), bound, 100*util, over)
	if over > 0 {
		t.Errorf("admitted %+.0f over the exact bound", over)
	}
	// A region that asks after the others have taken the rate waits
	// for their grants to come down, which takes two of their calls each
	// (a grant falls only to what its holder reports it runs at), a
	// quarter of the term apart once they are no longer young: 1.25–2.25 s
	// measured in 8 runs, 9 s in one with 3 globes and 2 busy loops on
	// 2 cores.
	const evenBy = 10 * time.Second
	from := time.Duration(even.Load())
	t.Logf("grants even (each a third ± 10%%) from %v", from)
	if from == 0 || from > evenBy {
		t.Fatalf("grants not even by %v (from %v; 0: never)", evenBy, from)
	}
	parts, world := partsFrom(all, from)
	for r, n := range parts {
		part := 100 * float64(n) / float64(world)
		calls := float64(after[r]-before[r]) / elapsed.Seconds()
		t.Logf("region %d: %d admitted after %v, %.1f%% of the world's; %.2f parent calls/s", r, n, from, part, calls)
		if part < 100.0/regionsN-5 || part > 100.0/regionsN+5 {
			t.Errorf("region %d: %.1f%% of the world's admissions, want a third ± 5 points", r, part)
		}
		if calls > 5 {
			t.Errorf("region %d: %.2f parent calls per second, want ≤ 5", r, calls)
		}
	}
	// The start-up (first asks, young renewals) is where load shows: a
	// fresh-clone make test, with the other regions tests beside it,
	// admitted 1 943 of 3 000 in the first 2 s and 94.9% over the run
	// (96.4–96.8% alone), all the loss before the split settled.
	const settled = 2 * time.Second
	_, steadyN := partsFrom(all, settled)
	steady := float64(steadyN) / (float64(lim.Rate) * (elapsed - settled).Seconds())
	t.Logf("utilization once settled (%v): %.1f%% of Rate·t", settled, 100*steady)
	if steady < 0.95 {
		t.Errorf("utilization once settled %.1f%% of Rate·t, want ≥ 95%%", 100*steady)
	}
	if util < 0.90 {
		t.Errorf("utilization %.1f%% over the whole run, want ≥ 90%%", 100*util)
	}
}

// evenGrants returns events that read the regions' grants from the
// world's Redis every 250 ms for d, and where they record the first time
// every region held a third of the rate ± 10% (0 until then).
func evenGrants(g *globe, d time.Duration) (*atomic.Int64, []event) {
	var from atomic.Int64 // a time.Duration
	var evs []event
	for at := 250 * time.Millisecond; at < d; at += 250 * time.Millisecond {
		evs = append(evs, event{at, func() {
			if from.Load() != 0 {
				return
			}
			shares, err := grantShares(g.parent)
			if err != nil {
				return // no grant yet
			}
			for r := range regionsN {
				sh := float64(shares[fmt.Sprintf("region.region-%d", r)])
				if third := float64(remote.GrantUnits) / regionsN; sh < 0.9*third || sh > 1.1*third {
					return
				}
			}
			from.Store(int64(at))
		}})
	}
	return &from, evs
}

// partsFrom counts each region's admissions at or after from, and the
// world's.
func partsFrom(all [regionsN][]decision, from time.Duration) (parts [regionsN]int, world int) {
	for r, ds := range all {
		for _, x := range ds {
			if x.allowed && x.at >= from {
				parts[r]++
				world++
			}
		}
	}
	return parts, world
}

// TestRegionCutWithGrants: one region of three loses its link to the
// world for 8 s, shorter than the grants' term, refused or silent, while
// the others keep theirs; 2× demand everywhere. The cut-off region spends
// its grant (its rate before the cut, within ±10%; about a third) and
// never goes degraded;
// the world admits at most 1% over its rate while the cut lasts (with
// batches alone, +29% in the simulator), and never over Burst + Rate·t.
func TestRegionCutWithGrants(t *testing.T) {
	for _, tc := range []struct {
		name string
		cut  func(t *testing.T, p *toxiproxy.Proxy, on bool)
	}{
		{"refused", func(t *testing.T, p *toxiproxy.Proxy, on bool) {
			if on {
				p.Stop()
			} else if err := p.Start(); err != nil {
				t.Errorf("link back: %v", err)
			}
		}},
		{"silent", silentLink},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			regionCutWithGrants(t, tc.cut)
		})
	}
}

func regionCutWithGrants(t *testing.T, cut func(t *testing.T, p *toxiproxy.Proxy, on bool)) {
	lim := hybrid.PerSecond(1000)
	g := newGlobe(t, hybrid.Policy{Name: "cut-grants", Limit: lim}, 50*time.Millisecond, tiered.WithCapacityLeases(grantTerm))
	const cutAt, cutFor, d = 5 * time.Second, 8 * time.Second, 16 * time.Second
	const cutRegion = 2
	perLimiter := int(2 * lim.Rate / (regionsN * limitersPer))
	// The grant the region holds when its link goes is read from the
	// world's Redis just before the cut. Under CPU starvation a region
	// measures less demand and is rightly granted less than a third
	// (-17.5% of a third in one loaded run); the equal split is
	// TestRegionsDivideByWantsWithGrants'.
	var share units
	link := func(on bool) func() {
		return func() {
			if on {
				share = grantShare(t, g.parent, fmt.Sprintf("region.region-%d", cutRegion))
			}
			cut(t, g.proxies[cutRegion], on)
		}
	}
	_, all := g.run(t, "tenant", perLimiter, d, event{cutAt, link(true)}, event{cutAt + cutFor, link(false)})

	var world, mine, degraded int
	for r, ds := range all {
		for _, x := range ds {
			if !x.allowed || x.at < cutAt || x.at >= cutAt+cutFor {
				continue
			}
			world++
			if r == cutRegion {
				mine++
				if x.source == hybrid.SourceDegraded {
					degraded++
				}
			}
		}
	}
	rate := float64(lim.Rate) * cutFor.Seconds()
	third := rate / regionsN
	grant := float64(share) * rate / remote.GrantUnits
	t.Logf("during the %v cut: world %d admitted, %+.1f%% of its rate (%.0f); the cut-off region %d (%d degraded), %+.1f%% of its grant (%d/%d of the rate: %.0f), %+.1f%% of a third",
		cutFor, world, 100*(float64(world)/rate-1), rate, mine, degraded, 100*(float64(mine)/grant-1), share, remote.GrantUnits, grant, 100*(float64(mine)/third-1))
	if float64(world) > 1.01*rate {
		t.Errorf("the world admitted %d during the cut, over its rate %.0f by more than 1%%", world, rate)
	}
	if float64(mine) < 0.9*grant || float64(mine) > 1.1*grant {
		t.Errorf("the cut-off region admitted %d, want its grant %.0f ± 10%%", mine, grant)
	}
	if float64(mine) < third/2 {
		t.Errorf("the cut-off region admitted %d, under half a third (%.0f): starved", mine, third)
	}
	if degraded > 0 {
		t.Errorf("the cut-off region decided %d by its degraded share within the term", degraded)
	}
	at := admittedTimes(all)
	if over := worstOver(at, lim); over > 0 {
		t.Errorf("admitted %+.0f over Burst + Rate·t", over)
	}
}

// units is a grant's share of a bucket's rate, in remote.GrantUnits.
type units int64

// grantShare reads holder's share from the grants record in the world's
// Redis.
func grantShare(t *testing.T, c *redis.Client, holder string) units {
	shares, err := grantShares(c)
	if err != nil {
		t.Error(err)
		return 0
	}
	sh, ok := shares[holder]
	if !ok {
		t.Errorf("grants record holds no grant of %s: %v", holder, shares)
	}
	return sh
}

// grantShares reads every holder's share from the one grants record in
// the world's Redis (remote/scripts.go: "frac|holder share burst expiry
// want stock seq|...", the last two absent in records written before
// stock records).
func grantShares(c *redis.Client) (map[string]units, error) {
	ctx := context.Background()
	names, err := c.Keys(ctx, "*:grants").Result()
	if err != nil || len(names) != 1 {
		return nil, fmt.Errorf("grants records in the world's Redis: %q, %v; want one", names, err)
	}
	rec, err := c.Get(ctx, names[0]).Result()
	if err != nil {
		return nil, fmt.Errorf("grants record: %w", err)
	}
	shares := map[string]units{}
	for _, part := range strings.Split(rec, "|")[1:] {
		f := strings.Fields(part)
		if len(f) != 5 && len(f) != 7 {
			return nil, fmt.Errorf("grants record %q: part %q", rec, part)
		}
		n, err := strconv.ParseInt(f[1], 10, 64)
		if err != nil {
			return nil, fmt.Errorf("grants record %q: %w", rec, err)
		}
		shares[f[0]] = units(n)
	}
	return shares, nil
}
