package hybrid

import (
	"context"
	"time"

	"github.com/leasehold/leasehold/reconcile"
	"github.com/leasehold/leasehold/remote"
)

// observeClock feeds the Redis-time offset estimator with one round trip
// (start and end in mono ns).
func (l *Limiter) observeClock(res remote.Result, start, end int64) {
	l.offset.Observe(l.epoch.Add(time.Duration(start)), l.epoch.Add(time.Duration(end)), res.Now)
}

// ClockOffset returns the estimated store clock minus this process's clock
// (0 before the first store reply). Decisions never depend on it: every
// duration the store returns is applied from the moment its reply arrived,
// which is conservative whatever the offset.
func (l *Limiter) ClockOffset() time.Duration {
	d, _ := l.offset.Get()
	return d
}

// heartbeat announces this limiter in the policy's fleet set (every
// heartbeat interval) and keeps the live count. Failures keep the last
// count: during an outage the fleet is as big as it was before.
func (l *Limiter) heartbeat() {
	if l.Mode() == ModeDegraded {
		return // the breaker is open: do not add to the store's load
	}
	ctx, cancel := context.WithTimeout(l.ctx, l.cfg.refillTimeout)
	defer cancel()
	if n, err := l.store.Heartbeat(ctx, l.cfg.prefix, l.pol.Load().Name, l.id, l.cfg.hbExpiry); err == nil {
		l.fleet.Store(int64(n))
		l.lastOK.Store(l.now())
	}
}

// FleetSize returns N, the number of processes this limiter assumes share
// its policy: WithFleetSize if set, else the last heartbeat count, else 1.
func (l *Limiter) FleetSize() int { return l.fleetSize() }

// fleetSize is N for degraded-mode shares: the configured size, else the
// last size heartbeats reported, else 1.
func (l *Limiter) fleetSize() int {
	if l.cfg.fleetSize > 0 {
		return l.cfg.fleetSize
	}
	return max(int(l.fleet.Load()), 1)
}

// hasOutageDebt reports whether anything is owed to the store: degraded
// admissions not yet charged or tokens not yet given back.
func (l *Limiter) hasOutageDebt() bool {
	owed := false
	l.entries.Range(func(_, v any) bool {
		owed = v.(*entry).debt.Load() != 0
		return !owed
	})
	if owed {
		return true
	}
	l.returns.Lock()
	defer l.returns.Unlock()
	return len(l.returns.items) > 0
}

// startSettleLocked charges what the outage admitted and gives back queued
// tokens, through the reconcile package: jittered, paced, batched, each
// step a callback of the limiter's clock. What the store could not take
// stays queued for the sweeper or the next recovery. Requires l.modeMu.
func (l *Limiter) startSettleLocked() {
	p := l.pol.Load()
	now := l.now()
	var items []reconcile.Item
	l.entries.Range(func(_, v any) bool {
		e := v.(*entry)
		if d := l.unpaid(e, p, e.debt.Swap(0), now); d > 0 {
			items = append(items, reconcile.Item{Op: remote.OpDebit, Req: l.debitReq(p, e.key, d)})
		}
		return true
	})
	items = append(items, l.takeQueued()...)
	l.recov.Store(true)
	l.settling = l.settler.Start(items, func(rep reconcile.Report) {
		l.account(len(items), rep)
		l.requeue(rep.Failed)
		l.modeMu.Lock()
		defer l.modeMu.Unlock()
		l.settling = nil
		l.recov.Store(false)
		l.setModeLocked(l.modeFromBreaker())
	})
}

// unpaid is the part of admitted (tokens a key admitted while the store
// was away) that the time since has not paid for. The global bucket kept
// refilling during the outage, up to Burst; charging every admitted token
// would count that refill twice and starve the key after recovery. In
// degraded mode the local share bucket knows exactly how much of its
// recent use is still outstanding; fail-open has no such bucket and is
// charged at most one Burst, leaving the key empty.
func (l *Limiter) unpaid(e *entry, p *policyState, admitted, now int64) int64 {
	if admitted <= 0 {
		return 0
	}
	e.mu.Lock()
	b := e.mu.degraded
	e.mu.Unlock()
	if b == nil {
		return min(admitted, p.Limit.Burst)
	}
	used := b.Limit().Burst - b.Tokens(now)
	return min(admitted, used)
}

func (l *Limiter) debitReq(p *policyState, key string, n int64) remote.Request {
	// A debit may exceed Burst after a long outage; the store takes at most
	// MaxBurst per call, which is far above any sane debt.
	return remote.Request{Prefix: l.cfg.prefix, Policy: p.Name, Key: key, Limit: p.Limit, Version: p.Version, N: n}
}
