package hybrid

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leasehold/leasehold/breaker"
	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/local"
	"github.com/leasehold/leasehold/remote"
)

// entry is the local state of one key. The first fields are the hot path's
// and are only touched atomically; the rest are for the slow paths.
type entry struct {
	lease    local.Lease
	admits   atomic.Int64 // decisions admitted from the lease
	lowWater atomic.Int64 // refill in the background below this many tokens

	refilling    atomic.Bool  // a background refill is running
	emptyUntil   atomic.Int64 // mono ns: the store said empty until then
	pendingUntil atomic.Int64 // mono ns: a reservation becomes spendable then
	resetAt      atomic.Int64 // mono ns: the bucket is full then (last answer)
	added        atomic.Int64 // tokens put into the lease
	drained      atomic.Int64 // tokens taken out of the lease unspent
	misses       atomic.Int64 // tokens asked for on the slow path
	debt         atomic.Int64 // tokens admitted in degraded mode, not yet charged
	waiting      atomic.Int64 // tokens wanted by callers waiting on a store call

	key string

	mu struct {
		sync.Mutex
		demand   demand
		pending  []*reservation // future-dated grants not yet spendable
		degraded *local.Bucket
		share    local.Limit // the limit degraded was built for
	}

	// Owned by sweep, which runs one pass at a time.
	seen       int64
	idleSweeps int
}

type reservation struct {
	n     int64
	until int64 // mono ns
	timer clock.Timer
}

func newEntry(key string) *entry { return &entry{key: key} }

func (e *entry) resetAfter(now int64) time.Duration {
	return time.Duration(max(e.resetAt.Load()-now, 0))
}

