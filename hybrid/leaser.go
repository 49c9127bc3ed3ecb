package hybrid

import (
	"context"
	"errors"
	"github.com/leasehold/leasehold/internal/background"
	"github.com/leasehold/leasehold/internal/errs"
	"log/slog"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leasehold/leasehold/breaker"
	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/reconcile"
	"github.com/leasehold/leasehold/remote"
	"github.com/sony/gobreaker/v2"
)

// leaser owns getting tokens from the store into entries' leases: spending
// them (the hot path), one flight per key, lease sizing from demand,
// low-water refills, future-dated reservations, and the store-time offset
// measured from every reply.
type leaser struct {
	cfg    *config
	store  *breaker.Store
	policy *policyTracker
	bg     *background.Group
	stats  *counters
	// settle takes the tokens the leaser holds but cannot deposit.
	settle *settlement
	// outage says whether decisions stay on the degraded share after an
	// outage (no refills then), and the fleet size a contended key's
	// share is taken from.
	outage  *outage
	pace    pacer                 // future-dated grants, released at the bucket's pace
	grants  *capacity             // told each key's demand, to ask for capacity grants
	flights flightTable           // by user key only
	workers workers               // run the flights callers wait for with a deadline
	inline  inline                // or the caller flies its flight itself
	calls   *background.Deadlines // lease calls' contexts: Close or the refill timeout ends them
	timers  sync.Pool             // of clock.Timer, for callers waiting on a flight
	offset  clock.Offset
	lastOK  atomicMono // the last successful store reply, to within replyNoteGap
	// noteAt is when the next reply updates lastOK and offset.
	noteAt atomicMono
	// lostLogged is set once a vanished bucket has been logged.
	lostLogged atomic.Bool
	// seq numbers lease calls (remote.Stock.Seq): rising, so that each
	// key's calls rise too.
	seq atomic.Int64
}

// spend takes n tokens from e's lease at now for one decision and returns the
// tokens left, starting a background refill when the lease falls below
// its low-water mark. It is the hot path: e.spend inlines, and the refill
// call runs about once per batch.
func (ls *leaser) spend(e *account, n int64, now mono) (ok bool, left int64) {
	ok, low, left := e.spend(n, now)
	if low {
		ls.refillAsync(e, now)
	}
	return ok, left
}

// sizeLease picks the batch to ask for and the low-water mark, from the
// key's demand: demand × horizon, at least need and 1, at most the policy's
// maximum lease (unless need alone is larger); a token more than need for a
// key that comes back well within a lease's life.
func (ls *leaser) sizeLease(e *account, p *policyState, need int64, now mono) int64 {
	// A key whose last store call was within half a lease's life comes
	// back well before the lease ends. A key coming back about once a
	// life would mostly give a spare token back unspent, a return call
	// instead of a saved one: at one decision per TTL, measured, 39
	// calls for 20 decisions.
	rate, last, seen := e.observe(now)
	back := seen && now.sub(last) <= ls.cfg.leaseTTL/2
	if ls.grants != nil {
		ls.grants.consider(e, p, rate, now)
	}
	horizon := ls.cfg.horizon
	if p.hold > 0 {
		horizon = min(horizon, p.life) // a window's lease lives that long
	}
	perHorizon := rate * horizon.Seconds()
	batch := int64(math.Ceil(perHorizon))
	most := p.tier(e).maxLease
	if ls.stock(p) && !ls.paced(p, e) && !ls.cfg.maxFractionSet && e.answer.level.Load() < p.tier(e).maxLease {
		// On a key at its limit a record counts a lease until its
		// holder's next call, and Burst/(2N) each leaves the bucket
		// room for the rest (see request): served in the maximum
		// lease's tenths of Burst, 4 processes at twice the limit made
		// 28 calls in their first 100 ms. Below the limit the tenth
		// stays: a lease that lasts longer delays the call that finds
		// Redis hung (degraded 0.95–1.1 s after a pause, 0.64 s).
		most = max(most, ls.stockShare(p.tier(e)))
	}
	batch = min(max(batch, 1), most)
	low := min(int64(perHorizon/2), batch/2)
	if p.hold > 0 {
		// A sliding window's lease is refilled when dry, not before:
		// each lease then holds one grant's tokens, which must be spent
		// within that grant's hold.
		low = 0
	}
	e.setLowWater(low)
	if back && p.hold == 0 {
		// Keep a token for the key's next decision. Without it a key
		// whose batch the cap holds to one token (any Burst under 20)
		// pays a store call for every decision however often it comes.
		// One token is within the cap on what a lease holds.
		return max(batch, need+1)
	}
	return max(batch, need)
}

