package remote

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"github.com/leasehold/leasehold/local"
	"github.com/redis/go-redis/v9"
)

// TestShapeTwinsAgree drives shapeLua and its Go twin applyShape
// (MemoryStore on a manual clock) through the same random sequences:
// sliding windows and token buckets, one to three limits, leases with
// holds, returns with and without since, debits and policy changes. Every
// reply must be the same. On miniredis, whose TIME follows the manual
// clock, time also steps from a microsecond to past a period; on a real
// redis-server (its own Lua, cjson and TIME) time is the server's, and the
// twin's clock is moved to the TIME each reply names before the twin runs.
func TestShapeTwinsAgree(t *testing.T) {
	t.Run("miniredis", func(t *testing.T) {
		c, clk, step := miniredisTwin(t, time.Microsecond, 7*time.Millisecond, 333*time.Millisecond, 2*time.Second, 61*time.Second)
		sequences := 150
		if testing.Short() {
			sequences = 30
		}
		shapeTwinSequences(t, c, clk, sequences, func(_ time.Time) {}, step)
	})
	t.Run("redis", func(t *testing.T) {
		c := redistest.Standalone(t).Client(t)
		clk := clock.NewManual(time.Unix(0, 0))
		shapeTwinSequences(t, c, clk, 40, func(now time.Time) { clk.AdvanceTo(now) }, func(*rand.Rand) {})
	})
}

// shapeTwinSequences runs seqs random sequences on the script (through c)
// and on a MemoryStore on clk. at is told the store time of each script
// reply before the twin runs; step moves time between operations.
func shapeTwinSequences(t *testing.T, c redis.UniversalClient, clk *clock.Manual, seqs int, at func(time.Time), step func(*rand.Rand)) {
	t.Helper()
	lua, mem := NewRedis(c), NewMemory(clk)
	ctx := context.Background()
	run := fmt.Sprint(time.Now().UnixNano()) // a real server outlives a run
	r := rand.New(rand.NewPCG(13, 13))
	randLimit := func(window bool) local.Limit {
		periods := []time.Duration{time.Second, 10 * time.Second, time.Minute, 1500 * time.Millisecond}
		l := local.Limit{Rate: 1 + r.Int64N(50), Period: periods[r.IntN(len(periods))]}
		l.Burst = l.Rate
		if !window {
			l.Burst = 1 + r.Int64N(60)
		}
		return l
	}
	for seq := range seqs {
		window := r.IntN(2) == 0
		limits := make([]local.Limit, 1+r.IntN(3))
		for i := range limits {
			limits[i] = randLimit(window)
		}
		version := uint64(1)
		key := fmt.Sprintf("seq-%s-%d", run, seq)
		var lastNow time.Time
		for i := range 40 {
			if r.IntN(12) == 0 { // a policy change: new limits, maybe another algorithm
				version++
				window = r.IntN(3) > 0 == window
				for i := range limits {
					limits[i] = randLimit(window)
				}
				limits = limits[:1+r.IntN(len(limits))]
			}
			shortest := limits[0].Period
			capN := limits[0].Burst
			for _, l := range limits {
				shortest, capN = min(shortest, l.Period), min(capN, l.Burst)
			}
			req := Request{Policy: "twins", Key: key, Limit: limits[0], Also: limits[1:], Window: window, Version: version,
				N: 1 + r.Int64N(capN)}
			if len(req.Also) == 0 && !window {
				req.Also = []local.Limit{limits[0]} // keep it shaped: two equal limits
			}
			if window {
				req.Hold = time.Duration(r.Int64N(int64(shortest/10/time.Microsecond)+1)) * time.Microsecond
			}
			req.Need = 1 + r.Int64N(req.N)
			req.Min = req.Need
			op := []Op{OpLease, OpLease, OpLease, OpReturn, OpDebit}[r.IntN(5)]
			if op == OpReturn && r.IntN(4) > 0 {
				req.Since = lastNow
			}
			call := func(s Store) (Result, error) {
				switch op {
				case OpReturn:
					return s.Return(ctx, req)
				case OpDebit:
					return s.Debit(ctx, req)
				}
				return s.Lease(ctx, req)
			}
			got, gerr := call(lua)
			if gerr == nil {
				at(got.Now) // the twin runs at the script's TIME
			}
			want, werr := call(mem)
			if gerr != nil || werr != nil {
				t.Fatalf("seq %d step %d %v %+v: lua error %v, Go error %v", seq, i, op, req, gerr, werr)
			}
			if got != want {
				t.Fatalf("seq %d step %d %v %+v:\n lua %+v\n  Go %+v", seq, i, op, req, got, want)
			}
			if op == OpLease {
				lastNow = got.Now
			}
			step(r)
		}
	}
}

// miniredisTwin is a miniredis and a manual clock that move together: a
// twin test runs the script on the client and the Go twin on the clock;
// step advances both by one of steps, picked at random.
func miniredisTwin(t *testing.T, steps ...time.Duration) (redis.UniversalClient, *clock.Manual, func(*rand.Rand)) {
	t.Helper()
	mr := miniredis.RunT(t)
	start := time.Unix(1_700_000_000, 123_456_000)
	clk := clock.NewManual(start)
	mr.SetTime(start)
	c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { _ = c.Close() })
	return c, clk, func(r *rand.Rand) {
		d := steps[r.IntN(len(steps))]
		clk.Advance(d)
		mr.SetTime(clk.Now())
		mr.FastForward(d)
	}
}
