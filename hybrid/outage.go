package hybrid

import (
	"context"
	"math"
	"math/bits"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leasehold/leasehold/breaker"
	"github.com/leasehold/leasehold/local"
	"github.com/leasehold/leasehold/reconcile"
	"github.com/leasehold/leasehold/remote"
)

// outage owns decisions while the store is unavailable: the OutageMode,
// each key's degraded GCRA at this process's share of the limit, the
// fleet size that share is taken from (heartbeats or configured), and what
// the outage still owes the store once it is back.
type outage struct {
	cfg   *config
	stats *counters
	fleet remote.Fleet // through the breaker; nil when the store cannot count
	id    string       // this limiter's member name in the fleet set
	count atomic.Int64 // live fleet size from heartbeats; 0 = unknown
	// countedAt is 1 + when a heartbeat last answered; 0 = never.
	countedAt atomicMono
	// before is the fleet size heartbeats counted when the last outage
	// began; holdUntil (1 + its end, 0 = no hold) ends the recovery hold.
	before    atomic.Int64
	holdUntil atomicMono
	// beganAt is when the last outage began: a share bucket last used
	// before then belongs to an earlier one (or to slow calls before it),
	// has refilled since and would grant a fresh burst on top of the
	// bucket the store drew down meanwhile, so it is rebuilt, empty.
	beganAt atomicMono
}

// began records the fleet size and the time as an outage begins.
func (o *outage) began(now mono) {
	o.beganAt.Store(now)
	if o.fleet != nil {
		o.before.Store(o.count.Load())
	}
}

// ended starts the recovery hold: this process is back, but others of the
// fleet may still be cut off and spending their degraded shares. Until
// heartbeats count the fleet it knew before the outage (or the hold
// expires, for peers that died meanwhile), its decisions stay on its own
// share, so that the fleet as a whole stays within the limit.
// It reports whether the hold is on.
func (o *outage) ended(now mono) bool {
	if o.fleet != nil && o.before.Load() > 1 && o.cfg.recoveryHold > 0 {
		o.holdUntil.Store(now.add(o.cfg.recoveryHold) + 1)
		return true
	}
	return false
}

// held reports whether the recovery hold is on at now.
func (o *outage) held(now mono) bool {
	until := o.holdUntil.Load()
	if until == 0 {
		return false
	}
	if now >= until-1 {
		o.holdUntil.CompareAndSwap(until, 0)
		return false
	}
	return true
}

// degradedKey is the outage's state for one key: the degraded-mode GCRA
// and what its admissions still owe the store. It has its own lock.
type degradedKey struct {
	debt atomic.Int64 // tokens admitted by the outage mode, not yet charged
	mu   sync.Mutex
	// Under mu.
	bucket *local.Bucket
	share  local.Limit // the limit bucket was built for
	used   mono        // when bucket last decided
	// charged is the share deficit the last settlement charged, at
	// chargedAt; see unpaid.
	charged   int64
	chargedAt mono
	// markBorn, markSpill: the key's spill mark when its debt began (the
	// last answer before the outage), for the debit that charges it.
	markBorn, markSpill atomic.Int64
}

// owe adds n admitted tokens to the debt of e, keeping e's last spill
// mark when the debt begins.
func (x *degradedKey) owe(e *account, n int64) {
	if x.debt.Add(n) == n {
		m := e.lastMark()
		x.markSpill.Store(m.Spill)
		x.markBorn.Store(m.Born)
	}
}

// adjust corrects the debt of e by a settled charge's actual cost less
// its estimate: more owed, or less, never below nothing.
func (x *degradedKey) adjust(e *account, delta int64) {
	if delta > 0 {
		x.owe(e, delta)
		return
	}
	for {
		cur := x.debt.Load()
		if cur <= 0 || x.debt.CompareAndSwap(cur, max(cur+delta, 0)) {
			return
		}
	}
}

func newOutage(cfg *config, stats *counters, store *breaker.Store, id string) *outage {
	o := &outage{cfg: cfg, stats: stats, id: id}
	if _, ok := store.Unwrap().(remote.Fleet); ok && cfg.fleetSize == 0 {
		o.fleet = store
	}
	return o
}

// decide admits or refuses n on e by the outage mode, at now.
func (o *outage) decide(e *account, p *policyState, n int64, now mono) Decision {
	t := p.tier(e)
	switch o.cfg.outage {
	case OutageFailOpen:
		o.stats.admitted[SourceFailOpen].Add(1)
		e.extra().down.owe(e, n)
		return Decision{Allowed: true, Limit: t.limits[0], Source: SourceFailOpen}
	case OutageFailClosed:
		o.stats.rejected[SourceFailClosed].Add(1)
		return Decision{Limit: t.limits[0], RetryAfter: o.cfg.storeTimeout, Source: SourceFailClosed}
	}
	b := o.degradedBucket(e, t, now)
	if b == nil {
		o.stats.rejected[SourceDegraded].Add(1)
		return Decision{Limit: t.limits[0], RetryAfter: o.cfg.storeTimeout, Source: SourceDegraded}
	}
	r, err := b.TakeAt(int64(now), n)
	if err != nil || !r.Allowed {
		o.stats.rejected[SourceDegraded].Add(1)
		wait := r.RetryAfter
		if err != nil { // n above this process's share of Burst
			wait = t.equiv.DurationFor(n)
		}
		return Decision{Limit: b.Limit(), Remaining: r.Remaining, RetryAfter: wait, ResetAfter: r.ResetAfter, Source: SourceDegraded}
	}
	o.stats.admitted[SourceDegraded].Add(1)
	e.extra().down.owe(e, n)
	return Decision{Allowed: true, Limit: b.Limit(), Remaining: r.Remaining, ResetAfter: r.ResetAfter, Source: SourceDegraded}
}