// alone reports whether the fleet count says this process is the only
// one drawing its buckets: WithFleetSize(1), or heartbeats counting 1
// from the second on.
func (ls *leaser) alone(now mono) bool { return alone(ls.cfg, ls.outage, now) }

// alone reports whether the fleet is this process alone: so configured,
// or counted alone by heartbeats for two of their intervals.
func alone(cfg *config, o *outage, now mono) bool {
	return cfg.fleetSize == 1 || cfg.fleetSize <= 1 && o.count.Load() == 1 && now >= mono(2*cfg.hbInterval)
}

// refillAsync starts a background refill of e unless one is running or
// reservations still hold more than the low-water mark. It runs about once
// per batch, not per request. On the real clock the refill flies on the
// workers, as a caller's flight does (a callback of the clock ran each in
// a goroutine of its own); on another clock (clock.Manual, the
// simulator's) it runs as the clock's callback, inside Advance, where a
// run is deterministic.
//
// at is the caller's time for its spend (noExpiry: none read); a low
// lease's decisions each come here, so the clock is read only past the
// checks that need none (a clock read is 30 ns here, and a key drained
// while its flow decides came here on every decision).
func (ls *leaser) refillAsync(e *account, at mono) {
	if e.reserved() > e.lease.LowWater() || e.refilling.Load() {
		return
	}
	if at == noExpiry {
		at = ls.cfg.now()
	}
	if ls.outage.held(at) || ls.cfg.stock && e.flowing(at) || !e.refilling.CompareAndSwap(false, true) {
		return
	}
	if ls.cfg.realtime {
		f, lead := ls.flights.join(ls, e, 0)
		if !lead {
			e.refilling.Store(false) // the flight under way refills
			return
		}
		ls.workers.run(f) // the flight clears refilling as it lands
		return
	}
	if ls.bg.After(0, func() {
		defer e.refilling.Store(false)
		_, _ = ls.fetch(context.Background(), e, 0)
	}) == nil {
		e.refilling.Store(false)
	}
}

// fetchOutcome is what a flight did for its callers.
type fetchOutcome struct {
	deposited bool
	// handout is the tokens the call brought for the callers waiting on
	// it, kept out of the lease (see granted); handed reports that this
	// caller's n were among them.
	handout int64
	handed  bool
	retry   time.Duration
	at      mono // when the outcome was known
}

// errSlowFlight reports a synchronous caller that stopped waiting for a
// store call after the store timeout; the call itself goes on.
var errSlowFlight = errs.Errorf("hybrid", "store slower than the store timeout: %w", remote.ErrUnavailable)

// fetch asks the store for tokens for e, one flight per key: concurrent
// callers share the call and its outcome. need is the request that could
// not be served (0 marks a background refill, which waits for the store as
// long as the refill timeout allows, while a synchronous caller waits at
// most the store timeout: the flight goes on without it); the store is
// asked for what the lease lacks of it, so that a refusal's wait is for
// those tokens and asking again then finds them.
func (ls *leaser) fetch(ctx context.Context, e *account, need int64) (fetchOutcome, error) {
	f, lead := ls.flights.join(ls, e, need)
	flown := false
	if lead {
		switch {
		case need == 0:
			f.fly(ls.calls) // a background refill waits for its own flight
		case ls.inline.take(ctx, ls.cfg.now()):
			f.fly(ls.inline.calls)
			ls.inline.done()
			flown = true
		default:
			ls.workers.run(f)
		}
	}
	if need == 0 {
		if lead {
			return f.out, f.err // flown above
		}
		<-ls.flights.wait(f)
		return f.out, f.err
	}
	defer f.leave()
	if flown {
		if ctx.Err() != nil {
			// ctx ended during the call: as a caller waiting on a
			// worker's flight would have left it (the call's tokens stay
			// in the lease).
			return fetchOutcome{}, ctx.Err()
		}
		return f.outcomeFor(need), f.err
	}
	done := ls.flights.wait(f)
	select {
	case <-done: // done already, or soon: no timer
		return f.outcomeFor(need), f.err
	default:
	}
	t := ls.waitTimer()
	select {
	case <-done:
		ls.putTimer(t, t.Stop())
		return f.outcomeFor(need), f.err
	case <-t.C():
		ls.putTimer(t, true)
		return fetchOutcome{}, errSlowFlight
	case <-ctx.Done():
		ls.putTimer(t, t.Stop())
		return fetchOutcome{}, ctx.Err()
	}
}

