package hybrid

import (
	"context"
	"sync/atomic"

	"github.com/leasehold/leasehold/internal/errs"
	"github.com/leasehold/leasehold/reconcile"
	"github.com/leasehold/leasehold/remote"
)

// Costs known only afterwards (an LLM call's tokens, a GraphQL query's
// cost): ChargeN decides an estimate when the work starts, Settle charges
// the actual cost when it ends. The part of the estimate not used goes
// back; the part above it is charged, as debt if the bucket is short: its
// level goes below zero and refills pay the debt before it admits again.
// So at every instant the fleet's settled costs plus the
// estimates of the work still running are at most Burst + Rate·t plus the
// debt still out, and the debt is at most the extra of work that was
// running when the bucket last had tokens to admit with.
//
// Where each part goes, by the source of the decision:
//   - lease, remote or grant: a refund goes into the key's lease (no store
//     call; unspent, it goes back to the bucket with the lease), or back to
//     the bucket when the key is not tracked, less what the bucket's
//     refill since the charge would have lost at its cap (see
//     Limiter.refund); an extra is taken from the
//     lease, then from the key's grant, and the rest is debited to the
//     bucket (queued and sent at once, in the background).
//   - degraded or fail-open: the outage debt the recovery charges grows by
//     the extra, or falls by the refund.
//   - sliding windows and several limits: extras are debited to every
//     limit; a refund is not given back (the tokens count in the window
//     they were taken in until it passes, at most one period).

// ErrSettled reports a Charge settled a second time.
var ErrSettled = errs.New("hybrid", "charge already settled")

// Charge is an estimated cost taken on a key before the work it pays for,
// to be settled with the actual cost once the work ends. Its Decision says
// whether the estimate was admitted. A Charge is safe for concurrent use;
// it is settled once.
type Charge struct {
	// Decision is the decision on the estimate.
	Decision
	l        *Limiter
	key      string
	tier     uint16
	estimate int64
	at       mono // when the estimate was decided
	// gen is the key's lease end when the estimate was decided: under
	// stock records, the same end at the refund means the same record.
	gen     int64
	settled atomic.Bool
}

// ChargeN decides estimate units of cost on key as AllowN does, and
// returns the charge to settle with the actual cost when the work is done
// (see Charge.Settle). A refused estimate needs no settling. Errors are
// AllowN's.
func (l *Limiter) ChargeN(ctx context.Context, key string, estimate int64) (*Charge, error) {
	d, err := l.AllowN(ctx, key, estimate)
	if err != nil {
		return nil, err
	}
	p := l.policy.load()
	c := &Charge{Decision: d, l: l, key: key, tier: l.tierIndex(p, key), estimate: estimate, at: l.cfg.now()}
	if e := l.keys.entries.load(key); e != nil {
		c.gen = e.lease.Expiry()
	}
	return c, nil
}

// Settle charges the work's actual cost in place of the estimate: what the
// estimate did not use goes back, what it lacked is charged, as debt if
// the bucket is short (later refills pay it, so others are refused until
// they have). It never blocks on the store. It returns ErrInvalidN for a
// negative actual, ErrSettled the second time, and ErrClosed once the
// limiter is closed (nothing is charged then); settling a refused estimate
// does nothing.
func (c *Charge) Settle(actual int64) error {
	if actual < 0 {
		return errs.Errorf("hybrid", "settle %d on %.64q: %w", actual, c.key, ErrInvalidN)
	}
	if !c.settled.CompareAndSwap(false, true) {
		return errs.Errorf("hybrid", "settle %.64q: %w", c.key, ErrSettled)
	}
	if !c.Allowed || actual == c.estimate {
		return nil
	}
	l := c.l
	if l.keys.closed.Load() {
		return ErrClosed
	}
	p := l.policy.load()
	e := l.keys.entries.load(c.key)
	if e != nil && e.tier != c.tier {
		e = nil
	}
	if c.Source == SourceDegraded || c.Source == SourceFailOpen {
		if e != nil {
			e.extra().down.adjust(e, actual-c.estimate)
		}
		return nil
	}
	if actual < c.estimate {
		l.refund(p, e, c, c.estimate-actual)
	} else {
		l.chargeExtra(p, e, c.key, c.tier, actual-c.estimate)
	}
	return nil
}