// degradedBucket returns e's local GCRA at this process's share of the
// limit (of the one bucket that keeps all the tier's limits, for shaped
// policies), rebuilt when the policy or the fleet size changes and when
// it was last used before the last outage began (it has refilled since and
// would grant a fresh burst on top of the bucket); nil when
// no share can be expressed (the outage then refuses: a share never falls
// back to more than Rate/N).
func (o *outage) degradedBucket(e *account, t *tierState, now mono) *local.Bucket {
	share, ok := shareOf(t.equiv, int64(o.size()))
	if !ok {
		return nil
	}
	x := &e.extra().down
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.bucket == nil || x.share != share || x.used < o.beganAt.Load() {
		b, err := local.NewBucket(share)
		if err != nil {
			return nil // shareOf validated it; kept for safety, refusing
		}
		// What a settlement charged was the old bucket's deficit; the new
		// one starts from its own.
		x.charged, x.chargedAt = 0, now
		if e.answer.seen() || x.bucket != nil {
			// The key was in use when the store went away: the share
			// starts with this process's part of what the bucket held at
			// its last answer, not a fresh burst on top of a bucket that
			// was drawn down. At the limit that is nothing: the share
			// refills at its rate. What it starts without was never
			// admitted: count it as charged, so a settlement charges
			// admissions only.
			//
			// On a key at its limit the bucket had also future-dated the
			// next stretch of its rate to peers, who spend it at the full
			// rate until their own breaker opens: the share starts after
			// one such grant (see contendedShare), which it would
			// otherwise spend a second time.
			if atLimit(e, t) {
				b.Empty(int64(now.add(o.peerGrantSpan())))
				x.charged = share.Burst
			} else {
				start := min(e.answer.level.Load()/int64(max(o.size(), 1)), share.Burst)
				b.SetTokens(int64(now), start)
				x.charged = share.Burst - start
			}
		}
		x.bucket, x.share = b, share
	}
	x.used = now
	return x.bucket
}

// peerGrantSpan is how long a peer's future-dated grant on a key at its
// limit runs at the bucket's rate: a grant is Rate/N over half the maximum
// reservation, so it spans maxDelay/(2N); 0 when reservations are off.
func (o *outage) peerGrantSpan() time.Duration {
	return max(o.cfg.maxDelay, 0) / time.Duration(2*max(o.size(), 1))
}

// shareOf is one process's part of lim among n: Burst/N (at least 1) and
// Rate/N per Period. The rate is kept exact (Rate per N·Period) when that
// has an exact form; otherwise it is rounded toward admitting less:
// floor(Rate/N) per Period, or one token per Period·N/Rate rounded up to
// the microsecond. ok is false when no share can be expressed.
func shareOf(lim local.Limit, n int64) (local.Limit, bool) {
	if n <= 1 {
		return lim, true
	}
	burst := max(1, lim.Burst/n)
	var candidates []local.Limit
	if p := lim.Period * time.Duration(n); p/time.Duration(n) == lim.Period {
		candidates = append(candidates, local.Limit{Rate: lim.Rate, Period: p, Burst: burst})
	}
	if r := lim.Rate / n; r >= 1 {
		candidates = append(candidates, local.Limit{Rate: r, Period: lim.Period, Burst: burst})
	}
	// One token per ceil(Period·N/Rate), in whole microseconds.
	if per, ok := ceilMulDiv(int64(lim.Period/time.Microsecond), n, lim.Rate); ok {
		candidates = append(candidates, local.Limit{Rate: 1, Period: time.Duration(per) * time.Microsecond, Burst: burst})
	}
	for _, c := range candidates {
		if c.Validate() == nil {
			return c, true
		}
	}
	return local.Limit{}, false
}

// ceilMulDiv returns ceil(a·b/c) for positive a, b, c, and false when it
// does not fit a Duration in microseconds.
func ceilMulDiv(a, b, c int64) (int64, bool) {
	hi, lo := bits.Mul64(uint64(a), uint64(b))
	if hi >= uint64(c) {
		return 0, false
	}
	q, r := bits.Div64(hi, lo, uint64(c))
	if r != 0 {
		q++
	}
	if q == 0 || q > uint64(math.MaxInt64/int64(time.Microsecond)) {
		return 0, false
	}
	return int64(q), true
}

