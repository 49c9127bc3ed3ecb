package hybrid

import (
	"context"
	"errors"
	"github.com/leasehold/leasehold/internal/errs"
	"github.com/leasehold/leasehold/internal/keys"
	"log/slog"
	"math/rand/v2"
	"time"

	"github.com/leasehold/leasehold/internal/hooks"
	"github.com/leasehold/leasehold/remote"
	"github.com/sony/gobreaker/v2"
)

// maxStoreRounds bounds the store calls one decision makes. Tokens a call
// brought in may be taken by concurrent callers before this one gets to
// them; after this many rounds the caller is refused with the time its n
// tokens take to refill, rather than queueing behind the store.
const maxStoreRounds = 3

// Allow reports whether one request on key may proceed now. It is
// shorthand for AllowN(ctx, key, 1).Allowed, without building a Decision:
// on a key with leased tokens it allocates nothing.
// Invalid keys are rejected (AllowN says why).
func (l *Limiter) Allow(ctx context.Context, key string) bool {
	// leased, inlined by hand: the call costs BenchmarkAllow about 10%.
	if e := l.keys.entries.load(key); e != nil && (l.cfg.tierOf == nil || l.inTier(e, key)) {
		at := l.spendAt()
		if ok, low, _ := e.spend(1, at); ok {
			if low {
				l.leaser.refillAsync(e, at)
			}
			return true
		}
		if h := e.held(); h != nil {
			now := l.cfg.now()
			if res, ok := h.take(now, 1); ok && (res.Allowed || !l.stockAfterGrant(e, 1, now)) {
				l.grantDecided(e, 1, res.Allowed, now)
				return res.Allowed
			}
		}
	}
	d, _ := l.allowSlow(ctx, key, 1)
	return d.Allowed
}

// AllowN reports whether n requests (or n units of cost) on key may
// proceed now, and why. A rejection is a Decision with Allowed false, not an
// error: errors are reserved for misuse (ErrInvalidKey, ErrInvalidN,
// ErrExceedsBurst), ErrClosed, ctx ending during a store call, and a
// bucket whose Redis key holds data leasehold did not write
// (remote.ErrCorruptState).
func (l *Limiter) AllowN(ctx context.Context, key string, n int64) (Decision, error) {
	if n > 0 {
		e, ok, left := l.leased(key, n, l.spendAt())
		if ok {
			t, now := l.policy.load().tier(e), l.cfg.now()
			return Decision{Allowed: true, Limit: t.limits[0], Remaining: e.answer.remaining(t.est, left, now),
				ResetAfter: e.answer.resetAfter(now), Source: SourceLease}, nil
		}
		if e != nil {
			if d, ok := l.fromGrant(e, l.policy.load(), n, l.cfg.now(), false); ok {
				return d, nil
			}
		}
	}
	return l.allowSlow(ctx, key, n)
}

// fromGrant decides n on e's capacity grant, if it holds a live one that
// can: no store call, whatever the store's state. Under stock records a
// refusal leaves the decision to the key's stock while the store is
// healthy, unless final (the store call for it failed).
func (l *Limiter) fromGrant(e *account, p *policyState, n int64, now mono, final bool) (Decision, bool) {
	h := e.held()
	if h == nil {
		return Decision{}, false
	}
	res, ok := h.take(now, n)
	if !ok || !res.Allowed && !final && l.stockAfterGrant(e, n, now) {
		return Decision{}, false
	}
	l.grantDecided(e, n, res.Allowed, now)
	t := p.tier(e)
	return Decision{Allowed: res.Allowed, Limit: t.limits[0], Remaining: e.answer.remaining(t.est, res.Remaining, now),
		RetryAfter: res.RetryAfter, ResetAfter: e.answer.resetAfter(now), Source: SourceGrant}, true
}

// stockAfterGrant reports whether a decision of n on e that e's grant
// refuses at now goes on to the key's stock: under stock records, unless
// the store's last answer refused as many already (checked first, as a
// flood on a key at its limit asks it for every decision), and while the
// store is healthy. Otherwise the refusal stands: a holder cut off from
// the store spends its grant and nothing else until the term ends.
func (l *Limiter) stockAfterGrant(e *account, n int64, now mono) bool {
	return l.cfg.stock && now >= e.refusedUntil(n, now) && l.store.State() == gobreaker.StateClosed && !l.outage.held(now)
}