// waitTimer is a timer of the store timeout for a caller waiting on a
// flight, reused: a new one was 3 of a cold decision's allocations.
func (ls *leaser) waitTimer() clock.Timer {
	if t, ok := ls.timers.Get().(clock.Timer); ok {
		t.Reset(ls.cfg.storeTimeout)
		return t
	}
	return ls.cfg.clk.NewTimer(ls.cfg.storeTimeout)
}

// putTimer keeps t for reuse when nothing can be left on its channel: it
// was stopped before it fired, or what it sent was received.
func (ls *leaser) putTimer(t clock.Timer, clean bool) {
	if clean {
		ls.timers.Put(t)
	}
}

// leaseFor is one flight: a lease call sized for every caller waiting on
// e, unless an earlier flight already served them.
func (ls *leaser) leaseFor(e *account, need int64, calls *background.Deadlines) (fetchOutcome, error) {
	ls.policy.syncOnce(ls.bg.Ctx)
	p := ls.policy.load()
	start := ls.cfg.now()
	// A flight that just ended may already have served this caller, or
	// the key's grant came while this flight waited to run: a holder
	// leases nothing, its grant decides (a background refill of tokens
	// leased before the grant would find the bucket emptied by the
	// grants: measured, one empty-handed call per holder).
	if need > 0 && e.live(ls.cfg.spendAtNow(start)) >= need {
		return fetchOutcome{deposited: true, at: start}, nil
	}
	if h := e.held(); h != nil && h.serves(start, max(need, 1)) && (!ls.cfg.stock || h.bucket.Tokens(int64(start)) >= max(need, 1)) {
		return fetchOutcome{deposited: true, at: start}, nil
	}
	waiters := max(need, e.waiting.Load()) // the request is sized for them
	var until mono
	short := need
	if need > 0 {
		// A caller waits for tokens a reservation releases soon (a
		// refill asks for the grant after it), and asks the store for
		// what the lease does not hold.
		until = e.readyFor(need, start)
		short = max(need-e.live(ls.cfg.spendAtNow(start)), 1)
	}
	until = max(until, e.refusedUntil(max(short, 1), start)) // a refusal for as many or fewer tokens
	if until > start {
		return fetchOutcome{retry: until.sub(start), at: start}, nil
	}
	req := ls.request(e, p, short, start) // may start the key's first grant call
	if short != need {
		// The caller takes some of its tokens from the lease: none are
		// handed to it (see flight.outcomeFor), so none are spent at once.
		req.Stock.Spend = 0
	}
	if w := e.grantWait(start, ls.cfg.storeTimeout); w > start {
		if ls.grants != nil {
			ls.grants.overdue(e, start)
			ls.grants.leased(e) // no lease call to wait for
		}
		return fetchOutcome{retry: w.sub(start), at: start}, nil
	}
	res, now, err := ls.call(e, req, calls, start)
	if err != nil {
		return fetchOutcome{}, err
	}
	if req.Stock.Holder != "" {
		ls.extendHeld(e, p, res, start)
	}
	return ls.apply(e, p, res, req, waiters, start, now), nil
}

// extendHeld moves the end of e's lease after a lease call naming this
// process's record, sent at start and answered with res: the record now
// counts what the lease holds until the new term, and the lease may
// spend it until then. The store keeps the later of the record's end and
// the new term's, so the lease keeps the later of its own too. Held or
// not, the end moves a nanosecond at least (well within the margin), so
// that it tells records apart (see Limiter.refund).
func (ls *leaser) extendHeld(e *account, p *policyState, res remote.Result, start mono) {
	e.mu.Lock()
	end := e.lease.Expiry() + 1
	if res.Held {
		end = max(int64(ls.stockUntil(start, res.Delay)), end)
	}
	open := e.extendTo(end)
	e.mu.Unlock()
	if !open && res.Held {
		// Released (Close, eviction) while this call flew: the record it
		// made goes too.
		ls.settle.later(ls.releaseItem(p, e, 0))
	}
}