// size is N for degraded-mode shares: the configured size, else the last
// size heartbeats reported (during a recovery hold, at least the size
// before the outage), else 1.
func (o *outage) size() int {
	if o.cfg.fleetSize > 0 {
		return o.cfg.fleetSize
	}
	n := o.count.Load()
	if o.holdUntil.Load() != 0 {
		// Recovering while peers may still be cut off: they are not
		// heartbeating, but they are spending their shares.
		n = max(n, o.before.Load())
	}
	return max(int(n), 1)
}

// heartbeat announces this limiter in the policy's fleet set and keeps
// the live count; it reports whether the store answered. Failures keep the
// last count: during an outage the fleet is as big as it was before.
func (o *outage) heartbeat(ctx context.Context, policy string) bool {
	if o.fleet == nil {
		return false
	}
	ctx, cancel := context.WithTimeout(ctx, o.cfg.refillTimeout)
	defer cancel()
	n, err := o.fleet.Heartbeat(ctx, o.cfg.prefix, policy, o.id, o.cfg.hbExpiry)
	if err != nil {
		return false
	}
	o.count.Store(int64(n))
	o.countedAt.Store(o.cfg.now() + 1)
	if int64(n) >= o.before.Load() {
		o.holdUntil.Store(0) // everyone counted before the outage is back
	}
	return true
}

// recount heartbeats unless one answered within d of now. Processes
// started together each counted only those that had announced
// themselves before it.
func (o *outage) recount(ctx context.Context, policy string, now mono, d time.Duration) {
	if at := o.countedAt.Load(); o.fleet != nil && (at == 0 || now.sub(at-1) > d) {
		o.heartbeat(ctx, policy)
	}
}

// leave removes this limiter from the fleet set at once (Close), rather
// than after the heartbeat expiry.
func (o *outage) leave(ctx context.Context, policy string) {
	if o.fleet != nil {
		_ = o.fleet.Leave(ctx, o.cfg.prefix, policy, o.id)
	}
}

// unpaid is the part of admitted (tokens a key admitted while the store
// was away) that the time since has not paid for. The global bucket kept
// refilling during the outage, up to Burst; charging every admitted token
// would count that refill twice and starve the key after recovery. In
// degraded mode the local share bucket knows exactly how much of its
// recent use is still outstanding; fail-open has no such bucket and is
// charged at most one Burst, leaving the key empty.
func (o *outage) unpaid(e *account, p *policyState, admitted int64, now mono) int64 {
	if admitted <= 0 {
		return 0
	}
	if p.hold > 0 {
		// A sliding window forgets nothing within its period: every
		// admission of the outage counts (those older than a period
		// only cost a little room), up to one window's worth.
		return min(admitted, p.tier(e).est.Burst)
	}
	x := &e.extra().down
	x.mu.Lock()
	defer x.mu.Unlock()
	b := x.bucket
	if b == nil {
		return min(admitted, p.tier(e).est.Burst)
	}
	// The share's deficit still includes what an earlier settlement
	// charged, until the share's refill has covered it: charge only the
	// rest, or a second settlement soon after the first counts it twice.
	lim := b.Limit()
	covered := lim.TokensIn(now.sub(x.chargedAt))
	outstanding := max(x.charged-covered, 0)
	used := lim.Burst - b.Tokens(int64(now))
	d := max(min(admitted, used-outstanding), 0)
	x.charged, x.chargedAt = outstanding+d, now
	return d
}

// charges takes e's outage debt and returns its debit under p. The debit
// charges the unpaid part (see unpaid), unless it names the bucket's
// spill mark from before the debt began: then the bucket charges every
// admitted token less the refill it lost at its cap since (the outage
// left it unused), which pays back what a partition that only this
// process saw admitted on top of the others' draw. Sliding windows and
// several limits keep no marks.
func (o *outage) charges(e *account, p *policyState, now mono) []reconcile.Item {
	x := &e.extra().down
	born, spill := x.markBorn.Load(), x.markSpill.Load()
	admitted := e.takeDebt()
	d := o.unpaid(e, p, admitted, now)
	if p.shaped || p.hold > 0 || admitted <= 0 {
		born = 0
	}
	if d <= 0 && born == 0 {
		return nil
	}
	it := debitItem(o.cfg.prefix, p, e, d)
	if born != 0 {
		it.Req.Spent, it.Req.Mark = admitted, remote.SpillMark{Born: born, Spill: spill}
	}
	return []reconcile.Item{it}
}

// refund puts a debit the store did not take back into e's outage debt
// (every token it spent, with the mark it had), and its unpaid part out
// of what the share counts as charged.
func (o *outage) refund(e *account, r remote.Request) {
	x := &e.extra().down
	x.mu.Lock()
	x.charged = max(x.charged-r.N, 0)
	x.mu.Unlock()
	n := max(r.N, r.Spent)
	if x.debt.Add(n) == n && r.Mark.Born != 0 {
		x.markSpill.Store(r.Mark.Spill)
		x.markBorn.Store(r.Mark.Born)
	}
}