// grantDecided counts a decision a grant made: an admission is activity of
// the key (its entry's count), a refusal demand that the next renewal
// asks for.
func (l *Limiter) grantDecided(e *account, n int64, allowed bool, now mono) {
	if allowed {
		e.admitted()
		return
	}
	// A flood refuses on every core, and a count the entry kept on each
	// refusal moved its line, which every decision reads, between the
	// cores (BenchmarkFlood: 194–200 ns a decision, x/time/rate 146–155;
	// 49–53 since). On the real clock one refusal in
	// missSample counts for missSample: the demand is an estimate
	// anyway. On another clock every one counts, so that a run is
	// deterministic.
	if !l.cfg.realtime {
		e.missed(n)
	} else if rand.Uint32()%missSample == 0 {
		e.missed(missSample * n)
	}
	l.stats.rejected[SourceGrant].Add(1)
	l.grants.overdue(e, now)
}

// missSample is one in how many of a grant's refusals count in the key's
// demand on the real clock.
const missSample = 16

// leased takes n tokens at at (Limiter.spendAt) from the lease of key's account, if the key
// is tracked under the tier it is in now; e is that entry, nil when the
// key is not tracked under its tier (its grant is not its to spend
// either). Every decision spends leased tokens through leaser.spend, here
// (Allow, AllowN, ReserveN) or on the entry it holds (allowSlow). It
// allocates nothing.
func (l *Limiter) leased(key string, n int64, at mono) (e *account, ok bool, left int64) {
	if e = l.keys.entries.load(key); e != nil && (l.cfg.tierOf == nil || l.inTier(e, key)) {
		ok, left = l.leaser.spend(e, n, at)
		return e, ok, left
	}
	return nil, false, 0
}

// inTier reports whether e is under the tier WithTier names for key now.
func (l *Limiter) inTier(e *account, key string) bool {
	return e.tier == l.tierIndex(l.policy.load(), key)
}

// tierIndex returns the index of key's tier under p.
func (l *Limiter) tierIndex(p *policyState, key string) uint16 {
	if l.cfg.tierOf == nil {
		return 0
	}
	return p.tierOf(l.cfg.tierOf(key))
}

// spendAt is the time a leased decision spends at (config.spendAtNow) under
// the policy in force: the leases of sliding windows and several limits
// end at their hold's drain, so their decisions read no clock.
func (l *Limiter) spendAt() mono {
	switch {
	case !l.cfg.stock || l.policy.load().shaped:
		return noExpiry
	case l.cfg.stock:
		if c := l.coarse.Load(); c != 0 {
			return mono(c)
		}
	}
	return l.cfg.now()
}

// coarseTick is how often Limiter.coarse moves, to now plus coarseTick:
// a lease stops at most that much before its term. A tick late by more
// (a starved process) could let a lease spend past its term by the
// delay: the store counts a record stockGrace past the term the process
// spends by.
const coarseTick = 10 * time.Millisecond

// Wait blocks until one request on key is admitted or ctx ends. It is
// shorthand for WaitN(ctx, key, 1).
func (l *Limiter) Wait(ctx context.Context, key string) error { return l.WaitN(ctx, key, 1) }

// WaitN blocks until n requests on key are admitted or ctx ends, sleeping
// (on the limiter's clock) exactly as long as each rejection's RetryAfter
// says. It returns ctx.Err() unchanged if ctx ends first.
func (l *Limiter) WaitN(ctx context.Context, key string, n int64) error {
	for {
		d, err := l.AllowN(ctx, key, n)
		if err != nil {
			return err
		}
		if d.Allowed {
			return nil
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		t := l.cfg.clk.NewTimer(max(d.RetryAfter, time.Microsecond))
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-l.bg.Done:
			t.Stop()
			return ErrClosed
		case <-t.C():
		}
	}
}

// allowSlow decides when the lease cannot: it validates, finds or creates
// the key's account, then each round tries the lease, the outage mode, a
// cached answer, and the store (one flight per key), in that order. It
// reads the clock once per round.
func (l *Limiter) allowSlow(ctx context.Context, key string, n int64) (Decision, error) {
	p := l.policy.load()
	tier := l.tierIndex(p, key)
	if err := l.checkRequest(p, &p.tiers[tier], key, n, l.keys.entries.load(key) != nil); err != nil {
		return Decision{Limit: p.tiers[tier].limits[0]}, err
	}
	e, evicted := l.keys.getOrCreate(key, tier)
	if len(evicted) > 0 {
		l.releaseAll(evicted)
	}
	if e == nil {
		return Decision{Limit: p.tiers[tier].limits[0]}, ErrClosed
	}
	for round := 0; ; round++ {
		p = l.policy.load() // a store reply may have brought a newer policy
		now := l.cfg.now()
		// After round 0 counted n as asked for, the lease and the grant
		// count it again as they decide: once is the demand
		// (TestSlowPathCountsDemandOnce).
		if ok, left := l.leaser.spend(e, n, l.cfg.spendAtNow(now)); ok {
			if round > 0 {
				e.missed(-n)
			}
			return l.admit(e, p, left, round > 0), nil
		}
		if d, ok := l.fromGrant(e, p, n, now, false); ok {
			if round > 0 {
				e.missed(-n)
			}
			return d, nil
		}
		if d, ok, err := l.decideWithoutStore(e, p, n, now, round); ok {
			return d, err
		}
		if round == 0 {
			e.missed(n)
		}
		e.wait(n)
		out, err := l.leaser.fetch(ctx, e, n)
		e.wait(-n)
		if err != nil {
			return l.storeFailed(ctx, e, p, n, now, err)
		}
		if out.handed {
			// The call's tokens for this caller, admitted by the store
			// as it granted them (no record counts them, see
			// leaser.granted).
			e.admitted()
			return l.admit(e, l.policy.load(), e.live(l.cfg.spendAtNow(out.at)), true), nil
		}
		if !out.deposited {
			return l.reject(e, p, SourceRemote, max(out.retry, time.Microsecond), out.at), nil
		}
	}
}