// releaseItem gives n of e's tokens back under p and drops this
// process's record of e at the store, unless a later lease made it.
func (ls *leaser) releaseItem(p *policyState, e *account, n int64) reconcile.Item {
	it := ls.returnItem(p, e, n)
	it.Req.Stock = remote.Stock{Holder: ls.outage.id, Seq: ls.seq.Load(), Release: true}
	return it
}

// call sends req for e with a context from calls (see flight.fly), sent at
// start, and returns the store's reply and when it came.
func (ls *leaser) call(e *account, req remote.Request, calls *background.Deadlines, start mono) (remote.Result, mono, error) {
	// Not the caller's context: joined callers share this call. Close ends
	// it; the refill timeout bounds it (the store timeout, flown inline).
	e.callSince.Store(start + 1)
	call := calls.Take()
	res, err := ls.store.Lease(call.Context(), req)
	cut := err != nil && errors.Is(call.Context().Err(), context.DeadlineExceeded)
	call.Done()
	e.callSince.Store(0)
	if ls.grants != nil {
		ls.grants.leased(e)
	}
	if errors.Is(err, breaker.ErrOpen) {
		return remote.Result{}, 0, err // refused by the breaker: no call was made
	}
	ls.stats.storeCalls.Add(1)
	now := ls.cfg.now()
	ls.inline.observe(start, now, cut)
	if err != nil {
		ls.stats.storeErrors.Add(1)
		if cut && calls == ls.inline.calls {
			// Flown inline and cut short at the store timeout: decided
			// as a caller that left a slow worker's flight is.
			return remote.Result{}, 0, errSlowFlight
		}
		if errors.Is(err, remote.ErrCorruptState) {
			e.setCorrupt(err, now.add(ls.cfg.leaseTTL))
		}
		return remote.Result{}, 0, err
	}
	ls.stats.storeLatency.observe(float64(now-start) / 1e9)
	if now >= ls.noteAt.Load() {
		ls.noteAt.Store(now.add(replyNoteGap))
		ls.lastOK.Store(now)
		ls.offset.Observe(ls.cfg.epoch.Add(time.Duration(start)), ls.cfg.epoch.Add(time.Duration(now)), res.Now)
	}
	return res, now, nil
}

// replyNoteGap is how often store replies update the leaser's last good
// reply and the clock offset, both read against hundreds of
// milliseconds: written by every call, from both cores, their lines (and
// the offset's mutex) moved between cores on every cold decision.
const replyNoteGap = time.Millisecond

// request builds the lease request for e: sized for every caller waiting
// on the key, not just the one that started the flight (the others joined
// it and will take from it).
func (ls *leaser) request(e *account, p *policyState, need int64, now mono) remote.Request {
	want := ls.sizeLease(e, p, max(need, e.waiting.Load()), now)
	if share := ls.contendedShare(e, p, now); share > want {
		want = share
		e.setLowWater(share / 4)
	}
	if ls.stock(p) {
		// A holder's record counts what it had at its last call until
		// its next: about a lease and a half between calls. Holders of
		// Burst/(2N) each leave the bucket room for the rest.
		want = max(min(want, ls.stockShare(p.tier(e))), need, 1)
	}
	if level := e.answer.level.Load(); p.hold > 0 && level >= 0 && level < p.tier(e).maxLease {
		// A sliding window near full: tokens a lease would hold idle
		// are the ones other processes wait for. Take only what this
		// decision needs.
		want = max(need, e.waiting.Load(), 1)
	}
	want = min(want, p.tier(e).est.Burst)
	// A caller waits for this call: whatever covers its need is granted
	// now. A background refill prefers a future-dated full lease (paced
	// grants on a contended key) and takes the tail of the bucket only
	// when no full lease can be future-dated.
	minimum, floor := max(need, 1), max(need, 1)
	req := p.request(ls.cfg.prefix, e)
	if need == 0 && ls.paced(p, e) {
		minimum = want
	}
	if ls.stock(p) && e.flowing(now) {
		// A holder of flow asks stock for what its flow refused: the
		// bucket refills only at the rate the grants leave, and a lease
		// of the token or two there at each refusal was a store call
		// per refusal (220 a 1 000 admitted at twice the limit). It
		// waits for a whole lease.
		minimum, floor = max(need, want), max(need, want)
	}
	if ls.paced(p, e) && !e.grantMode() {
		// A key that holds or asks for a grant future-dates nothing: no
		// share rises while future-dated tokens are out.
		req.MaxDelay = ls.cfg.maxDelay
	}
	req.N, req.Min, req.Need = want, minimum, floor
	if ls.stock(p) {
		// The caller's tokens are handed to it as the reply comes (see
		// granted): spent at once, the record need not count them.
		req.Stock = remote.Stock{Holder: ls.outage.id, Keep: e.lease.Spendable(int64(now)) + e.reserved(),
			Spend: need, Seq: ls.seq.Add(1), Term: ls.cfg.leaseTTL + stockGrace}
	}
	return req
}

