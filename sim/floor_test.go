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
// all of them on a key asked twice its limit, few on one asked a tenth.
// A key at its limit holds flow, and its few lease calls include the
// stock of its first 100 ms, from a bucket still full (12% of them).
func TestCallsByKind(t *testing.T) {
	for _, tc := range []struct {
		name       string
		rateFactor int64 // the policy's rate and burst times this
		atLimit    func(share float64) bool
		want       string
	}{
		{"at twice the limit", 1, func(s float64) bool { return s >= 0.85 }, "at least 85%"},
		{"at a tenth of the limit", 20, func(s float64) bool { return s <= 0.1 }, "at most 10%"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// A fresh copy: shorten scales the traffic's slices in place.
			suite, err := loadSuite("healthy")
			if err != nil {
				t.Fatal(err)
			}
			s := *suite[0]
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

// TestFullFloorCounting: an admission is at the full-bucket floor when its
// key's bucket, fed only admissions, stayed full for a token's refill
// since its process's last decision on the key; a stretch full for less,
// or one that ended before that decision, does not count.
func TestFullFloorCounting(t *testing.T) {
	lim := hybrid.Limit{Rate: 100, Period: time.Second, Burst: 10} // a token per 10 ms
	ms := func(n float64) time.Duration { return time.Duration(n * float64(time.Millisecond)) }
	for _, c := range []struct {
		name   string
		admits []float64 // ms, a token each, before the decision
		last   float64   // the process's previous decision
		now    float64
		want   bool
	}{
		{"never drawn, full all along", nil, 100, 200, true},
		{"full for less than a token's refill since the last decision", nil, 100, 109, false},
		{"full for exactly a token's refill", nil, 100, 110, true},
		{"drawn empty at 0, full again from 100", seq(0, 10), 150, 200, true},
		{"drawn empty at 0, full only from 100", seq(0, 10), 50, 105, false},
		{"full 100–130, drawn since, after the last decision", append(seq(0, 10), 130, 131, 132), 90, 140, true},
		{"full 100–130, drawn since, before the last decision", append(seq(0, 10), 130, 131, 132), 135, 140, false},
		{"full 100–105 only, drawn since", append(seq(0, 10), 105, 106, 107), 90, 140, false},
		{"drawn 30 past empty (over-admitted): full only from 404", seq(0, 40), 50, 300, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := newFullFloor()
			f.bucket("k", lim, 0)
			for _, at := range c.admits {
				f.admit("k", lim, 1, ms(at))
			}
			if got := f.needsCall("k", lim, ms(c.last), ms(c.now)); got != c.want {
				t.Fatalf("at the floor: %v, want %v", got, c.want)
			}
		})
	}
	// Another key, or the same key under another limit, knows of no full
	// stretch before its first decision.
	f := newFullFloor()
	if f.needsCall("other", lim, 0, ms(5)) {
		t.Fatal("a key first seen now counted at the floor")
	}
	f.admit("k", lim, 1, 0)
	if f.needsCall("k", hybrid.Limit{Rate: 50, Period: time.Second, Burst: 10}, ms(1), ms(5)) {
		t.Fatal("a new limit counted a stretch from before it")
	}
}

// seq is n admission times 0.1 ms apart from `from` (ms): drawn ten
// times faster than a token's refill.
func seq(from float64, n int) []float64 {
	out := make([]float64, n)
	for i := range out {
		out[i] = from + float64(i)/10
	}
	return out
}