// admit is the Decision for tokens just taken from e's lease; afterCall
// marks tokens that a store call of this decision brought in.
func (l *Limiter) admit(e *account, p *policyState, left int64, afterCall bool) Decision {
	src := SourceLease
	if afterCall {
		src = SourceRemote
		l.stats.admitted[SourceRemote].Add(1)
	}
	now, t := l.cfg.now(), p.tier(e)
	return Decision{Allowed: true, Limit: t.limits[0], Remaining: e.answer.remaining(t.est, left, now), ResetAfter: e.answer.resetAfter(now), Source: src}
}

// decideWithoutStore decides n on e when the store must not or need not be
// asked: the breaker is not closed, a cached answer says when tokens
// arrive or that the bucket is corrupt, or this decision has had its store
// rounds.
func (l *Limiter) decideWithoutStore(e *account, p *policyState, n int64, now mono, round int) (Decision, bool, error) {
	// Reserved tokens now due are the store's grant, whatever its state
	// since: they are released as a decision finds them (see reservation).
	if ok, left := l.leaser.spendDue(e, n, now); ok {
		return l.admit(e, p, left, false), true, nil
	}
	l.checkMode()
	switch l.store.State() {
	case gobreaker.StateOpen:
		return l.withoutCall(e, n, l.outage.decide(e, p, n, now)), true, nil
	case gobreaker.StateHalfOpen:
		// Probe in the background; nobody waits on a store that was
		// down a moment ago.
		l.leaser.refillAsync(e, now)
		return l.withoutCall(e, n, l.outage.decide(e, p, n, now)), true, nil
	}
	until := e.readyFor(n, now)
	// A cached refusal for as many tokens or fewer holds for n too; a
	// smaller request may fit and asks the store.
	until = max(until, e.refusedUntil(n, now))
	if now < until {
		return l.withoutCall(e, n, l.reject(e, p, SourceLease, time.Duration(until-now), now)), true, nil
	}
	if l.outage.held(now) {
		l.grants.resume(e, p, now)
		return l.withoutCall(e, n, l.outage.decide(e, p, n, now)), true, nil
	}
	if since := e.callSince.Load(); since != 0 && now.sub(since-1) > l.cfg.storeTimeout {
		// The key's store call has been out longer than a decision may
		// wait: joining it would only wait out the store timeout again.
		return l.withoutCall(e, n, l.slow(e, p, n, now)), true, nil
	}
	if wait, err := e.corruption(now); err != nil {
		l.stats.rejected[SourceRemote].Add(1)
		return Decision{Limit: p.tier(e).limits[0], RetryAfter: wait, Source: SourceRemote}, true, err
	}
	if round >= maxStoreRounds {
		return l.reject(e, p, SourceRemote, p.tier(e).est.DurationFor(n), now), true, nil
	}
	return Decision{}, false, nil
}

// withoutCall is d, a decision on e made for n without a store call: by
// a cached refusal, an outage, the recovery hold or a slow store. It is
// demand all the same: it sizes the next lease, and it keeps the key (and
// a cached answer) from being forgotten as idle. Only the cached refusal
// used to count: a key its share kept deciding in an outage or the hold
// (whose sweeps settle the debt an admission owes) was forgotten, and
// came back as one this process had never seen, whose share starts with
// a burst (TestOutageRefusalsKeepTheKey, TestRecoveryHoldKeepsTheKey).
func (l *Limiter) withoutCall(e *account, n int64, d Decision) Decision {
	e.missed(n)
	return d
}