// chargeKey is the context key of a request's Charge.
type chargeKey struct{}

// ContextWithCharge returns a copy of ctx that carries ch, for the handler
// of the work it pays for: middleware that charges an estimate (httplimit,
// grpclimit) puts it there, and the handler settles it with the actual cost
// once known (ChargeFromContext).
func ContextWithCharge(ctx context.Context, ch *Charge) context.Context {
	return context.WithValue(ctx, chargeKey{}, ch)
}

// ChargeFromContext returns the Charge ctx carries, or nil.
func ChargeFromContext(ctx context.Context) *Charge {
	ch, _ := ctx.Value(chargeKey{}).(*Charge)
	return ch
}

// Settled reports whether Settle has been called.
func (c *Charge) Settled() bool { return c.settled.Load() }

// refund gives back n tokens of settled charge c: into e's lease when
// the key is tracked (spent or given back with it), else to the bucket.
// Sliding windows and several limits get nothing back.
func (l *Limiter) refund(p *policyState, e *account, c *Charge, n int64) {
	if p.shaped {
		return
	}
	if l.leaser.stock(p) {
		// A charge's tokens the lease gave are still counted by the
		// record they came from while the lease's end is the one the
		// charge saw: they go back into the lease under it.
		if e != nil && c.Source == SourceLease && e.refundUnder(n, mono(c.gen), l.cfg.now()) {
			l.stats.tokensLeased.Add(n)
			return
		}
		// Tokens a store call handed out at once, or a grant, no record
		// counts, and the bucket has refilled since: had the charge
		// taken only the actual, the bucket would hold n more, less
		// what the refill since then would have lost at the cap, at most
		// the refill itself. Given back whole, 7 of a charge of 8 let a
		// window admit 6 over Burst + Rate·w 1.1 s later
		// (TestChargeRefundKeepsEveryWindow/default).
		lapsed := min(n, p.tierAt(c.tier).limits[0].TokensIn(l.cfg.now().sub(c.at)))
		l.stats.tokensExpired.Add(lapsed)
		if n -= lapsed; n <= 0 {
			return
		}
	} else if e != nil && e.refund(n, int64(l.cfg.now().add(l.cfg.leaseTTL))) {
		l.stats.tokensLeased.Add(n)
		return
	}
	req := p.requestFor(l.cfg.prefix, c.key, c.tier)
	req.N = n
	l.settle.soon(reconcile.Item{Op: remote.OpReturn, Req: req})
}

// chargeExtra charges n tokens a settled charge lacked: from e's lease,
// then its grant (as debt the grant pays), the rest as a debit to the
// bucket.
func (l *Limiter) chargeExtra(p *policyState, e *account, key string, tier uint16, n int64) {
	if e != nil {
		n -= l.takeUpTo(e, n, l.spendAt())
		if h := e.held(); h != nil && n > 0 {
			n -= h.owe(l.cfg.now(), n)
		}
	}
	if n <= 0 {
		return
	}
	req := p.requestFor(l.cfg.prefix, key, tier)
	req.N = n
	l.settle.soon(reconcile.Item{Op: remote.OpDebit, Req: req})
}

// takeUpTo takes at most n tokens from e's lease at now and returns how
// many.
func (l *Limiter) takeUpTo(e *account, n int64, now mono) int64 {
	for {
		k := min(n, e.live(now))
		if k <= 0 {
			return 0
		}
		if ok, _ := e.take(k, now); ok {
			return k
		}
	}
}

// owe takes up to n tokens from the grant at now, into debt its rate
// pays before the grant admits again, as long as the debt is paid by the
// grant's end: the holder's admissions and extras then stay within its
// share of the rate. A debit to the bucket instead is paid only from the
// rate the grants leave, none when they hold it all: settled costs ran to
// 148% of Burst + Rate·t on a key held by flow.
func (h *holding) owe(now mono, n int64) int64 {
	if now >= h.until {
		return 0
	}
	return h.bucket.Owe(int64(now), int64(h.until), n)
}
