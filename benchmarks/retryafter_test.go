package benchmarks

import (
	"context"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/go-redis/redis_rate/v10"
	"github.com/leasehold/leasehold/hybrid"
	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"github.com/leasehold/leasehold/remote"
)

// TestRetryAfterMatchesRedisRate: one process asks a key at its limit
// (20/s, burst 20) for 1 to 3 tokens every 10 ms, twice what the limit
// gives, through hybrid and through redis_rate side by side. Whenever both
// refuse, their RetryAfter for the caller's n should agree: the median
// difference within a quarter of a token's time, once the time between the
// two calls is allowed for. (Before, a paced key's refusal named the next
// release, not the caller's n: the median was 47–49 ms off.)
func TestRetryAfterMatchesRedisRate(t *testing.T) {
	if testing.Short() {
		t.Skip("4 s of real time")
	}
	srv := redistest.Standalone(t)
	c := srv.Client(t)
	ctx := context.Background()
	name := "retry-" + time.Now().Format("150405.000000")
	// Stock without flow: flow answers for its grant's own GCRA, whose
	// burst is a quarter of Burst, and the default was 8–18 ms off at the
	// median (a target of the one model still missed).
	lim, err := hybrid.New(remote.NewRedis(c), hybrid.Policy{Name: name, Limit: hybrid.PerSecond(20)}, hybrid.WithCapacityLeases(0))
	if err != nil {
		t.Fatal(err)
	}
	defer lim.Close(ctx)
	rr := redis_rate.NewLimiter(c)
	rl := redis_rate.Limit{Rate: 20, Period: time.Second, Burst: 20}
	r := rand.New(rand.NewPCG(3, 3))
	var diffs []time.Duration
	var askedAgain, admittedAgain int
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	deadline := time.Now().Add(4 * time.Second)
	for time.Now().Before(deadline) {
		<-tick.C
		n := 1 + r.Int64N(3)
		start := time.Now()
		d, err := lim.AllowN(ctx, "k", n)
		if err != nil {
			t.Fatal(err)
		}
		res, err := rr.AllowN(ctx, name+":k", rl, int(n))
		if err != nil {
			t.Fatal(err)
		}
		if d.Allowed || res.Allowed > 0 {
			continue
		}
		diffs = append(diffs, retryGap(d.RetryAfter, res.RetryAfter, time.Since(start)))
		if len(diffs)%10 == 0 {
			// Ask again exactly when told: with nobody else on the key,
			// the n tokens are there.
			time.Sleep(d.RetryAfter) // the wait RetryAfter names is what is tested
			askedAgain++
			if d2, err := lim.AllowN(ctx, "k", n); err == nil && d2.Allowed {
				admittedAgain++
			} else {
				t.Logf("n=%d first %v %v; again %v %v", n, d.Source, d.RetryAfter, d2.Source, d2.RetryAfter)
			}
			if _, err := rr.AllowN(ctx, name+":k", rl, int(n)); err != nil { // keep redis_rate's history alike
				t.Fatal(err)
			}
		}
	}
	slices.Sort(diffs)
	if len(diffs) < 20 {
		t.Fatalf("only %d refusals by both: the key was not at its limit", len(diffs))
	}
	median := diffs[len(diffs)/2]
	t.Logf("%d refusals by both: RetryAfter differs from redis_rate's by %v at the median, %v at p90; asked again after RetryAfter: %d of %d admitted",
		len(diffs), median.Round(time.Microsecond), diffs[len(diffs)*9/10].Round(time.Microsecond), admittedAgain, askedAgain)
	// A quarter of one token's 50 ms: the bug this guards against was a
	// whole token off at the median. A loaded machine alone has moved the
	// median to 3–5 ms (ticks bunch, and the two buckets' histories part).
	if median > 12500*time.Microsecond {
		t.Fatalf("median RetryAfter difference %v, want ≤ 12.5 ms", median)
	}
	if admittedAgain < askedAgain*9/10 {
		t.Fatalf("asked again after RetryAfter: %d of %d admitted, want ≥ 90%%", admittedAgain, askedAgain)
	}
}

// retryGap is how far apart the two answers' retry instants are at the
// least. redis_rate decided up to elapsed after hybrid did (the calls run
// one after the other), so its RetryAfter is shorter by up to elapsed for
// the same instant; a loaded machine stretches elapsed, and the raw
// difference with it.
func retryGap(hybridAfter, redisRateAfter, elapsed time.Duration) time.Duration {
	d := hybridAfter - redisRateAfter
	switch {
	case d < 0:
		return -d
	case d > elapsed:
		return d - elapsed
	}
	return 0
}
