package remote

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"
)

// A pool is a region's share of a global bucket, kept in the region's own
// store by a Tiered store: tokens that the parent store granted and no
// process of the region has leased yet. Unlike a bucket it never refills
// by itself, so every token a process takes from it was granted by the
// parent. One record per bucket, under the bucket's hash tag; poolLua
// keeps it in Redis and applyPool, its Go twin, in a MemoryStore.
type poolState struct {
	level int64  // tokens held
	exp   int64  // µs: GCRA tokens go back to the parent after; window tokens lapse
	claim int64  // µs until which a refill (or a region beat) is in flight
	down  int64  // µs when the parent last failed; 0 once it answers again
	ver   uint64 // the parent bucket's policy version at the last refill
	rem   int64  // the parent bucket's Remaining at the last refill
	full  int64  // µs when the parent bucket would be full, as of the last refill; window pools: the parent's µs of the grant held (0: mixed)
	used  int64  // tokens taken since the last refill
	at    int64  // µs of the last refill
}

// poolOp is one operation on a pool record. Its arguments a..g mean, by
// op:
//
//	take   a n, b need, c hold µs (-1: tokens never lapse), d least low
//	       water, e claim length µs, f lead µs, g version: unless the pool
//	       is at a newer version, grant n, else all if at least need; then
//	       claim the refill if none is in flight and the pool holds less
//	       than d, or than the demand since the last refill over f
//	put    a n, b exp, c version, d parent remaining, e parent reset µs
//	       (-1 for a window pool), f (window) the parent's µs of the grant:
//	       deposit a refill from the parent; the parent is up. A bucket
//	       pool's tokens of an older version are taken out (granted) for
//	       the caller to give back. A window pool holds one grant at a
//	       time, with f (its Since) in full: what is left of the one held,
//	       lapsed or not, is taken out (granted, since) for the caller to
//	       give back, so lapsed tokens never come back to life
//	fail   the parent failed: takes report it until a put
//	give   a n, b since: tokens a process gave back; for a window pool
//	       (b, the µs of the take they came from, not 0) only if they came
//	       from the batch it holds and it has not lapsed
//	drain  take everything if exp has passed (to give back to the parent;
//	       full says, for a window pool, since when)
//	beat   a claim length µs: claim the region beat if none is in flight
//	weigh  a the world's weight a beat read, b the region's own weight it
//	       reported (kept in rem); the parent is up (fail marks it down)
type poolOp string

const (
	poolTake  poolOp = "take"
	poolPut   poolOp = "put"
	poolFail  poolOp = "fail"
	poolGive  poolOp = "give"
	poolDrain poolOp = "drain"
	poolBeat  poolOp = "beat"
	poolWeigh poolOp = "weigh"
)

// poolTTL is how long a pool record outlives its last write. Tokens in a
// pool that expires are lost to everyone, which errs on the safe side.
const poolTTL = 10 * time.Minute

// poolReply is the record after an operation, and what it granted.
type poolReply struct {
	granted int64
	since   int64 // for a window pool's tokens put or drain took out: the parent's µs of their grant
	claimed bool
	now     int64 // µs of the region store's clock
	st      poolState
}

// applyPool runs op on the record at store time now (µs); it mirrors
// poolLua step for step.
func applyPool(st poolState, op poolOp, a [7]int64, now int64) (poolState, poolReply) {
	var granted, since int64
	claimed := false
	switch op {
	case poolTake:
		granted, claimed = st.take(a, now)
	case poolPut:
		granted, since = st.put(a, now)
	case poolFail:
		st.down = now
	case poolGive:
		if a[1] == 0 || (a[1] >= st.at && now < st.exp) {
			st.level += a[0]
		}
	case poolDrain:
		if st.exp > 0 && now >= st.exp {
			granted, since, st.level = st.level, st.full, 0
		}
	case poolBeat:
		if now >= st.claim {
			st.claim, claimed = now+a[0], true
		}
	case poolWeigh:
		st.level, st.rem, st.down = a[0], a[1], 0
	}
	return st, poolReply{granted: granted, since: since, claimed: claimed, now: now, st: st}
}

