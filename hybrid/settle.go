package hybrid

import (
	"context"
	"github.com/leasehold/leasehold/internal/errs"
	"log/slog"

	"github.com/leasehold/leasehold/reconcile"
	"github.com/leasehold/leasehold/remote"
)

// Settlements: every token the limiter gives back and every outage
// admission it owes goes through the queue and is sent by the sweeper,
// by a recovery (reconcile.Settler), or by Close.

// releaseEntry settles what e holds: its lease, its reservations and its
// outage debt (eviction, Close).
func (l *Limiter) releaseEntry(e *entry) { l.releaseUnder(l.policy.load(), e) }

// releaseUnder is releaseEntry with e's buckets named under p.
func (l *Limiter) releaseUnder(p *policyState, e *entry) {
	items := l.leaser.release(p, e)
	if d := e.takeDebt(); d > 0 {
		items = append(items, l.debitItem(p, e, d))
	}
	l.settleLater(items...)
}

// settleLater queues items; a full queue is flushed at once.
func (l *Limiter) settleLater(items ...reconcile.Item) {
	if l.queue.Add(items...) {
		l.bg.after(0, l.flushQueued)
	}
}

func (l *Limiter) debitItem(p *policyState, e *entry, n int64) reconcile.Item {
	// A debit may exceed Burst after a long outage; the store takes at most
	// MaxBurst per call, which is far above any sane debt.
	req := p.request(l.cfg.prefix, e)
	req.N = n
	return reconcile.Item{Op: remote.OpDebit, Req: req}
}

// sweep gives back expired leases, forgets idle keys, notices breaker
// changes and flushes the queue; it runs every sweep interval on the
// limiter's clock.
func (l *Limiter) sweep() {
	l.checkMode()
	now := l.cfg.now()
	// Decisions the store was too slow for, made while the breaker stayed
	// closed, are charged as a recovery would charge them, once the store
	// answers again (charged earlier, in an outage not yet detected, their
	// unpaid part would be counted twice).
	settleDebt := l.modes.mode() == ModeHealthy && now.sub(l.leaser.lastOK.Load()) < l.cfg.sweepInterval
	p := l.policy.load()
	l.keys.each(func(e *entry) {
		l.settleLater(l.leaser.drainExpired(p, e, now)...)
		if settleDebt && e.debt() != 0 {
			l.settleLater(l.debtItems(e, p, now)...)
		}
	})
	l.keys.sweepIdle(now, l.releaseEntry)
	l.flushQueued()
}

// debtItems takes e's outage debt and returns the debit of its unpaid part.
func (l *Limiter) debtItems(e *entry, p *policyState, now mono) []reconcile.Item {
	if d := l.outage.unpaid(e, p, e.takeDebt(), now); d > 0 {
		return []reconcile.Item{l.debitItem(p, e, d)}
	}
	return nil
}

// flushQueued sends the queue while healthy; while degraded or recovering
// the reconciler settles it.
func (l *Limiter) flushQueued() {
	if l.modes.mode() != ModeHealthy {
		return
	}
	items := l.queue.Take()
	if len(items) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(l.bg.ctx, l.cfg.refillTimeout)
	defer cancel()
	l.requeue(l.send(ctx, items).Failed)
}

// sendNow settles items at once (Close).
func (l *Limiter) sendNow(ctx context.Context, items []reconcile.Item) error {
	if len(items) == 0 {
		return nil
	}
	rep := l.send(ctx, items)
	if len(rep.Failed) > 0 {
		return errs.Errorf("hybrid", "close: %d of %d settlements failed: %w", len(rep.Failed), len(items), remote.ErrUnavailable)
	}
	return nil
}

// send settles items now and accounts for it in Stats.
func (l *Limiter) send(ctx context.Context, items []reconcile.Item) reconcile.Report {
	rep := reconcile.Send(ctx, l.store, items, 0)
	l.account(len(items), rep)
	return rep
}

// requeue keeps what the store could not take. A debit goes back into its
// key's outage debt, so that the next settlement computes the unpaid part
// afresh (the time the store was away pays for some of it); anything else,
// or a debit whose key was forgotten, waits in the queue.
func (l *Limiter) requeue(failed []reconcile.Item) {
	var rest []reconcile.Item
	for _, it := range failed {
		if e := l.keys.load(it.Req.Key); it.Op == remote.OpDebit && e != nil {
			e.refund(it.Req.N)
			continue
		}
		rest = append(rest, it)
	}
	l.queue.Requeue(rest)
}

func (l *Limiter) account(n int, rep reconcile.Report) {
	l.stats.storeCalls.Add(int64(n))
	l.stats.storeErrors.Add(int64(len(rep.Failed)))
	l.stats.tokensReturned.Add(rep.Returned)
	l.stats.tokensDebited.Add(rep.Debited)
}

// checkMode notices breaker state changes (on the slow path and at every
// sweep) and starts a recovery when the store is back and the outage left
// accounts open. Mode changes are logged after every lock is released.
func (l *Limiter) checkMode() {
	t := l.modes.check(l.owed, l.startSettlement)
	switch {
	case !t.changed():
	case t.to == ModeDegraded:
		l.outage.began()
		// Reserved tokens fall due during the outage, which the degraded
		// share already covers: spending them, or giving them back once
		// the store answers (after the outage's debt is charged), would
		// count those tokens twice. They are dropped.
		l.keys.each(func(e *entry) { l.stats.tokensDropped.Add(l.leaser.cancelReservations(e)) })
	case t.from == ModeDegraded:
		if l.outage.ended(l.cfg.now()) {
			l.bg.after(0, l.holdBeat)
		}
	}
	l.logMode(t)
}

// owed reports whether anything is owed to the store: degraded admissions
// not yet charged or tokens not yet given back.
func (l *Limiter) owed() bool {
	return l.keys.any(func(e *entry) bool { return e.debt() != 0 }) || l.queue.Len() > 0
}

// startSettlement charges what the outage admitted and gives back queued
// tokens, through the reconciler: jittered, paced, batched, each step a
// callback of the limiter's clock. What the store could not take stays
// queued for the sweeper or the next recovery.
func (l *Limiter) startSettlement() (cancel func() []reconcile.Item) {
	p := l.policy.load()
	now := l.cfg.now()
	var items []reconcile.Item
	l.keys.each(func(e *entry) { items = append(items, l.debtItems(e, p, now)...) })
	items = append(items, l.queue.Take()...)
	return l.settler.Start(items, func(rep reconcile.Report) {
		l.account(len(items), rep)
		l.requeue(rep.Failed)
		l.logMode(l.modes.settled())
	})
}

func (l *Limiter) logMode(t transition) {
	if !t.changed() {
		return
	}
	l.stats.modeChanges.Add(1)
	l.cfg.logger.LogAttrs(context.Background(), slog.LevelWarn, "leasehold: mode change",
		slog.String("policy", l.policy.load().Name), slog.String("from", t.from.String()), slog.String("to", t.to.String()))
}
