package hybrid

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"sync/atomic"
	"time"

	"github.com/leasehold/leasehold/breaker"
	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/reconcile"
	"github.com/leasehold/leasehold/remote"
	"github.com/sony/gobreaker/v2"
	"golang.org/x/sync/singleflight"
)

// leaser owns getting tokens from the store into entries' leases: spending
// them (the hot path), one flight per key, lease sizing from demand,
// low-water refills, future-dated reservations, and the store-time offset
// measured from every reply.
type leaser struct {
	cfg    *config
	store  *breaker.Store
	policy *policyTracker
	bg     *background
	stats  *counters
	// giveBack settles tokens the leaser holds but cannot deposit.
	giveBack func(items ...reconcile.Item)
	// held reports that decisions stay on the degraded share after an
	// outage (outage.held): no refills then.
	held func() bool
	// fleet is N, the processes sharing the policy (outage.size).
	fleet   func() int
	flights singleflight.Group // keyed by user key only
	offset  clock.Offset
	lastOK  atomic.Int64 // mono ns of the last successful store reply
	// lostLogged is set once a vanished bucket has been logged.
	lostLogged atomic.Bool
}

// spend takes n tokens from e's lease for one decision and returns the
// tokens left, starting a background refill when the lease falls below
// its low-water mark. It is the hot path: e.spend inlines, and the refill
// call runs about once per batch.
func (ls *leaser) spend(e *entry, n int64) (ok bool, left int64) {
	ok, low, left := e.spend(n)
	if low {
		ls.refillAsync(e)
	}
	return ok, left
}

// sizeLease picks the batch to ask for and the low-water mark, from the
// key's demand: demand × horizon, at least need and 1, at most the policy's
// maximum lease (unless need alone is larger).
func (ls *leaser) sizeLease(e *entry, p *policyState, need int64, now int64) int64 {
	e.mu.Lock()
	rate := e.demand.observe(now, e.consumed()+e.misses.Load())
	e.mu.Unlock()
	perHorizon := rate * ls.cfg.horizon.Seconds()
	batch := int64(math.Ceil(perHorizon))
	batch = min(max(batch, 1), p.maxLease)
	low := min(int64(perHorizon/2), batch/2)
	e.setLowWater(low)
	return max(batch, need)
}

// refillAsync starts a background refill of e unless one is running or
// reservations still hold more than the low-water mark. It runs about once
// per batch, not per request.
func (ls *leaser) refillAsync(e *entry) {
	if e.reserved() > int64(e.lowWater.Load()) || e.refilling.Load() || ls.held() || !e.refilling.CompareAndSwap(false, true) {
		return
	}
	if ls.bg.after(0, func() {
		defer e.refilling.Store(false)
		_, _ = ls.fetch(context.Background(), e, 0)
	}) == nil {
		e.refilling.Store(false)
	}
}

// fetchOutcome is what a flight did for its callers.
type fetchOutcome struct {
	deposited bool
	retry     time.Duration
	at        int64 // mono ns the outcome was known
}

// errSlowFlight reports a synchronous caller that stopped waiting for a
// store call after the store timeout; the call itself goes on.
var errSlowFlight = fmt.Errorf("hybrid: store slower than the store timeout: %w", remote.ErrUnavailable)

// fetch asks the store for tokens for e, one flight per key: concurrent
// callers share the call and its outcome. need is the request that could
// not be served; 0 marks a background refill, which waits for the store as
// long as the refill timeout allows, while a synchronous caller waits at
// most the store timeout (the flight goes on without it).
func (ls *leaser) fetch(ctx context.Context, e *entry, need int64) (fetchOutcome, error) {
	fn := func() (any, error) {
		if !ls.bg.enter() {
			return fetchOutcome{}, ErrClosed
		}
		defer ls.bg.exit()
		return ls.leaseFor(e, need)
	}
	if need == 0 {
		v, err, _ := ls.flights.Do(e.key, fn)
		out, _ := v.(fetchOutcome)
		return out, err
	}
	ch := ls.flights.DoChan(e.key, fn)
	t := ls.cfg.clk.NewTimer(ls.cfg.storeTimeout)
	defer t.Stop()
	select {
	case r := <-ch:
		out, _ := r.Val.(fetchOutcome)
		return out, r.Err
	case <-t.C():
		return fetchOutcome{}, errSlowFlight
	case <-ctx.Done():
		return fetchOutcome{}, ctx.Err()
	}
}

