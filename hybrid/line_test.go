package hybrid

import (
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/leasehold/leasehold/internal/lease"
	"github.com/leasehold/leasehold/remote"
)

// TestStrictLinesKeepBucketPlusHeld plays random grants (each with a
// round trip: sent, run by the store, deposited), spends and
// store-decided admissions of three processes on one token bucket, kept
// as the store keeps it (a theoretical arrival time, ResetAfter rounded up
// to the microsecond), with WithStrictWindows' rules: each grant's line
// from leaser.lifetime, cells merged by lease.Cell.AddDecaying. At every
// event the bucket plus every spendable token must be at most Burst: what
// the fleet could admit at one instant. The merge this replaced (old
// tokens carried under the new grant's end, less their own refill time)
// measured 83.8 tokens over a Burst of 100 here.
func TestStrictLinesKeepBucketPlusHeld(t *testing.T) {
	t.Parallel()
	for _, lim := range []Limit{
		{Rate: 100, Period: time.Second, Burst: 100},
		{Rate: 10, Period: time.Second, Burst: 10},
		{Rate: 3, Period: time.Second, Burst: 7},
	} {
		worst, spent, offered := -math.MaxFloat64, int64(0), int64(0)
		for seed := range 500 {
			w, s, o := playLines(t, lim, uint64(seed))
			worst, spent, offered = max(worst, w), spent+s, offered+o
		}
		t.Logf("%v: bucket + held at most %.2f from Burst; %d spends, %d tokens granted", lim, worst, spent, offered)
		if spent == 0 {
			t.Fatalf("%v: no spend succeeded: the lines hold nothing", lim)
		}
	}
}

// playLines is one play of TestStrictLinesKeepBucketPlusHeld: the most
// bucket plus held tokens exceeded Burst by (at most 0 unless it fails),
// the spends that succeeded and the tokens granted.
func playLines(t *testing.T, lim Limit, seed uint64) (worst float64, spent, offered int64) {
	step := tokenStep(lim)
	ls := &leaser{}
	r := rand.New(rand.NewPCG(seed, 1))
	var tat int64    // the bucket is full from tat on
	var lastAt int64 // the store's last call: calls run in order
	cells := make([]lease.Cell, 3)
	now := int64(time.Second)
	level := func(t int64) float64 { return float64(lim.Burst) - float64(max(tat-t, 0))/float64(step) }
	worst = -math.MaxFloat64
	for range 300 {
		if r.IntN(4) > 0 { // else a burst: several events at one instant
			now += r.Int64N(int64(lim.Period) / lim.Rate * 8)
		}
		p := &cells[r.IntN(len(cells))]
		switch r.IntN(3) {
		case 0: // a grant of what the bucket holds, or less
			// Sent at start, run by the store at at, deposited at now:
			// a round trip of up to 3 tokens' refill.
			start := now - r.Int64N(3*step)
			at := max(start+r.Int64N(now-start+1), lastAt)
			lastAt = at
			L := int64(math.Floor(level(at)))
			if L < 1 {
				continue
			}
			g := 1 + r.Int64N(L)
			tat = max(tat, at) + g*step
			ra := (time.Duration(tat-at) + time.Microsecond - 1).Truncate(time.Microsecond)
			end := ls.lifetime(remote.Result{Granted: g, ResetAfter: ra}, mono(start))
			p.AddDecaying(g, int64(end), now, step+1, r.Float64())
			offered += g
		case 1:
			if ok, _, _ := p.TakeDecaying(1+r.Int64N(5), now); ok {
				spent++
			}
		case 2: // the store admits a request itself
			if level(now) >= 1 {
				tat, lastAt = max(tat, now)+step, now
			}
		}
		sum := level(now)
		for i := range cells {
			sum += float64(cells[i].Spendable(now))
		}
		if sum-float64(lim.Burst) > 1e-9 {
			t.Fatalf("%v, seed %d, at %v: bucket %.2f + held = %.2f > Burst %d", lim, seed, time.Duration(now), level(now), sum, lim.Burst)
		}
		worst = max(worst, sum-float64(lim.Burst))
	}
	return worst, spent, offered
}