// take grants from the pool and claims its refill (see poolTake).
func (st *poolState) take(a [7]int64, now int64) (granted int64, claimed bool) {
	usable := st.level
	if a[2] >= 0 && now+a[2] > st.exp {
		usable = 0 // window tokens that could be spent too late: the drain gives them back
	}
	switch {
	case uint64(a[6]) < st.ver:
	case usable >= a[0]:
		granted = a[0]
	case usable >= max(a[1], 1):
		granted = usable
	}
	usable -= granted
	st.level -= granted
	if granted > 0 {
		st.used += granted
	} else {
		st.used += a[0] // demand the pool could not meet
	}
	low := a[3]
	if st.at > 0 && now > st.at {
		low = max(low, cdiv(st.used*a[5], now-st.at))
	}
	if usable < low && now >= st.claim {
		st.claim, claimed = now+a[4], true
	}
	return granted, claimed
}

// put deposits a refill (see poolPut); granted and since are what it took
// out for the caller to give back.
func (st *poolState) put(a [7]int64, now int64) (granted, since int64) {
	window := a[4] < 0
	if uint64(a[2]) > st.ver && st.ver != 0 && st.level > 0 {
		// Tokens of an older policy version: a bucket pool's go back to
		// the parent, which rescaled its bucket without them; a window
		// pool's lapse.
		if !window {
			granted = st.level
		}
		st.level = 0
	}
	switch {
	case !window:
		st.exp, st.full = a[1], now+a[4]
	case a[0] == 0: // nothing came: the batch held stays as it is
	default:
		// One batch at a time, so that a give-back has one Since: what is
		// left of the one held, lapsed or not, goes back now (and never
		// comes back to life).
		if st.level > 0 {
			granted, since = st.level, st.full
		}
		st.level, st.exp, st.full = 0, a[1], a[5]
	}
	st.level += a[0]
	st.down = 0
	st.ver = max(st.ver, uint64(a[2]))
	st.rem = a[3]
	st.used, st.at = 0, now
	return granted, since
}

// PoolKey returns the key of a region's pool for a bucket: the bucket's
// key (TierBucketKey) with "pool:" after the prefix, in the bucket's slot.
func PoolKey(prefix, policy, tier, key string) string {
	if prefix == "" {
		prefix = DefaultPrefix
	}
	return prefix + "pool:" + strings.TrimPrefix(TierBucketKey(prefix, policy, tier, key), prefix)
}

// RegionKey returns the key where a region keeps the world's weight (the
// live limiters of every region) and its beat claim.
func RegionKey(prefix, policy string) string { return internalKey(prefix, policy, "region") }

// pooler is implemented by the stores that can hold a region's pools.
type pooler interface {
	pool(ctx context.Context, key string, op poolOp, a [7]int64) (poolReply, error)
}

var (
	_ pooler = (*RedisStore)(nil)
	_ pooler = (*MemoryStore)(nil)
)

func (s *RedisStore) pool(ctx context.Context, key string, op poolOp, a [7]int64) (poolReply, error) {
	v, err := poolScript.Run(ctx, s.c, []string{key}, string(op), a[0], a[1], a[2], a[3], a[4], a[5], a[6], poolTTL.Milliseconds()).Int64Slice()
	if err != nil {
		return poolReply{}, s.failed(key, err)
	}
	if len(v) != 13 {
		return poolReply{}, fmt.Errorf("remote: pool %q: %w: reply of %d fields", key, ErrCorruptState, len(v))
	}
	return poolReply{granted: v[0], since: v[12], claimed: v[1] == 1, now: v[2], st: poolState{
		level: v[3], exp: v[4], claim: v[5], down: v[6], ver: uint64(v[7]), rem: v[8], full: v[9], used: v[10], at: v[11],
	}}, nil
}

type memPools struct {
	mu    sync.Mutex
	pools map[string]memPool
}

type memPool struct {
	st       poolState
	deadline int64 // µs
}

func (s *MemoryStore) pool(ctx context.Context, key string, op poolOp, a [7]int64) (poolReply, error) {
	if err := ctx.Err(); err != nil {
		return poolReply{}, err
	}
	now := s.clk.Now().UnixMicro()
	p := &s.pools
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.pools == nil {
		p.pools = map[string]memPool{}
	}
	cur, ok := p.pools[key]
	if !ok || now >= cur.deadline {
		cur = memPool{}
	}
	st, rep := applyPool(cur.st, op, a, now)
	p.pools[key] = memPool{st: st, deadline: now + poolTTL.Microseconds()}
	return rep, nil
}
