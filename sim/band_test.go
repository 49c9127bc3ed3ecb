package main

import (
	"math/rand/v2"
	"testing"
)

// bandCalls models one process of an in-flight limit: Poisson arrivals
// at lambda per second, exponential work of mean 1/mu seconds (M/M/∞),
// and a store call whenever the requests in flight leave the band the
// process holds: above its holding, or more than w slots below it. After
// each call the holding is re-centred off slots above what is in flight.
// It returns the calls per 1 000 arrivals over t simulated seconds.
func bandCalls(lambda, mu float64, w, off int, t float64, seed uint64) float64 {
	r := rand.New(rand.NewPCG(seed, 1))
	var now float64
	n, held, arrivals, calls := 0, off, 0, 0
	for now < t {
		rate := lambda + float64(n)*mu
		now += r.ExpFloat64() / rate
		if r.Float64() < lambda/rate {
			n++
			arrivals++
		} else {
			n--
		}
		if n > held || held-n > w {
			calls++
			held = n + off
		}
	}
	return 1000 * float64(calls) / float64(arrivals)
}

// TestBandModel: the floor under in-flight-spike's store calls when the
// cap is close to the load (docs/simulator.md). With about 2 requests in
// flight per process (100/s of 20 ms work), the fewest calls per 1 000
// over every re-centring is high for a band of 4 idle slots and small
// only from 8, which 8 processes cannot all hold under a cap of 50 with
// 16 in use.
func TestBandModel(t *testing.T) {
	best := func(w int) float64 {
		least := 1e9
		for off := 0; off <= w; off++ {
			least = min(least, bandCalls(100, 50, w, off, 2000, 7))
		}
		return least
	}
	b4, b6, b8 := best(4), best(6), best(8)
	t.Logf("fewest store calls per 1 000 arrivals: band 4: %.0f, band 6: %.0f, band 8: %.1f", b4, b6, b8)
	if b4 < 100 || b8 > 20 || !(b4 > b6 && b6 > b8) {
		t.Fatalf("the model moved: %.0f, %.0f, %.1f", b4, b6, b8)
	}
}
