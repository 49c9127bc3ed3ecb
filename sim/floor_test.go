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
