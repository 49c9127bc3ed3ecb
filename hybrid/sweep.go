package hybrid

import (
	"context"

	"github.com/leasehold/leasehold/reconcile"
	"github.com/leasehold/leasehold/remote"
)

// idleSweepsBeforeEvict is how many sweeps in a row a key must see no
// activity before it is forgotten (about two lease TTLs).
const idleSweepsBeforeEvict = 8

// maxQueuedReturns bounds the give-back queue; past it the sweeper is woken
// early.
const maxQueuedReturns = 4096

// sweep gives back expired leases, forgets idle keys, notices breaker
// changes and flushes the give-back queue; it runs every sweep interval on
// the limiter's clock.
func (l *Limiter) sweep() {
	l.checkBreaker()
	now := l.now()
	var rets []reconcile.Item
	l.entries.Range(func(_, v any) bool {
		e := v.(*entry)
		if n := e.lease.DrainExpired(now); n > 0 {
			e.drained.Add(n)
			rets = append(rets, l.returnItem(e.key, n))
		}
		activity := e.admits.Load() + e.misses.Load()
		busy := e.lease.Tokens() > 0 || e.pendingUntil.Load() != 0 || e.refilling.Load() || e.debt.Load() != 0 ||
			e.emptyUntil.Load() > now
		if activity != e.seen || busy {
			e.seen, e.idleSweeps = activity, 0
			return true
		}
		if e.idleSweeps++; e.idleSweeps >= idleSweepsBeforeEvict {
			rets = append(rets, l.evict(e)...)
		}
		return true
	})
	l.requeue(rets)
	l.flushQueued()
}

// flushQueued sends the give-back queue while healthy; while degraded or
// recovering the reconciler settles it.
func (l *Limiter) flushQueued() {
	if l.Mode() != ModeHealthy {
		return
	}
	items := l.takeQueued()
	if len(items) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(l.ctx, l.cfg.refillTimeout)
	defer cancel()
	l.requeue(l.send(ctx, items).Failed)
}

// evict forgets e: its lease is closed so racing takers fail over to a new
// entry, and its tokens are returned to the caller to give back.
func (l *Limiter) evict(e *entry) []reconcile.Item {
	if !l.entries.CompareAndDelete(e.key, e) {
		return nil
	}
	l.nkeys.Add(-1)
	l.stats.evictions.Add(1)
	items := l.closeEntry(e)
	l.stats.evictedAdmits.Add(e.admits.Load())
	return items
}

// makeRoom evicts keys until the tracked count is back under MaxKeys. It
// evicts a batch at a time, in the map's (hash) order, skipping keys with
// a refill or reservation in flight, so a spray of new keys costs an
// amortized constant per insert.
func (l *Limiter) makeRoom() {
	l.evictMu.Lock()
	defer l.evictMu.Unlock()
	limit := int64(l.cfg.maxKeys)
	if l.nkeys.Load() <= limit {
		return
	}
	target := max(limit-limit/64-1, 0)
	var items []reconcile.Item
	l.entries.Range(func(_, v any) bool {
		e := v.(*entry)
		if e.refilling.Load() || e.pendingUntil.Load() != 0 {
			return true
		}
		items = append(items, l.evict(e)...)
		return l.nkeys.Load() > target
	})
	l.queue(items...)
}

// queue keeps items for the sweeper to settle.
func (l *Limiter) queue(items ...reconcile.Item) {
	if len(items) == 0 {
		return
	}
	l.returns.Lock()
	l.returns.items = append(l.returns.items, items...)
	full := len(l.returns.items) >= maxQueuedReturns
	l.returns.Unlock()
	if full {
		l.after(0, l.flushQueued)
	}
}

// requeue keeps items the store could not take. While the store is down
// the queue is bounded: beyond it, returns are forgotten (which only
// under-uses the limit) but debits are kept, since forgetting them would
// over-admit.
func (l *Limiter) requeue(items []reconcile.Item) {
	if len(items) == 0 {
		return
	}
	l.returns.Lock()
	defer l.returns.Unlock()
	for _, it := range items {
		if it.Op == remote.OpReturn && len(l.returns.items) >= 16*maxQueuedReturns {
			continue
		}
		l.returns.items = append(l.returns.items, it)
	}
}

func (l *Limiter) takeQueued() []reconcile.Item {
	l.returns.Lock()
	defer l.returns.Unlock()
	items := l.returns.items
	l.returns.items = nil
	return items
}
