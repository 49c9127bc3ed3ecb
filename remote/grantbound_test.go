package remote

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/local"
)

// spend is n tokens spent at store time at.
type spend struct {
	at      time.Time
	n       int64
	held    bool  // spent from a grant
	pending int64 // future-dated tokens granted and not yet released, before this spend
}

// TestGrantsKeepTheBound plays holders and leasers against one bucket on a
// MemoryStore, as the hybrid layer uses them: holders spend their grant
// with a local GCRA at the share they were told, report the share they run
// at, and stop before the term; leasers take leases, future-dated ones
// released at the bucket's pace as the pacer does. From the start, the
// spends never pass Burst + Rate·t; a window starting later holds at most
// Burst + Rate·w plus the future-dated tokens not yet released at its
// start (the slack any held lease gives, here saved up when a grant's end
// gave the bucket its rate back).
func TestGrantsKeepTheBound(t *testing.T) {
	for seed := range uint64(20) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) { grantBoundRun(t, seed) })
	}
}

func grantBoundRun(t *testing.T, seed uint64) {
	r := rand.New(rand.NewPCG(seed, 99))
	start := time.Unix(1_700_000_000, 0)
	clk := clock.NewManual(start)
	s := NewMemory(clk)
	ctx := context.Background()
	lim := local.Limit{Rate: 200 + r.Int64N(2000), Period: time.Second, Burst: 20 + r.Int64N(300)}
	base := Request{Policy: "bound", Key: fmt.Sprint("k", seed), Limit: lim, Version: 1}
	const term = 3 * time.Second
	type holder struct {
		name   string
		bucket *local.Bucket
		share  int64
		until  time.Time
		next   time.Time
	}
	hs := make([]*holder, 1+r.IntN(4))
	for i := range hs {
		hs[i] = &holder{name: fmt.Sprint("h", i), next: start.Add(time.Duration(r.Int64N(int64(time.Second))))}
	}
	var leases []held
	var spent []spend
	mk := func(share, burst, tokens int64, now time.Time) *local.Bucket {
		b, err := local.NewBucket(local.Limit{Rate: lim.Rate * share, Period: lim.Period * GrantUnits, Burst: burst})
		if err != nil {
			t.Fatal(err)
		}
		b.SetTokens(now.Sub(start).Nanoseconds(), tokens)
		return b
	}
	ns := func(at time.Time) int64 { return at.Sub(start).Nanoseconds() }
	for step := 0; step < 4000; step++ {
		now := clk.Now()
		for _, h := range hs {
			if h.bucket != nil && now.Before(h.until) {
				if res, _ := h.bucket.TakeAt(ns(now), 1); res.Allowed {
					spent = append(spent, spend{now, 1, true, pendingOf(leases, now)})
				}
			}
			if now.Before(h.next) {
				continue
			}
			running := h.share
			if h.bucket == nil || !now.Before(h.until) {
				running = 0
			}
			g, err := s.Grant(ctx, GrantRequest{Request: base, Holder: h.name, Want: 1 + r.Int64N(GrantUnits), Running: running,
				Burst: 1 + r.Int64N(lim.Burst/4+1), Term: term})
			if err != nil {
				t.Fatal(err)
			}
			h.next = now.Add(time.Duration(50+r.Int64N(800)) * time.Millisecond)
			if g.Share == 0 || g.Burst == 0 {
				if h.bucket != nil {
					h.bucket.Drain(ns(now))
				}
				h.bucket = nil
				continue
			}
			until := now.Add(g.Term - g.Term/100 - time.Millisecond)
			b := mk(g.Share, g.Burst, 0, now)
			carried := int64(0)
			if h.bucket != nil {
				carried = h.bucket.Drain(ns(now))
			}
			b.SetTokens(ns(now), carried+g.Tokens)
			h.bucket, h.share, h.until = b, g.Share, until
		}
		if r.IntN(3) == 0 {
			req := base
			req.N = 1 + r.Int64N(lim.Burst)
			req.Min, req.Need = 1, 1
			req.MaxDelay = time.Duration(r.Int64N(int64(time.Second)))
			res, err := s.Lease(ctx, req)
			if err != nil {
				t.Fatal(err)
			}
			switch {
			case res.Granted > 0 && res.Delay == 0:
				leases = append(leases, held{now, res.Granted})
			case res.Granted > 0:
				// Released as the hybrid layer's pacer does: token i of n
				// at end − (n−i)·step, so the stream is conformant.
				end, step := now.Add(res.Delay), lim.Period/time.Duration(lim.Rate)
				for i := int64(1); i <= res.Granted; i++ {
					leases = append(leases, held{end.Add(-time.Duration(res.Granted-i)*step + time.Microsecond), 1})
				}
			}
		}
		for i := 0; i < len(leases); {
			if !now.Before(leases[i].at) {
				spent = append(spent, spend{now, leases[i].n, false, pendingOf(leases, now)})
				leases = slices.Delete(leases, i, i+1)
				continue
			}
			i++
		}
		clk.Advance(time.Duration(100+r.Int64N(3000)) * time.Microsecond)
	}
	// Cumulative: every window from the first spend.
	var total int64
	for j := range spent {
		total += spent[j].n
		if e := total - lim.Burst - lim.TokensIn(spent[j].at.Sub(spent[0].at)+time.Microsecond); e > 0 {
			t.Fatalf("limit %v, %d holders: from the start to %v, %d over Burst + Rate·t", lim, len(hs), spent[j].at.Sub(start), e)
		}
	}
	// Every window between two spends. The most any window starting at
	// spend i holds over the bound is found from the suffix maximum of
	// cum[j] − Rate·t_j (in float, which forgives under a token); windows
	// whose start comes within 2 tokens of failing are checked exactly.
	rate := float64(lim.Rate) / lim.Period.Seconds()
	cum := make([]int64, len(spent)+1)
	for i, x := range spent {
		cum[i+1] = cum[i] + x.n
	}
	suffix := make([]float64, len(spent)+1)
	suffix[len(spent)] = math.Inf(-1)
	for j := len(spent) - 1; j >= 0; j-- {
		suffix[j] = max(suffix[j+1], float64(cum[j+1])-rate*spent[j].at.Sub(start).Seconds())
	}
	worst, wi, wj := int64(-1<<62), 0, 0
	for i := range spent {
		// A window may also see tokens granted before it that were not
		// yet spendable (saved up while the grants left more rate than
		// when they were timed), as it may see any lease held at its
		// start.
		slack := float64(cum[i]) - rate*spent[i].at.Sub(start).Seconds() + float64(lim.Burst+spent[i].pending)
		if suffix[i]-slack < -2 {
			continue
		}
		for j := i; j < len(spent); j++ {
			w := spent[j].at.Sub(spent[i].at)
			if e := cum[j+1] - cum[i] - lim.Burst - lim.TokensIn(w+time.Microsecond) - spent[i].pending; e > worst {
				worst, wi, wj = e, i, j
			}
		}
	}
	if worst > 0 {
		var byGrant, byLease int64
		for _, x := range spent[wi : wj+1] {
			if x.held {
				byGrant += x.n
			} else {
				byLease += x.n
			}
		}
		t.Fatalf("limit %v, %d holders: a window spent %d over Burst + Rate·w: from %v to %v, %d by grants, %d by leases",
			lim, len(hs), worst, spent[wi].at.Sub(start), spent[wj].at.Sub(start), byGrant, byLease)
	}
}

// held is n tokens of a lease, spendable from at.
type held struct {
	at time.Time
	n  int64
}

// pendingOf is what leases still hold back at now.
func pendingOf(leases []held, now time.Time) (n int64) {
	for _, l := range leases {
		if now.Before(l.at) {
			n += l.n
		}
	}
	return n
}
