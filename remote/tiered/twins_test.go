package tiered

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/leasehold/leasehold/internal/testkit/redistest"
)

// randomPoolOp draws a pool operation with arguments around now: times on
// both sides of it, versions older and newer; a grant renews at the
// pool's rate gper half the time.
func randomPoolOp(r *rand.Rand, now micros, ver *uint64, gper int64) poolOp {
	switch r.IntN(11) {
	case 0, 1, 2:
		return poolTake{N: 1 + r.Int64N(50), Need: r.Int64N(5), Window: r.IntN(3) == 0, Hold: micros(r.Int64N(200_000)),
			LowWater: 1 + r.Int64N(20), Claim: micros(1 + r.Int64N(500_000)), Lead: micros(r.Int64N(500_000)),
			Version: *ver - uint64(r.IntN(2))}
	case 3, 4:
		if r.IntN(6) == 0 {
			*ver++
		}
		return poolPut{N: r.Int64N(100), Exp: now + micros(r.Int64N(3_000_000)-500_000), Version: *ver,
			Rem: r.Int64N(1000), Reset: micros(r.Int64N(2_000_000)), Window: r.IntN(3) == 0, Since: now - micros(r.Int64N(1000))}
	case 5:
		return poolFail{}
	case 6:
		g := poolGive{N: r.Int64N(30)}
		if r.IntN(2) == 0 {
			g.Since = now - micros(r.Int64N(2_000_000))
		}
		return g
	case 7:
		return poolDrain{Idle: micros(r.Int64N(2_000_000))}
	case 8, 9:
		if r.IntN(8) == 0 {
			*ver++
		}
		g := poolGrant{Share: r.Int64N(1025), Gper: r.Int64N(3) * (1 + r.Int64N(5_000_000)), Cap: r.Int64N(200),
			Tokens: r.Int64N(50), GrantExp: now + micros(r.Int64N(3_000_000)-500_000), Renew: now + micros(r.Int64N(1_000_000)),
			Exp: now + micros(r.Int64N(3_000_000)), Version: *ver, Rem: r.Int64N(1000), Reset: micros(r.Int64N(2_000_000))}
		if r.IntN(2) == 0 {
			g.Gper = gper
		}
		if r.IntN(6) == 0 {
			g.Renew = 0 // grants off: back to batches
		}
		return g
	}
	return poolRead{}
}

func randomRegionOp(r *rand.Rand) regionOp {
	switch r.IntN(3) {
	case 0:
		return regionBeat{Claim: micros(1 + r.Int64N(2_000_000))}
	case 1:
		return regionFail{}
	}
	return regionWeigh{World: r.Int64N(30), Own: r.Int64N(10)}
}

// twinSequences runs random sequences of pool and region operations
// through the Lua scripts on c and through their Go twins at the time each
// Lua reply names, from the same state: every reply must be equal. step
// moves the Lua side's clock between operations (miniredis only; a real
// server's clock moves by itself, and the operations' times are drawn
// around its now, so both sides of every time comparison are reached).
func twinSequences(t *testing.T, c redis.UniversalClient, seqs int, step func(r *rand.Rand)) {
	lua := redisRecords{c: c}
	ctx := context.Background()
	r := rand.New(rand.NewPCG(7, 7))
	run := fmt.Sprint(time.Now().UnixNano()) // a real server outlives a run
	for seq := range seqs {
		poolKey, regionKey := fmt.Sprintf("{twin-%s-%d}:pool", run, seq), fmt.Sprintf("{twin-%s-%d}:region", run, seq)
		var pool poolState
		var region regionState
		ver, now := uint64(1), micros(0)
		for i := range 40 {
			if r.IntN(4) == 0 {
				op := randomRegionOp(r)
				got, err := lua.region(ctx, regionKey, op)
				if err != nil {
					t.Fatalf("seq %d step %d %T%+v: %v", seq, i, op, op, err)
				}
				var want regionReply
				region, want = applyRegion(region, op, got.now)
				if got != want {
					t.Fatalf("seq %d step %d %T%+v:\nlua %+v\n go %+v", seq, i, op, op, got, want)
				}
				now = got.now
			} else {
				op := randomPoolOp(r, now, &ver, pool.gper)
				got, err := lua.pool(ctx, poolKey, op)
				if err != nil {
					t.Fatalf("seq %d step %d %T%+v: %v", seq, i, op, op, err)
				}
				var want poolReply
				pool, want = applyPool(pool, op, got.now)
				if got != want {
					t.Fatalf("seq %d step %d %T%+v:\nlua %+v\n go %+v", seq, i, op, op, got, want)
				}
				now = got.now
			}
			step(r)
		}
	}
}

// TestPoolTwinsAgree holds poolLua and regionLua to their Go twins on
// miniredis, whose TIME a test moves (steps up to 700 ms), and on a real
// redis-server.
func TestPoolTwinsAgree(t *testing.T) {
	t.Run("miniredis", func(t *testing.T) {
		mr := miniredis.RunT(t)
		now := time.Unix(1_700_000_000, 123_456_000)
		mr.SetTime(now)
		c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
		t.Cleanup(func() { _ = c.Close() })
		twinSequences(t, c, 100, func(r *rand.Rand) {
			d := time.Duration(r.Int64N(int64(700 * time.Millisecond)))
			now = now.Add(d)
			mr.SetTime(now)
			mr.FastForward(d)
		})
	})
	t.Run("redis", func(t *testing.T) {
		c := redistest.Standalone(t).Client(t)
		twinSequences(t, c, 30, func(*rand.Rand) {})
	})
}