// stock reports whether leases under p are counted under this process's
// record at the store until their term (a token bucket, on a store that
// is not a region's).
func (ls *leaser) stock(p *policyState) bool { return ls.cfg.stock && !p.shaped }

// stockGrace is how long the store counts a lease's record past the
// term its holder spends by (stockUntil): the holder's coarse clock
// (coarseTick) may fall behind by as much as its timers are late, and
// only unreported tokens (a crash, a cut) are counted the longer.
const stockGrace = time.Second

// paced reports whether leases under p may be future-dated: a token
// bucket with WithMaxReservation above 0. Under stock records a
// future-dated lease holds its record's room before its tokens are due,
// so contendedShare asks for one only on a dry key, and request caps it
// at stockShare. Not where flow serves a key at its limit: a
// future-dated lease keeps the bucket's level below zero, where grants
// may not rise (measured: grants at share 0 for the first 1.2 s).
func (ls *leaser) paced(p *policyState, e *account) bool {
	return ls.cfg.maxDelay > 0 && !p.shaped && !ls.flows(p.tier(e))
}

// flows reports whether keys of tier t at their limit hold flow: stock
// records and grants on, and a fleet flow fits (capacity.flowFits).
func (ls *leaser) flows(t *tierState) bool {
	return ls.cfg.stock && ls.cfg.grantTerm > 0 && ls.grants != nil && ls.grants.flowFits(t.limits[0])
}

// stockShare is the most a lease asks for under stock records, beyond
// the tokens its callers need: Burst/(2N) in a fleet of N.
func (ls *leaser) stockShare(t *tierState) int64 {
	return max(t.limits[0].Burst/int64(2*max(ls.outage.size(), 1)), 1)
}

// stockUntil is when a process stops spending the tokens of a lease sent
// at start and future-dated by delay: a margin before the store's record
// ends, counted from the send (the store read its TIME after it), as
// clock rates drift by parts per million.
func (ls *leaser) stockUntil(start mono, delay time.Duration) mono {
	term := ls.cfg.leaseTTL
	return start.add(delay + term - term/100 - time.Millisecond)
}

// contendedShare is the grant to ask for on a key at its limit (the last
// answer left the bucket below one maximum lease, or tokens are reserved):
// this process's fair share of the rate, Rate/N, over half the maximum
// reservation. Released at the bucket's pace (see reservation), such a
// grant keeps the bound in every window however large, so a key at its
// limit costs about 2·N store calls per maximum reservation, not one per
// maximum lease; half leaves room in the reservation horizon for every
// process's next grant. A process alone takes four fifths: its own next
// grant, asked for at the low-water mark (a quarter left), still fits
// (measured: 1 process on 100 000 Zipf keys at 10/s, 1 goroutine, 72–74
// store calls per 1 000 decisions above the idle floor against 79–80 with
// half). 0 when the key is not contended, reservations are off, or the
// store is not known healthy.
func (ls *leaser) contendedShare(e *account, p *policyState, now mono) int64 {
	if !ls.paced(p, e) || ls.store.State() != gobreaker.StateClosed || ls.outage.held(now) || e.grantMode() {
		// A probe of a store that was down gets a plain lease: a long
		// grant would fall due while the recovery hold still decides by
		// the degraded share, and be spent on top of it.
		return 0
	}
	level := e.answer.level.Load()
	if e.reserved() == 0 && (level < 0 || level >= p.tier(e).maxLease) {
		return 0
	}
	if ls.stock(p) && e.reserved() == 0 && level > 0 {
		// Under stock records a bucket below a lease may be one the
		// records hold, not one drawn at its rate: only a dry one is
		// at its limit.
		return 0
	}
	lim := p.tier(e).limits[0]
	if ls.alone(now) {
		return lim.TokensIn(ls.cfg.maxDelay * 4 / 5)
	}
	share := lim.TokensIn(ls.cfg.maxDelay/2) / int64(max(ls.outage.size(), 1))
	if ls.stock(p) {
		// A record holds the bucket's room until its holder's next
		// call: a share this process spends within half a reservation
		// turns over, where a fleet still counted as one at start-up
		// (Burst/2 each) held the bucket for a second while the other
		// processes, under the limit, were refused.
		e.mu.Lock()
		u := e.steadyUse(lim)
		e.mu.Unlock()
		share = min(share, max(int64(u*float64(lim.TokensIn(ls.cfg.maxDelay/2))), 1))
	}
	return share
}

