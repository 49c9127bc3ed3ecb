package hybrid

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/leasehold/leasehold/reconcile"
	"github.com/leasehold/leasehold/remote"
)

// Reservation is n tokens of a key held for a caller, in the shape of
// golang.org/x/time/rate's: OK says whether they were granted, Delay how
// long the caller must wait before acting on them, and Cancel gives them
// back if it will not. A Reservation is safe for concurrent use.
type Reservation struct {
	ok        bool
	at        time.Time // when the tokens may be used
	n         int64
	fromStore bool // granted by the store (Cancel returns them there)
	key       string
	tier      uint16
	grantedAt time.Time // store time of the grant, for a sliding window
	l         *Limiter
	cancelled atomic.Bool
}

// OK reports whether the tokens were granted. When false, Delay is 0 and
// Cancel does nothing.
func (r *Reservation) OK() bool { return r.ok }

// Delay is shorthand for DelayFrom(now) on the limiter's clock.
func (r *Reservation) Delay() time.Duration { return r.DelayFrom(r.l.cfg.clk.Now()) }

// DelayFrom returns how long after t the caller must wait before acting on
// the reservation; 0 means now.
func (r *Reservation) DelayFrom(t time.Time) time.Duration {
	if !r.ok {
		return 0
	}
	return max(r.at.Sub(t), 0)
}

// Cancel gives the tokens back if their time has not come yet (or comes
// this very moment), so that others may use them. After that time, or a
// second time, it does nothing: the tokens count as used.
func (r *Reservation) Cancel() {
	if !r.ok || !r.fromStore || !r.cancelled.CompareAndSwap(false, true) {
		return
	}
	if !r.l.cfg.clk.Now().After(r.at) {
		r.l.settle.soon(r.l.reservationReturn(r.l.policy.load(), r.key, r.tier, r.n, r.grantedAt))
	}
}

// ReserveN holds n tokens of key for the caller, who acts after Delay:
// now when this process's lease or the bucket has them, else at the time
// the bucket will have produced them (a future-dated grant from the store,
// at most the time the bucket takes to fill from empty). Such tokens count
// as used from the moment they are granted, so Cancel the reservation if
// you will not act on it. OK is false when the bucket cannot have them in
// that time, or when the store is unavailable and this process's degraded
// share cannot admit them now. Errors are AllowN's.
func (l *Limiter) ReserveN(ctx context.Context, key string, n int64) (*Reservation, error) {
	p := l.policy.load()
	tier := l.tierIndex(p, key)
	if err := l.checkRequest(p, &p.tiers[tier], key, n, l.keys.entries.load(key) != nil); err != nil {
		return nil, err
	}
	r := &Reservation{l: l, key: key, tier: tier, n: n, at: l.cfg.clk.Now()}
	e, ok, _ := l.leased(key, n, l.spendAt())
	if !ok && e != nil {
		ok, _ = l.leaser.spendDue(e, n, l.cfg.now())
	}
	if ok {
		r.ok = true
		return r, nil
	}
	res, err := l.reserveFromStore(ctx, p, key, tier, n)
	if err != nil {
		if !remote.IsUnavailable(err) || ctx.Err() != nil {
			return nil, err
		}
		// The store is away: this process's degraded share decides, now
		// or not at all.
		d, err := l.AllowN(ctx, key, n)
		r.ok = err == nil && d.Allowed
		return r, err
	}
	if res.Granted < n {
		if res.Granted > 0 { // cannot happen with Min = n; give back all the same
			l.settle.later(l.reservationReturn(p, key, tier, res.Granted, res.Now))
		}
		return r, nil
	}
	r.ok, r.fromStore, r.grantedAt = true, true, res.Now
	r.at = r.at.Add(res.Delay)
	return r, nil
}

// reservationReturn gives back n tokens of key under tier, granted at
// store time since.
func (l *Limiter) reservationReturn(p *policyState, key string, tier uint16, n int64, since time.Time) reconcile.Item {
	req := p.requestFor(l.cfg.prefix, key, tier)
	req.N, req.Since = n, since
	return reconcile.Item{Op: remote.OpReturn, Req: req}
}

// reserveFromStore asks the store for exactly n tokens, future-dated if
// need be.
func (l *Limiter) reserveFromStore(ctx context.Context, p *policyState, key string, tier uint16, n int64) (remote.Result, error) {
	ctx, cancel := context.WithTimeout(ctx, l.cfg.storeTimeout)
	defer cancel()
	req := p.requestFor(l.cfg.prefix, key, tier)
	req.N, req.Min, req.Need = n, n, n
	if !p.shaped {
		req.MaxDelay = req.Limit.DurationFor(req.Limit.Burst)
	}
	res, err := l.store.Lease(ctx, req)
	l.stats.storeCalls.Add(1)
	if err != nil {
		l.stats.storeErrors.Add(1)
		return remote.Result{}, err
	}
	if res.Stale && l.policy.learn(res.Version) {
		l.bg.After(0, func() { l.policy.refreshShared(l.bg.Ctx) })
	}
	return res, nil
}