// storeFailed decides n on e after the store call of the round that began
// at now failed with err.
func (l *Limiter) storeFailed(ctx context.Context, e *account, p *policyState, n int64, now mono, err error) (Decision, error) {
	lim := p.tier(e).limits[0]
	switch {
	case errors.Is(err, ErrClosed):
		return Decision{Limit: lim}, ErrClosed
	case ctx.Err() != nil:
		return Decision{Limit: lim}, ctx.Err()
	case errors.Is(err, errSlowFlight):
		// No answer within the store timeout: slowness is not a reason to
		// refuse. Decide as in an outage (this process's degraded share,
		// charged to the bucket as debt once the store answers). If the
		// store has answered nothing for a whole refill timeout, it is
		// more likely dead than slow: tell the breaker, which opens after
		// a few such reports instead of waiting for in-flight calls to
		// time out.
		waited := now.add(l.cfg.storeTimeout)
		if waited.sub(l.leaser.lastOK.Load()) > l.cfg.refillTimeout {
			hooks.ReportTimeout(l.store)
		}
		if d, ok := l.fromGrant(e, p, n, waited, true); ok {
			return d, nil // a holder spends its grant and nothing else
		}
		return l.slow(e, p, n, waited), nil
	case remote.IsUnavailable(err):
		if d, ok := l.fromGrant(e, p, n, now, true); ok {
			return d, nil
		}
		return l.outage.decide(e, p, n, now), nil
	}
	// Corrupt bucket state: the store answered, but nothing it says can be
	// trusted for this key. Refuse, and say why.
	l.stats.rejected[SourceRemote].Add(1)
	return Decision{Limit: lim, RetryAfter: l.cfg.leaseTTL, Source: SourceRemote}, err
}

// slow decides n on e when the store has not answered within the store
// timeout. Slowness is no reason to refuse: the degraded share decides,
// charged to the bucket as debt once the store answers. Except on a key at
// its limit while the store still answers this process (within the
// refill timeout): then the store is alive and slow only for some calls,
// peers whose calls do answer take all the bucket refills, and the share
// would admit on top of them, over the bound (8 limiters on a CPU-starved
// machine: +2.4%, TestExactBoundUnderLoad). Such a key refuses for the
// time n tokens take at the limit's rate, as a store at its limit would;
// so does a key the store has never answered for, whose share would start
// with a burst. A store silent for longer is more likely dead (the breaker
// is told, see storeFailed), and the share decides.
func (l *Limiter) slow(e *account, p *policyState, n int64, now mono) Decision {
	t := p.tier(e)
	// Under stock records a key that holds or asks for flow is at its
	// limit whatever level the bucket showed last: the level is what the
	// grants and records leave (a slow process's share on top of its
	// peer's flow: 101.6% of the bound under make test's load).
	contended := atLimit(e, t) || l.cfg.stock && e.grantMode()
	if alive := now.sub(l.leaser.lastOK.Load()) <= l.cfg.refillTimeout; alive && contended {
		return l.reject(e, p, SourceRemote, t.est.DurationFor(n), now)
	}
	return l.outage.decide(e, p, n, now)
}

// reject is the refusal of a decision on e: Limit is the limit the store
// last said refused (the tightest of several), Remaining the estimate.
func (l *Limiter) reject(e *account, p *policyState, src Source, wait time.Duration, now mono) Decision {
	l.stats.rejected[src].Add(1)
	t := p.tier(e)
	lim := t.limits[0]
	if r := e.rare.Load(); r != nil {
		if b := int(r.binding.Load()); b < len(t.limits) {
			lim = t.limits[b]
		}
	}
	return Decision{Limit: lim, Remaining: e.answer.remaining(t.est, e.live(l.cfg.spendAtNow(now)), now), RetryAfter: wait,
		ResetAfter: e.answer.resetAfter(now), Source: src}
}

// checkRequest validates a decision of n on key under p's tier t; a key
// tracked already was validated when its entry was made.
func (l *Limiter) checkRequest(p *policyState, t *tierState, key string, n int64, tracked bool) error {
	if !tracked {
		if err := keys.Validate(l.cfg.prefix, p.Name, key); err != nil {
			err = errs.Errorf("hybrid", "%w", err)
			if l.keys.invalidLogged.CompareAndSwap(false, true) {
				// Allow answers false without an error to look at: say so
				// once, or a missing customer id is a silent 429.
				l.cfg.logger.LogAttrs(context.Background(), slog.LevelWarn, "leasehold: invalid key refused (logged once per limiter)",
					slog.String("policy", p.Name), slog.String("error", err.Error()))
			}
			return err
		}
	}
	if n <= 0 {
		return errs.Errorf("hybrid", "allow %d on %.64q: %w", n, key, ErrInvalidN)
	}
	if n > t.est.Burst {
		return errs.Errorf("hybrid", "allow %d on %.64q, burst %d: %w", n, key, t.est.Burst, ErrExceedsBurst)
	}
	if l.keys.closed.Load() {
		return ErrClosed
	}
	return nil
}