// atLimit reports a key at its limit, or one the store has not answered for
// yet (its level is -1 until then): tokens are reserved for it, or its last
// answer left the bucket below one maximum lease.
func atLimit(e *account, t *tierState) bool {
	return e.reserved() > 0 || e.answer.level.Load() < t.maxLease
}

// apply records a lease reply on e under p, for a request that needed need
// tokens and was sized for waiters tokens of callers waiting on it, sent
// at start and answered at now.
func (ls *leaser) apply(e *account, p *policyState, res remote.Result, req remote.Request, waiters int64, start, now mono) fetchOutcome {
	need := req.Need
	if res.Granted > 0 {
		ls.stats.leaseSizes.observe(float64(res.Granted))
	}
	if res.Stale {
		if ls.policy.learn(res.Version) {
			ls.bg.After(0, func() { ls.policy.refreshShared(ls.bg.Ctx) })
		}
		return fetchOutcome{retry: staleRetry, at: now}
	}
	// A bucket found missing while it should have existed (half its TTL
	// margin of slack for clock drift) was removed by someone else.
	if res.Created && e.answer.seen() && now < e.answer.resetAt.Load().add(remote.TTLMargin/2) {
		ls.bucketLost(e)
	}
	e.answer.record(res.Remaining, res.ResetAfter, now)
	e.mark(res.Mark, res.Remaining, p.tier(e).maxLease)
	if res.Binding != 0 || e.rare.Load() != nil {
		e.extra().binding.Store(int32(res.Binding))
	}
	if res.Granted > 0 {
		ls.stats.leaseGrants.Add(1)
		e.answer.forget()
		return ls.granted(e, p, res, req.Stock.Spend, waiters, start, now)
	}
	if ls.grants != nil {
		ls.grants.refused(e, p, res.Holders, now)
	}
	res.RetryAfter = ls.cacheRefusal(e, p, need, res.RetryAfter, now)
	return fetchOutcome{retry: res.RetryAfter, at: now}
}

// cacheRefusal keeps the store's refusal of need tokens on e, replied at
// now with wait retry, and returns the wait the refusal holds for.
func (ls *leaser) cacheRefusal(e *account, p *policyState, need int64, retry time.Duration, now mono) time.Duration {
	if e.grantMode() || ls.stock(p) {
		// Waiting for its grant, a key at its limit is not paced, and a
		// dry bucket under stock records before any flow waits a token
		// at a high rate: a refusal holds a little longer, or each
		// decision would be a store call (every half millisecond from
		// each process) until the grant comes or demand is measured.
		retry = max(retry, grantWaitRefusal)
	}
	refused, until := max(need, 1), now.add(retry)
	if ls.stock(p) && e.flowing(now) {
		refused = 1 // it asked for a whole lease (see request)
		if retry >= grantsHoldAll {
			// Grants hold the rate until a renewal divides it again: the
			// store's wait then is its own guess (a second), and a call
			// each second from every holder at the limit was 2 of its 3
			// store calls per 1 000 admitted. A shorter wait is the
			// refill the grants leave the bucket: asked again then,
			// not at the renewal, its tokens serve the demand the flow
			// does not (flow is asked below demand).
			until = max(until, e.extra().grant.nextAt.Load())
		}
	}
	e.answer.refuse(refused, until)
	if p.hold > 0 {
		// Returns reach the window at each sweep of the fleet.
		e.extra().recheckAt.Store(now.add(ls.cfg.sweepInterval))
	}
	return retry
}

