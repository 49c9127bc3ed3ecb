package main

import (
	"testing"
	"time"

	"github.com/leasehold/leasehold/hybrid"
)

// TestLeaseFloorCounting: the 10% lease floor counts an admission as a
// store call unless a token its process held from an earlier call (at
// most 10% of Burst, for 1.5 lease TTLs) or a call made within the join
// window pays for it; processes hold their own tokens.
func TestLeaseFloorCounting(t *testing.T) {
	r := &recorder{w: &world{sc: &Scenario{}}, spare: map[procKey]spareTokens{}}
	lim := hybrid.Limit{Rate: 100, Period: time.Second, Burst: 30} // 3 tokens held at most
	ms := func(n int) time.Duration { return time.Duration(n) * time.Millisecond }
	a, b := procKey{0, "k"}, procKey{1, "k"}
	for _, c := range []struct {
		pk   procKey
		at   time.Duration
		n    int64
		call bool
		why  string
	}{
		{a, 0, 1, true, "first admission"},
		{a, ms(2), 1, false, "joins the call made 2 ms before"},
		{a, ms(10), 1, false, "first held token"},
		{b, ms(10), 1, true, "another process holds nothing"},
		{a, ms(20), 2, false, "two held tokens, the last"},
		{a, ms(30), 1, true, "nothing left"},
		{a, ms(40), 4, true, "more than the held 3"},
		{a, ms(1500), 1, false, "held until 1.5 lease TTLs"},
		{a, ms(3100), 1, true, "held tokens end 1.5 lease TTLs after their call"},
	} {
		if got := r.spareCall(c.pk, c.at, c.n, lim); got != c.call {
			t.Fatalf("%v at %v: call %v, want %v (%s)", c.pk, c.at, got, c.call, c.why)
		}
	}
}

// TestCallsByKind: the breakdown under each table counts every store call
// once, and says which lease calls were on keys at their limit: nearly
// all of them on a key asked twice its limit, few on one asked a tenth,
// with decaying leases (the default) and with leases that keep their
// tokens.
func TestCallsByKind(t *testing.T) {
	lenient := false
	for _, tc := range []struct {
		name       string
		rateFactor int64 // the policy's rate and burst times this
		strict     *bool
		atLimit    func(share float64) bool
		want       string
	}{
		{"at twice the limit", 1, nil, func(s float64) bool { return s >= 0.9 }, "at least 90%"},
		{"at a tenth of the limit", 20, nil, func(s float64) bool { return s <= 0.1 }, "at most 10%"},
		{"at twice the limit, lenient", 1, &lenient, func(s float64) bool { return s >= 0.9 }, "at least 90%"},
		{"at a tenth of the limit, lenient", 20, &lenient, func(s float64) bool { return s <= 0.1 }, "at most 10%"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// A fresh copy: shorten scales the traffic's slices in place.
			suite, err := loadSuite("healthy")
			if err != nil {
				t.Fatal(err)
			}
			s := *suite[0]
			s.Limiter.StrictWindows = tc.strict
			s.Policy.Rate *= tc.rateFactor
			s.Policy.Burst *= tc.rateFactor
			shorten(&s, 10, 20, 1000) // all 20 processes: 4 000/s asked
			rec, err := run(&s, s.Seed, nil)
			if err != nil {
				t.Fatal(err)
			}
			var byKind, all int64
			for _, n := range rec.calls {
				byKind += n
			}
			for _, p := range rec.phases {
				all += p.storeCalls
			}
			if byKind != all || all == 0 {
				t.Fatalf("%d store calls by kind, %d in the phases", byKind, all)
			}
			leases := rec.calls[callLease]
			share := float64(rec.leasesAtLimit) / float64(max(leases, 1))
			t.Logf("%d lease calls, %.1f%% at the limit; %d fleet, %d policy, %d returns", leases, 100*share,
				rec.calls[callFleet], rec.calls[callPolicy], rec.calls[callReturn])
			if !tc.atLimit(share) || rec.calls[callFleet] == 0 || rec.calls[callPolicy] == 0 {
				t.Fatalf("%.1f%% of %d lease calls at the limit, want %s; %d fleet and %d policy calls, want some",
					100*share, leases, tc.want, rec.calls[callFleet], rec.calls[callPolicy])
			}
		})
	}
}