// leaseFor is one flight: a lease call sized for every caller waiting on
// e, unless an earlier flight already served them.
func (ls *leaser) leaseFor(e *entry, need int64) (fetchOutcome, error) {
	ls.policy.syncOnce(ls.bg.ctx)
	p := ls.policy.load()
	start := ls.cfg.now()
	// A flight that just ended may already have served this caller.
	if need > 0 && e.lease.Tokens() >= need {
		return fetchOutcome{deposited: true, at: start}, nil
	}
	var until int64
	if need > 0 {
		// A caller waits for tokens a reservation releases soon; a
		// refill asks for the grant after it.
		until = e.releaseAt(start)
	}
	if e.emptyForAtMost(max(need, 1)) {
		until = max(until, e.emptyUntil.Load()) // a refusal for as many or fewer tokens
	}
	if until > start {
		return fetchOutcome{retry: time.Duration(until - start), at: start}, nil
	}
	req := ls.request(e, p, need, start)
	// Not the caller's context: joined callers share this call. Close ends
	// it; the refill timeout bounds it.
	cctx, cancel := context.WithTimeout(ls.bg.ctx, ls.cfg.refillTimeout)
	defer cancel()
	e.callSince.Store(start + 1)
	res, err := ls.store.Lease(cctx, req)
	e.callSince.Store(0)
	if errors.Is(err, breaker.ErrOpen) {
		return fetchOutcome{}, err // refused by the breaker: no call was made
	}
	ls.stats.storeCalls.Add(1)
	if err != nil {
		ls.stats.storeErrors.Add(1)
		if errors.Is(err, remote.ErrCorruptState) {
			e.setCorrupt(err, ls.cfg.now()+int64(ls.cfg.leaseTTL))
		}
		return fetchOutcome{}, err
	}
	now := ls.cfg.now()
	ls.stats.storeLatency.observe(float64(now-start) / 1e9)
	ls.lastOK.Store(now)
	ls.offset.Observe(ls.cfg.epoch.Add(time.Duration(start)), ls.cfg.epoch.Add(time.Duration(now)), res.Now)
	return ls.apply(e, res, req.Need, now), nil
}

// request builds the lease request for e: sized for every caller waiting
// on the key, not just the one that started the flight (the others joined
// it and will take from it).
func (ls *leaser) request(e *entry, p *policyState, need, now int64) remote.Request {
	want := ls.sizeLease(e, p, max(need, e.waiting.Load()), now)
	if share := ls.contendedShare(e, p); share > want {
		want = share
		e.setLowWater(share / 4)
	}
	want = min(want, p.Limit.Burst)
	// A caller waits for this call: whatever covers its need is granted
	// now. A background refill prefers a future-dated full lease (paced
	// grants on a contended key) and takes the tail of the bucket only
	// when no full lease can be future-dated.
	minimum, floor := max(need, 1), max(need, 1)
	if need == 0 && ls.cfg.maxDelay > 0 {
		minimum = want
	}
	return remote.Request{Prefix: ls.cfg.prefix, Policy: p.Name, Key: e.key, Limit: p.Limit, Version: p.Version,
		N: want, Min: minimum, Need: floor, MaxDelay: ls.cfg.maxDelay}
}

// contendedShare is the grant to ask for on a key at its limit (the last
// answer left the bucket below one maximum lease, or tokens are reserved):
// this process's fair share of the rate, Rate/N, over half the maximum
// reservation. Released at the bucket's pace (see reservation), such a
// grant keeps the bound in every window however large, so a key at its
// limit costs about 2·N store calls per maximum reservation, not one per
// maximum lease; half leaves room in the reservation horizon for every
// process's next grant. 0 when the key is not contended, reservations are
// off, or the store is not known healthy.
func (ls *leaser) contendedShare(e *entry, p *policyState) int64 {
	if ls.cfg.maxDelay <= 0 || ls.store.State() != gobreaker.StateClosed || ls.held() {
		// A probe of a store that was down gets a plain lease: a long
		// grant would fall due while the recovery hold still decides by
		// the degraded share, and be spent on top of it.
		return 0
	}
	if level := e.level.Load(); e.reserved() == 0 && (level < 0 || level >= p.maxLease) {
		return 0
	}
	n := int64(max(ls.fleet(), 1))
	return p.Limit.TokensIn(ls.cfg.maxDelay/2) / n
}