// grantsHoldAll is the store's wait for a lease on a dry bucket from
// which the grants leave no refill: its own guess, a second (at most the
// first grant's end).
const grantsHoldAll = 500 * time.Millisecond

// granted puts the tokens of a reply that granted some where they belong:
// a sliding window's lease until its hold, a stock lease until its
// record's term (the waiting callers' at once), a plain lease until its
// TTL, or a reservation released at the bucket's pace.
func (ls *leaser) granted(e *account, p *policyState, res remote.Result, spend, waiters int64, start, now mono) fetchOutcome {
	switch {
	case res.Delay <= 0 && p.hold > 0:
		ls.depositHeld(e, p, res.Granted, res.Now, start.add(p.life))
		return fetchOutcome{deposited: true, at: now}
	case res.Delay <= 0 && ls.stock(p) && res.Held:
		// The record counts all but the tokens spent at once, until its
		// term: the lease's expiry was moved there as the reply came (see
		// leaseFor). Tokens its callers leave untaken are dropped.
		hand := ls.handOut(e, min(res.Granted, spend), waiters)
		if rest := res.Granted - hand; rest > 0 {
			ls.deposit(e, rest, mono(e.lease.Expiry()), now)
		}
		return fetchOutcome{deposited: true, handout: hand, at: now}
	case res.Delay <= 0 && ls.stock(p):
		// Past the records the bucket keeps: the waiting callers' tokens
		// are theirs at once, and nothing is held.
		hand := ls.handOut(e, res.Granted, waiters)
		if rest := res.Granted - hand; rest > 0 {
			ls.settle.later(ls.returnItem(p, e, rest))
		}
		return fetchOutcome{deposited: true, handout: hand, at: now}
	case res.Delay <= 0:
		ls.deposit(e, res.Granted, now.add(ls.cfg.leaseTTL), now)
		return fetchOutcome{deposited: true, at: now}
	}
	until := mono(math.MaxInt64) // given back when it expires, as leases are
	if ls.stock(p) {
		until = ls.stockUntil(start, res.Delay)
	}
	ls.pace.reserve(e, p.tier(e).limits[0], res.Granted, res.Delay, now, until)
	return fetchOutcome{retry: res.Delay, at: now}
}

// bucketLost counts a bucket that vanished before its TTL (evicted by a
// Redis under memory pressure, or deleted) while this process used it: it
// came back full, so the fleet may admit a fresh burst. Logged once.
func (ls *leaser) bucketLost(e *account) {
	ls.stats.bucketsLost.Add(1)
	if ls.lostLogged.CompareAndSwap(false, true) {
		ls.cfg.logger.LogAttrs(context.Background(), slog.LevelError,
			"leasehold: a bucket vanished before its TTL (evicted? set maxmemory-policy noeviction)",
			slog.String("key", e.key))
	}
}

// deposit puts n granted tokens in e's lease: a stock lease's until its
// record's term (until, at most the latest record's), a plain lease's
// until the TTL from now, after which the sweep gives them back; if e was
// closed meanwhile (eviction, Close) they can no longer be spent and go
// back at once.
func (ls *leaser) deposit(e *account, n int64, until, now mono) {
	ls.stats.tokensLeased.Add(n)
	p := ls.policy.load()
	end := int64(now.add(ls.cfg.leaseTTL))
	if ls.stock(p) {
		// Spendable until the latest record's term at most, which
		// counts them (a future-dated lease's tokens, due now: its
		// Keep did).
		end = min(int64(until), e.lease.Expiry())
	}
	if !e.deposit(n, end) {
		ls.giveBack(e, n)
	}
}

// giveBack gives n of e's tokens that can no longer be spent back to the
// bucket.
func (ls *leaser) giveBack(e *account, n int64) {
	ls.settle.later(ls.returnItem(ls.policy.load(), e, n))
}

// handOut gives the callers waiting on e's flight their tokens of a
// grant of granted at once, at most waiters: the store admitted them as
// it granted them. It returns how many.
func (ls *leaser) handOut(e *account, granted, waiters int64) int64 {
	hand := min(granted, waiters)
	ls.stats.tokensLeased.Add(hand)
	e.handOut(hand)
	return hand
}

