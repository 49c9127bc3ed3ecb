package hybrid

import (
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leasehold/leasehold/internal/lease"
	"github.com/leasehold/leasehold/local"
)

// entry is the local state of one key, shared by the concerns that act on
// it (key table, leaser, outage). The first fields are the hot path's and
// are only touched atomically; the rest are for the slow paths.
type entry struct {
	lease    lease.Cell
	admits   atomic.Int64 // decisions admitted from the lease
	lowWater atomic.Int64 // refill in the background below this many tokens

	refilling    atomic.Bool  // a background refill is running
	emptyUntil   atomic.Int64 // mono ns: the store said empty until then...
	emptyFor     atomic.Int64 // ...for requests of this many tokens or more
	pendingUntil atomic.Int64 // mono ns: a reservation's next tokens become spendable then; 0: none pending
	reserved     atomic.Int64 // tokens in pending reservations, not yet spendable
	resetAt      atomic.Int64 // mono ns: the bucket is full then (last answer)
	level        atomic.Int64 // tokens in the bucket at the last answer; -1 before the first
	levelAt      atomic.Int64 // mono ns of that answer
	added        atomic.Int64 // tokens put into the lease
	drained      atomic.Int64 // tokens taken out of the lease unspent
	misses       atomic.Int64 // tokens asked for on the slow path
	debt         atomic.Int64 // tokens admitted in degraded mode, not yet charged
	waiting      atomic.Int64 // tokens wanted by callers waiting on a store call
	callSince    atomic.Int64 // mono ns + 1 when the store call in flight began; 0: none

	key string

	mu struct {
		sync.Mutex
		demand   demand
		pending  []*reservation // future-dated grants not yet spendable
		degraded *local.Bucket
		share    local.Limit // the limit degraded was built for
		corrupt  error       // the store's last ErrCorruptState for the key
		// charged is the share deficit the last settlement charged, at
		// chargedAt (mono ns); see outage.unpaid.
		charged   int64
		chargedAt int64
	}
	corruptUntil atomic.Int64 // mono ns: repeat mu.corrupt until then

	// Owned by the key table's sweep, which runs one pass at a time.
	seen       int64
	idleSweeps int
}

func newEntry(key string) *entry {
	e := &entry{key: key}
	e.level.Store(-1)
	return e
}

// spend takes n tokens from the lease and counts the admission; low
// reports that the lease fell below its low-water mark. Small enough to
// inline, so a decision on a leased key makes no call.
func (e *entry) spend(n int64) (ok, low bool, left int64) {
	if ok, left = e.lease.Take(n); ok {
		e.admits.Add(1)
		low = left < e.lowWater.Load()
	}
	return ok, low, left
}

func (e *entry) resetAfter(now int64) time.Duration {
	return time.Duration(max(e.resetAt.Load()-now, 0))
}

// remaining estimates what the fleet may still admit on e's key at now:
// the bucket level of the store's last answer, refilled at lim's rate
// since (other processes' spending is unknown to this one), plus left,
// this process's unspent lease; at most Burst and never below left.
func (e *entry) remaining(lim Limit, left, now int64) int64 {
	level := e.level.Load()
	if level < 0 {
		return left
	}
	level += lim.TokensIn(time.Duration(now - e.levelAt.Load()))
	return max(min(level+left, lim.Burst), left)
}

// corruption returns the store's cached ErrCorruptState answer for the
// key and how long it stays cached, or nil: a clobbered bucket costs one
// store call per lease TTL, not one per decision.
func (e *entry) corruption(now int64) (time.Duration, error) {
	until := e.corruptUntil.Load()
	if now >= until {
		return 0, nil
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	return time.Duration(until - now), e.mu.corrupt
}

// setCorrupt caches err, an ErrCorruptState answer, until `until`.
func (e *entry) setCorrupt(err error, until int64) {
	e.mu.Lock()
	e.mu.corrupt = err
	e.mu.Unlock()
	e.corruptUntil.Store(until)
}

// refund puts n tokens of a debit the store did not take back into the
// outage debt, and out of what the share counts as charged.
func (e *entry) refund(n int64) {
	e.mu.Lock()
	e.mu.charged = max(e.mu.charged-n, 0)
	e.mu.Unlock()
	e.debt.Add(n)
}

// consumed is the tokens spent from the lease so far: every token that
// entered the cell either was spent, was drained, or is still there.
func (e *entry) consumed() int64 {
	return e.added.Load() - e.drained.Load() - e.lease.Tokens()
}

// busy reports whether e holds anything that eviction would lose or that
// is still changing: tokens, a reservation, a refill, outage debt or a
// cached "empty until" answer.
func (e *entry) busy(now int64) bool {
	return e.lease.Tokens() > 0 || e.pendingUntil.Load() != 0 || e.refilling.Load() || e.debt.Load() != 0 ||
		e.emptyUntil.Load() > now
}

// demand estimates a key's token demand per second: a fast-attack,
// slow-decay average over samples at least minSample apart.
type demand struct {
	started bool
	at      int64 // mono ns of the sample window start
	base    int64 // count at the window start
	rate    float64
}

const (
	minSample = 2 * time.Millisecond
	demandTau = time.Second
)

func (d *demand) observe(now, count int64) float64 {
	if !d.started {
		d.started, d.at, d.base = true, now, count
		return d.rate
	}
	dt := now - d.at
	if dt < int64(minSample) {
		// Too soon for a sample, but a burst on a cold key must not wait
		// for one: take it as a rate over the minimum window if that is
		// higher (attack), and keep the window open.
		if r := float64(count-d.base) / minSample.Seconds(); r > d.rate {
			d.rate = r
		}
		return d.rate
	}
	r := float64(count-d.base) / (float64(dt) / 1e9)
	if r > d.rate {
		d.rate = r // attack at once: a batch too small costs round trips
	} else {
		d.rate += (1 - math.Exp(-float64(dt)/float64(demandTau))) * (r - d.rate)
	}
	d.at, d.base = now, count
	return d.rate
}