// apply records a lease reply on e, received at now, for a request that
// needed need tokens.
func (ls *leaser) apply(e *entry, res remote.Result, need, now int64) fetchOutcome {
	if res.Granted > 0 {
		ls.stats.leaseSizes.observe(float64(res.Granted))
	}
	if res.Stale {
		if ls.policy.learn(res.Version) {
			ls.bg.after(0, func() { ls.policy.refreshShared(ls.bg.ctx) })
		}
		return fetchOutcome{retry: staleRetry, at: now}
	}
	// A bucket found missing while it should have existed (half its TTL
	// margin of slack for clock drift) was removed by someone else.
	if res.Created && e.level.Load() >= 0 && now < e.resetAt.Load()+int64(remote.TTLMargin/2) {
		ls.bucketLost(e)
	}
	e.resetAt.Store(now + int64(res.ResetAfter))
	e.level.Store(res.Remaining)
	switch {
	case res.Granted > 0 && res.Delay <= 0:
		ls.stats.leaseGrants.Add(1)
		e.emptyUntil.Store(0)
		ls.deposit(e, res.Granted, now)
		return fetchOutcome{deposited: true, at: now}
	case res.Granted > 0:
		ls.stats.leaseGrants.Add(1)
		e.emptyUntil.Store(0)
		ls.reserve(e, res.Granted, res.Delay, now)
		return fetchOutcome{retry: res.Delay, at: now}
	default:
		e.setEmptyFor(max(need, 1))
		e.emptyUntil.Store(now + int64(res.RetryAfter))
		return fetchOutcome{retry: res.RetryAfter, at: now}
	}
}

// bucketLost counts a bucket that vanished before its TTL (evicted by a
// Redis under memory pressure, or deleted) while this process used it: it
// came back full, so the fleet may admit a fresh burst. Logged once.
func (ls *leaser) bucketLost(e *entry) {
	ls.stats.bucketsLost.Add(1)
	if ls.lostLogged.CompareAndSwap(false, true) {
		ls.cfg.logger.LogAttrs(context.Background(), slog.LevelError,
			"leasehold: a bucket vanished before its TTL (evicted? set maxmemory-policy noeviction)",
			slog.String("key", e.key))
	}
}

// deposit puts granted tokens in e's lease; if e was closed meanwhile
// (eviction, Close) they go back to the store instead.
func (ls *leaser) deposit(e *entry, n, now int64) {
	ls.stats.tokensLeased.Add(n)
	if e.lease.Add(n, now+int64(ls.cfg.leaseTTL)) {
		e.inflow.Add(n)
		return
	}
	ls.giveBack(ls.returnItem(e.key, n))
}

// release closes e's lease and cancels its reservations, returning the
// settlements that give their tokens back.
func (ls *leaser) release(e *entry) []reconcile.Item {
	var out []reconcile.Item
	if n := e.lease.Close(); n > 0 {
		e.inflow.Add(-n)
		out = append(out, ls.returnItem(e.key, n))
	}
	if n := ls.cancelReservations(e); n > 0 {
		out = append(out, ls.returnItem(e.key, n))
	}
	return out
}

// cancelReservations cancels e's reservations and returns how many tokens
// they had not released.
func (ls *leaser) cancelReservations(e *entry) int64 {
	r := e.rare.Load()
	if r == nil {
		return 0
	}
	e.mu.Lock()
	rs := r.pending
	r.pending = nil
	e.setPendingLocked()
	timers := make([]clock.Timer, len(rs))
	for i, x := range rs {
		timers[i] = x.timer // read under e.mu: a firing callback re-arms it
	}
	e.mu.Unlock()
	var n int64
	for i, x := range rs {
		n += x.n - x.delivered
		if timers[i].Stop() {
			ls.bg.exit() // no callback will run; a running one finds r gone and exits
		}
	}
	return n
}

// drainExpired takes back e's lease if it expired at or before now.
func (ls *leaser) drainExpired(e *entry, now int64) []reconcile.Item {
	if n := e.lease.DrainExpired(now); n > 0 {
		e.inflow.Add(-n)
		return []reconcile.Item{ls.returnItem(e.key, n)}
	}
	return nil
}

// cut trims e's lease to at most keep tokens and returns the excess as a
// settlement.
func (ls *leaser) cut(e *entry, keep int64) []reconcile.Item {
	if n := e.lease.Cut(keep); n > 0 {
		e.inflow.Add(-n)
		return []reconcile.Item{ls.returnItem(e.key, n)}
	}
	return nil
}

func (ls *leaser) returnItem(key string, n int64) reconcile.Item {
	p := ls.policy.load()
	return reconcile.Item{Op: remote.OpReturn, Req: remote.Request{Prefix: ls.cfg.prefix, Policy: p.Name, Key: key,
		Limit: p.Limit, Version: p.Version, N: n}}
}