// depositHeld puts tokens of a sliding window, granted at store time
// granted, in e's lease until expiry (the call's start plus the
// policy's lease life, so before the hold the store counted them for
// ends). A drain timer takes back what is left at expiry rather than the
// sweep, whose period may be longer than the hold; the lease's expiry
// only moves earlier while it still holds tokens of an earlier grant.
func (ls *leaser) depositHeld(e *account, p *policyState, n int64, granted time.Time, expiry mono) {
	ls.stats.tokensLeased.Add(n)
	x := e.extra()
	e.mu.Lock()
	if old := x.heldSince.Load(); old == 0 || e.lease.Tokens() == 0 || storeTime(granted) < old {
		x.heldSince.Store(storeTime(granted))
	}
	ok := e.depositBefore(n, int64(expiry))
	old := x.drain
	x.drain = nil
	e.mu.Unlock()
	if old != nil {
		old.Stop()
	}
	if !ok {
		ls.settle.later(ls.returnItem(p, e, n))
		return
	}
	// Armed outside e.mu: a manual clock runs a due callback at once.
	t := ls.bg.After(mono(e.lease.Expiry()).sub(ls.cfg.now()), func() {
		if items := ls.drainExpired(ls.policy.load(), e, ls.cfg.now()); len(items) > 0 {
			// Unspent tokens count in the window until they are back:
			// send them now, not at the next sweep.
			ls.settle.soon(items...)
		}
	})
	if t == nil {
		return // closing
	}
	e.mu.Lock()
	old, x.drain = x.drain, t
	e.mu.Unlock()
	if old != nil {
		old.Stop()
	}
}

// stopDrain stops e's drain timer, if any (release).
func (ls *leaser) stopDrain(e *account) {
	r := e.rare.Load()
	if r == nil {
		return
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if r.drain != nil {
		r.drain.Stop()
		r.drain = nil
	}
}

// release closes e's lease and cancels its reservations, returning the
// settlements that give their tokens back to e's buckets under p.
func (ls *leaser) release(p *policyState, e *account) []reconcile.Item {
	ls.stopDrain(e)
	var out []reconcile.Item
	n, again := e.close()
	if ls.stock(p) {
		// What the record counts goes at once, not at its term: a
		// release that no later lease of this process overtakes. Once:
		// a call that lands after it releases its own record
		// (extendHeld), and Close's second pass sent every key's
		// release twice. The record counted the reservations' tokens
		// not yet due too (Keep).
		n += ls.pace.cancel(e)
		if again {
			if n > 0 {
				return []reconcile.Item{ls.returnItem(p, e, n)}
			}
			return nil
		}
		return []reconcile.Item{ls.releaseItem(p, e, n)}
	}
	if n > 0 {
		out = append(out, ls.returnItem(p, e, n))
	}
	if n := ls.pace.cancel(e); n > 0 {
		out = append(out, ls.returnItem(p, e, n))
	}
	return out
}

// drainExpired takes back e's lease if it expired at or before now.
func (ls *leaser) drainExpired(p *policyState, e *account, now mono) []reconcile.Item {
	if n := e.drainExpired(now); n > 0 {
		return []reconcile.Item{ls.returnItem(p, e, n)}
	}
	return nil
}

// cut trims e's lease to at most keep tokens and returns the excess as a
// settlement to e's buckets under p.
func (ls *leaser) cut(p *policyState, e *account, keep int64) []reconcile.Item {
	if n := e.cut(keep); n > 0 {
		return []reconcile.Item{ls.returnItem(p, e, n)}
	}
	return nil
}

// returnItem is the settlement that gives n of e's tokens back to its
// bucket under p; to a sliding window, from the sub-window of e's
// earliest grant still held (or an earlier one), never a later one.
func (ls *leaser) returnItem(p *policyState, e *account, n int64) reconcile.Item {
	req := p.request(ls.cfg.prefix, e)
	req.N = n
	if r := e.rare.Load(); r != nil && p.hold > 0 {
		if since := r.heldSince.Load(); since > 0 {
			req.Since = since.time()
		}
	}
	return reconcile.Item{Op: remote.OpReturn, Req: req}
}