// consumed is the tokens spent from the lease so far: every token that
// entered the cell either was spent, was drained, or is still there.
func (e *entry) consumed() int64 {
	return e.added.Load() - e.drained.Load() - e.lease.Tokens()
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
	minSample  = 2 * time.Millisecond
	demandTau  = time.Second
	maxSamples = 1 << 20
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

// sizeLease picks the batch to ask for and the low-water mark, from the
// key's demand: demand × horizon, at least need and 1, at most the policy's
// maximum lease (unless need alone is larger).
func (l *Limiter) sizeLease(e *entry, p *policyState, need int64, now int64) int64 {
	e.mu.Lock()
	rate := e.mu.demand.observe(now, e.consumed()+e.misses.Load())
	e.mu.Unlock()
	perHorizon := rate * l.cfg.horizon.Seconds()
	batch := int64(math.Ceil(perHorizon))
	batch = min(max(batch, 1), p.maxLease)
	low := min(int64(perHorizon/2), batch/2)
	e.lowWater.Store(low)
	return max(batch, need)
}

// refillAsync starts a background refill of e unless one is running or a
// reservation is on its way. It runs about once per batch, not per request.
func (l *Limiter) refillAsync(e *entry) {
	if e.pendingUntil.Load() != 0 || !e.refilling.CompareAndSwap(false, true) {
		return
	}
	if l.after(0, func() {
		defer e.refilling.Store(false)
		_, _ = l.fetch(context.Background(), e, 0)
	}) == nil {
		e.refilling.Store(false)
	}
}

type fetchOutcome struct {
	deposited bool
	retry     time.Duration
}

// errSlowFlight reports a synchronous caller that stopped waiting for a
// store call after the store timeout; the call itself goes on.
var errSlowFlight = fmt.Errorf("hybrid: store slower than the store timeout: %w", remote.ErrUnavailable)

// fetch asks the store for tokens for e, one flight per key: concurrent
// callers share the call and its outcome. need is the request that could
// not be served; 0 marks a background refill, which waits for the store as
// long as the refill timeout allows, while a synchronous caller waits at
// most the store timeout (the flight goes on without it).
func (l *Limiter) fetch(ctx context.Context, e *entry, need int64) (fetchOutcome, error) {
	fn := func() (any, error) {
		if !l.enterBackground() {
			return fetchOutcome{}, ErrClosed
		}
		defer l.life.wg.Done()
		return l.leaseFor(e, need)
	}
	if need == 0 {
		v, err, _ := l.flights.Do(e.key, fn)
		out, _ := v.(fetchOutcome)
		return out, err
	}
	ch := l.flights.DoChan(e.key, fn)
	t := l.cfg.clk.NewTimer(l.cfg.storeTimeout)
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

func (l *Limiter) leaseFor(e *entry, need int64) (fetchOutcome, error) {
	l.syncPolicyOnce()
	p := l.pol.Load()
	start := l.now()
	// A flight that just ended may already have served this caller.
	if need > 0 && e.lease.Tokens() >= need {
		return fetchOutcome{deposited: true}, nil
	}
	if until := max(e.pendingUntil.Load(), e.emptyUntil.Load()); until > start {
		return fetchOutcome{retry: time.Duration(until - start)}, nil
	}
	// Lease for every caller waiting on this key, not just the one that
	// started the flight: the others joined it and will take from it.
	want := min(l.sizeLease(e, p, max(need, e.waiting.Load()), start), p.Limit.Burst)
	minimum := want
	if l.cfg.maxDelay == 0 {
		// Without reservations, take what is there rather than nothing.
		minimum = max(need, 1)
	}
	// Not the caller's context: joined callers share this call. Close ends
	// it; the refill timeout bounds it.
	cctx, cancel := context.WithTimeout(l.ctx, l.cfg.refillTimeout)
	defer cancel()
	req := remote.Request{Prefix: l.cfg.prefix, Policy: p.Name, Key: e.key, Limit: p.Limit, Version: p.Version,
		N: want, Min: minimum, MaxDelay: l.cfg.maxDelay}
	res, err := l.store.Lease(cctx, req)
	if errors.Is(err, breaker.ErrOpen) {
		return fetchOutcome{}, err // refused by the breaker: no call was made
	}
	l.stats.storeCalls.Add(1)
	if err != nil {
		l.stats.storeErrors.Add(1)
		return fetchOutcome{}, err
	}
	now := l.now()
	l.lastOK.Store(now)
	l.observeClock(res, start, now)
	if res.Stale {
		l.learnVersion(res.Version)
		return fetchOutcome{retry: staleRetry}, nil
	}
	e.resetAt.Store(now + int64(res.ResetAfter))
	switch {
	case res.Granted > 0 && res.Delay <= 0:
		l.stats.leaseGrants.Add(1)
		e.emptyUntil.Store(0)
		l.deposit(e, res.Granted, now)
		return fetchOutcome{deposited: true}, nil
	case res.Granted > 0:
		l.stats.leaseGrants.Add(1)
		e.emptyUntil.Store(0)
		l.reserve(e, res.Granted, res.Delay, now)
		return fetchOutcome{retry: res.Delay}, nil
	default:
		e.emptyUntil.Store(now + int64(res.RetryAfter))
		return fetchOutcome{retry: res.RetryAfter}, nil
	}
}

// deposit puts granted tokens in e's lease; if e was closed meanwhile
// (eviction, Close) they go back to the store instead.
func (l *Limiter) deposit(e *entry, n, now int64) {
	l.stats.tokensLeased.Add(n)
	if e.lease.Add(n, now+int64(l.cfg.leaseTTL)) {
		e.added.Add(n)
		return
	}
	l.queue(l.returnItem(e.key, n))
}

// reserve holds a future-dated grant until it becomes spendable, then
// deposits it. Until then the key rejects locally with the exact wait.
func (l *Limiter) reserve(e *entry, n int64, delay time.Duration, now int64) {
	if !l.enterBackground() {
		l.queue(l.returnItem(e.key, n))
		return
	}
	l.stats.tokensReserved.Add(n)
	r := &reservation{n: n, until: now + int64(delay)}
	e.mu.Lock()
	e.mu.pending = append(e.mu.pending, r)
	e.setPendingUntilLocked()
	// Scheduled under e.mu: the callback takes e.mu, so it cannot run
	// before r.timer is set (delay > 0, so it never runs inline).
	r.timer = l.cfg.clk.AfterFunc(delay, func() {
		defer l.life.wg.Done()
		e.mu.Lock()
		mine := e.removePendingLocked(r)
		e.mu.Unlock()
		if mine {
			l.deposit(e, n, l.now())
		}
	})
	e.mu.Unlock()
}

// removePendingLocked drops r from the pending list and reports whether it
// was there (false once Close or eviction took it).
func (e *entry) removePendingLocked(r *reservation) bool {
	for i, x := range e.mu.pending {
		if x == r {
			e.mu.pending = append(e.mu.pending[:i], e.mu.pending[i+1:]...)
			e.setPendingUntilLocked()
			return true
		}
	}
	return false
}

func (e *entry) setPendingUntilLocked() {
	var until int64
	for _, r := range e.mu.pending {
		until = max(until, r.until)
	}
	e.pendingUntil.Store(until)
}

// cancelReservation takes e's pending reservations and returns their
// tokens for the caller to give back.
func (l *Limiter) cancelReservation(e *entry) int64 {
	e.mu.Lock()
	rs := e.mu.pending
	e.mu.pending = nil
	e.pendingUntil.Store(0)
	e.mu.Unlock()
	var n int64
	for _, r := range rs {
		n += r.n
		if r.timer.Stop() {
			l.life.wg.Done() // the callback will never run
		}
	}
	return n
}

// outage decides while the store is unavailable, by the OutageMode.
func (l *Limiter) outage(e *entry, p *policyState, n, now int64) Decision {
	switch l.cfg.outage {
	case OutageFailOpen:
		l.stats.admitted[SourceFailOpen].Add(1)
		e.debt.Add(n)
		return Decision{Allowed: true, Limit: p.Limit, Source: SourceFailOpen}
	case OutageFailClosed:
		l.stats.rejected[SourceFailClosed].Add(1)
		return Decision{Limit: p.Limit, RetryAfter: l.cfg.storeTimeout, Source: SourceFailClosed}
	}
	b := l.degradedBucket(e, p, now)
	r, err := b.TakeAt(now, n)
	if err != nil || !r.Allowed {
		l.stats.rejected[SourceDegraded].Add(1)
		wait := r.RetryAfter
		if err != nil { // n above this process's share of Burst
			wait = p.Limit.DurationFor(n)
		}
		return Decision{Limit: b.Limit(), Remaining: r.Remaining, RetryAfter: wait, ResetAfter: r.ResetAfter, Source: SourceDegraded}
	}
	l.stats.admitted[SourceDegraded].Add(1)
	e.debt.Add(n)
	return Decision{Allowed: true, Limit: b.Limit(), Remaining: r.Remaining, ResetAfter: r.ResetAfter, Source: SourceDegraded}
}

// degradedBucket returns e's local GCRA at this process's share of the
// limit, rebuilt when the policy or the fleet size changes.
func (l *Limiter) degradedBucket(e *entry, p *policyState, now int64) *local.Bucket {
	share := l.share(p.Limit)
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.mu.degraded == nil || e.mu.share != share {
		b, err := local.NewBucket(share)
		if err != nil { // the share cannot be expressed; fall back to the whole limit
			b, _ = local.NewBucket(p.Limit)
		}
		if e.added.Load() > 0 {
			// The key was in use when the store went away: its global
			// bucket was likely drawn down, so the share starts empty and
			// refills at its rate instead of granting a fresh burst.
			b.Empty(now)
		}
		e.mu.degraded, e.mu.share = b, share
	}
	return e.mu.degraded
}

// share is this process's part of lim: Rate/N per Period (as Rate per
// N·Period, exactly) and Burst/N, at least 1.
func (l *Limiter) share(lim local.Limit) local.Limit {
	n := int64(l.fleetSize())
	if n <= 1 {
		return lim
	}
	s := local.Limit{Rate: lim.Rate, Period: lim.Period * time.Duration(n), Burst: max(1, lim.Burst/n)}
	if s.Validate() != nil || s.Period/time.Duration(n) != lim.Period {
		return lim
	}
	return s
}
