package hybrid

import (
	"context"
	"github.com/leasehold/leasehold/internal/background"

	"github.com/leasehold/leasehold/breaker"
	"github.com/leasehold/leasehold/internal/errs"
	"github.com/leasehold/leasehold/reconcile"
	"github.com/leasehold/leasehold/remote"
)

// settlement owns what the limiter owes the store and has not sent yet:
// returns of unspent tokens and debits of outage admissions. Items wait
// in the queue; flush sends them while healthy, start hands them to the
// reconciler (jittered, paced, batched) when the store is back after an
// outage, and sendNow sends them at Close. It decides nothing.
type settlement struct {
	cfg     *config
	store   *breaker.Store
	bg      *background.Group
	keys    *keyTable // a failed debit goes back into its key's debt
	outage  *outage   // what each key's outage admissions still owe
	policy  *policyTracker
	modes   *modeTracker
	stats   *counters
	queue   reconcile.Queue
	settler reconcile.Settler
}

// later queues items; a full queue is flushed at once.
func (s *settlement) later(items ...reconcile.Item) {
	if s.queue.Add(items...) {
		s.bg.After(0, s.flush)
	}
}

// soon queues items and flushes in the background: tokens that count
// against others until they are back.
func (s *settlement) soon(items ...reconcile.Item) {
	s.queue.Add(items...)
	s.bg.After(0, s.flush)
}

// flush sends the queue while healthy; while degraded or recovering the
// reconciler settles it.
func (s *settlement) flush() {
	if s.modes.mode() != ModeHealthy {
		return
	}
	items := s.queue.Take()
	if len(items) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(s.bg.Ctx, s.cfg.refillTimeout)
	defer cancel()
	s.requeue(s.send(ctx, items).Failed)
}

// sendNow settles everything queued at once (Close). What the breaker
// refuses is tried once on the store itself: the breaker may have opened
// on slowness (a loaded machine, a slow moment of Redis) and this is the
// last chance to give the tokens back. Without a deadline in ctx, that try
// is bounded by the refill timeout.
func (s *settlement) sendNow(ctx context.Context) error {
	items := s.queue.Take()
	if len(items) == 0 {
		return nil
	}
	rep := s.send(ctx, items)
	if len(rep.Failed) > 0 && ctx.Err() == nil {
		tctx, cancel := ctx, context.CancelFunc(func() {})
		if _, ok := ctx.Deadline(); !ok {
			tctx, cancel = context.WithTimeout(ctx, s.cfg.refillTimeout)
		}
		direct := reconcile.Send(tctx, s.store.Unwrap(), rep.Failed, 0)
		cancel()
		s.account(len(rep.Failed), direct)
		rep.Failed = direct.Failed
	}
	if len(rep.Failed) > 0 {
		return errs.Errorf("hybrid", "close: %d of %d settlements failed: %w", len(rep.Failed), len(items), remote.ErrUnavailable)
	}
	return nil
}

// send settles items now and accounts for it in Stats.
func (s *settlement) send(ctx context.Context, items []reconcile.Item) reconcile.Report {
	rep := reconcile.Send(ctx, s.store, items, 0)
	s.account(len(items), rep)
	return rep
}

// requeue keeps what the store could not take. A debit goes back into its
// key's outage debt, so that the next settlement computes the unpaid part
// afresh (the time the store was away pays for some of it); anything else,
// or a debit whose key was forgotten, waits in the queue.
func (s *settlement) requeue(failed []reconcile.Item) {
	var rest []reconcile.Item
	for _, it := range failed {
		if e := s.keys.load(it.Req.Key); it.Op == remote.OpDebit && e != nil {
			s.outage.refund(e, it.Req)
			continue
		}
		rest = append(rest, it)
	}
	s.queue.Requeue(rest)
}

func (s *settlement) account(n int, rep reconcile.Report) {
	s.stats.storeCalls.Add(int64(n))
	s.stats.storeErrors.Add(int64(len(rep.Failed)))
	s.stats.tokensReturned.Add(rep.Returned)
	s.stats.tokensDebited.Add(rep.Debited)
}

// owed reports whether anything is owed to the store: outage admissions
// not yet charged or tokens not yet given back.
func (s *settlement) owed() bool {
	return s.keys.any(func(e *account) bool { return e.debt() != 0 }) || s.queue.Len() > 0
}

// start charges what the outage admitted and gives back queued tokens,
// through the reconciler: each step a callback of the limiter's clock.
// What the store could not take stays queued for the sweeper or the next
// recovery. It does not block; the returned function cancels it.
func (s *settlement) start() (cancel func() []reconcile.Item) {
	p := s.policy.load()
	now := s.cfg.now()
	var items []reconcile.Item
	s.keys.each(func(e *account) { items = append(items, s.outage.charges(e, p, now)...) })
	items = append(items, s.queue.Take()...)
	return s.settler.Start(items, func(rep reconcile.Report) {
		s.account(len(items), rep)
		s.requeue(rep.Failed)
		s.modes.report(s.modes.settled())
	})
}

// debitItem is the settlement that charges n tokens to e's buckets under
// p. A debit may exceed Burst after a long outage; the store takes at most
// MaxBurst per call, which is far above any sane debt.
func debitItem(prefix string, p *policyState, e *account, n int64) reconcile.Item {
	req := p.request(prefix, e)
	req.N = n
	return reconcile.Item{Op: remote.OpDebit, Req: req}
}
