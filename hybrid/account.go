package hybrid

import (
	"github.com/leasehold/leasehold/remote"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/internal/lease"
)

// account is everything this process has of one key: its stock (the
// lease cell, spent lock-free, and its record's term as the cell's
// expiry), the store's last answer, its demand, and, in rareState, its
// flow (grantState), its due tokens (reservations), its outage debt
// (degradedKey) and a window's hold. Its stock and demand counts change
// only through the methods below (deposit, handOut, unhand, close,
// drainExpired, cut, missed); the concerns that decide (leaser, capacity,
// outage, pacer) call them. Every tracked key has one, so it is kept to
// 160 bytes (TestAccountSize): what only contended keys, outages and
// corrupt buckets need lives in rareState, allocated on first use. The
// first fields are the hot path's and are only touched atomically.
type account struct {
	lease  lease.Cell
	admits atomic.Int64 // decisions admitted from the lease
	// sweepMark is owned by the key table's sweep, which runs one pass at
	// a time: see idleSweep.
	sweepMark uint16
	// tier is the index of the key's tier in the policy (policyState.tiers),
	// fixed when the account is made: a key that changes tier gets a new
	// account.
	tier      uint16
	refilling atomic.Bool  // a background refill is running
	answer    answer       // the store's last answer
	inflow    atomic.Int64 // tokens put into the lease less those taken out unspent
	misses    atomic.Int64 // tokens asked for on the slow path
	waiting   atomic.Int64 // tokens wanted by callers waiting on a store call
	callSince atomicMono   // 1 + the time the store call in flight began; 0: none

	rare atomic.Pointer[rareState]
	key  string

	mu     sync.Mutex
	demand demand // under mu
}

// answer is the store's last answer for a key, kept so that decisions
// need not ask again: the bucket's level and when it is full, and a
// refusal (empty for requests of emptyFor tokens or more, until
// emptyUntil). The leaser writes it when a reply arrives; decisions read
// it lock-free.
type answer struct {
	emptyFor   atomic.Int32 // clamped to the field
	emptyUntil atomicMono
	resetAt    atomicMono
	level      atomic.Int64 // -1 before the first answer
}

// rareState is the part of an account that most keys never need. Each
// concern's part is its own type with its own lock.
type rareState struct {
	// The bucket's spill mark at the last answer (remote.SpillMark), kept
	// for keys whose bucket was not full: a debit of an outage carries
	// the one from before it began.
	markBorn, markSpill atomic.Int64

	pace  reservations // the pacer's
	down  degradedKey  // the outage's
	grant grantState   // capacity's
	// heldSince is, on a sliding window, the store time of the earliest
	// grant whose tokens may still be in the lease: a return names it, so
	// the window takes them back from where it counted them or earlier,
	// never later. 0 when the lease is empty.
	heldSince    atomicStoreMicros
	binding      atomic.Int32 // which limit the cached refusal came from
	recheckAt    atomicMono   // ask a window again from then; 0: never early
	corruptUntil atomicMono   // repeat corrupt until then

	// Under account.mu.
	drain   clock.Timer // takes a window's lease back at its expiry
	corrupt error       // the store's last ErrCorruptState for the key
}

// extra returns e's rareState, allocating it on first use.
func (e *account) extra() *rareState {
	if r := e.rare.Load(); r != nil {
		return r
	}
	r := &rareState{}
	if e.rare.CompareAndSwap(nil, r) {
		return r
	}
	return e.rare.Load()
}

// pendingUntil returns when pending reservations next release tokens, 0
// when none are pending.
func (e *account) pendingUntil() mono {
	if r := e.rare.Load(); r != nil {
		return r.pace.next.Load()
	}
	return 0
}

// readyFor returns when n tokens can be spent on e as far as pending
// reservations tell, at least a moment after now (a late release timer may
// be overdue), or 0 when none are pending: the time the releases bring the
// lease to n, or, when the reservations hold fewer, the last release plus
// the time the bucket takes to produce the rest. A caller waits for that
// rather than ask the store, which would only queue a grant behind them.
func (e *account) readyFor(n int64, now mono) mono {
	r := e.rare.Load()
	if r == nil || r.pace.next.Load() == 0 {
		return 0
	}
	return max(r.pace.readyAt(max(n-e.lease.Tokens(), 1)), now+1)
}

// reserved returns the tokens pending reservations still hold.
func (e *account) reserved() int64 {
	if r := e.rare.Load(); r != nil {
		return r.pace.held.Load()
	}
	return 0
}

// debt returns the tokens admitted in degraded mode not yet charged.
func (e *account) debt() int64 {
	if r := e.rare.Load(); r != nil {
		return r.down.debt.Load()
	}
	return 0
}

// takeDebt returns e's outage debt and clears it.
func (e *account) takeDebt() int64 {
	if r := e.rare.Load(); r != nil {
		return r.down.debt.Swap(0)
	}
	return 0
}

// live returns the tokens e's lease can still spend at at (see
// Limiter.spendAt): none once it has expired.
func (e *account) live(now mono) int64 {
	if now == noExpiry {
		return e.lease.Tokens()
	}
	return e.lease.Spendable(int64(now))
}

// setLowWater sets the low-water mark: a refill starts below it.
func (e *account) setLowWater(n int64) { e.lease.SetLowWater(n) }

// refuse caches a refusal of requests of n tokens or more until until;
// n is clamped: a request of 2^31 tokens or more is refused like the
// largest.
func (a *answer) refuse(n int64, until mono) {
	a.emptyFor.Store(int32(min(n, math.MaxInt32)))
	a.emptyUntil.Store(until)
}

// forget drops a cached refusal (a grant came, or the bucket was
// rescaled).
func (a *answer) forget() { a.emptyUntil.Store(0) }

// record keeps a reply's level and reset time, received at now.
func (a *answer) record(level int64, resetAfter time.Duration, now mono) {
	a.resetAt.Store(now.add(resetAfter))
	a.level.Store(level)
}

// seen reports whether the store has answered for the key.
func (a *answer) seen() bool { return a.level.Load() >= 0 }

// refusedUntil returns when the cached refusal for n tokens ends, or 0
// when there is none that holds at now. A sliding window's refusal is
// trusted only until its recheck time: tokens other processes give back
// return to the window at once, which its wait cannot foresee.
func (e *account) refusedUntil(n int64, now mono) mono {
	if n < int64(e.answer.emptyFor.Load()) {
		return 0
	}
	if r := e.rare.Load(); r != nil {
		if at := r.recheckAt.Load(); at != 0 && now >= at {
			return 0
		}
	}
	return e.answer.emptyUntil.Load()
}

func newAccount(key string) *account {
	e := &account{key: key}
	e.answer.level.Store(-1)
	return e
}

// spend takes n tokens from the lease at now for one decision (see take)
// and counts the admission; low reports that the lease fell below its
// low-water mark. Under the default it takes no lock and reads no clock.
func (e *account) spend(n int64, now mono) (ok, low bool, left int64) {
	if ok, left = e.take(n, now); ok {
		e.admits.Add(1)
		low = left < e.lease.LowWater()
	}
	return ok, low, left
}

// deposit puts n granted tokens into the lease, spendable until end, and
// into the key's books; false, putting nothing, once the lease is closed
// (eviction, Close): the caller still holds the n tokens.
func (e *account) deposit(n, end int64) bool {
	if !e.lease.Add(n, end) {
		return false
	}
	e.inflow.Add(n)
	return true
}

// depositBefore is deposit for a sliding window's tokens, which must be
// spent by expiry: the lease's end only moves earlier while it still
// holds tokens of an earlier grant. e.mu is held.
func (e *account) depositBefore(n, expiry int64) bool {
	if !e.lease.AddBefore(n, expiry) {
		return false
	}
	e.inflow.Add(n)
	return true
}

// handOut books hand tokens a store call brought for the callers waiting
// on it as leased and taken at once: their demand moves from misses to
// what the lease took in, in an order that never counts it twice (see
// demand.observe).
func (e *account) handOut(hand int64) {
	e.misses.Add(-hand)
	e.inflow.Add(hand)
}

// unhand takes back out of the books left tokens handed out that no
// caller took: their callers' demand goes back to misses.
func (e *account) unhand(left int64) {
	e.inflow.Add(-left)
	e.misses.Add(left)
}

// admitted counts a decision admitted without the lease (a grant's, or a
// store call's tokens handed out): activity of the key.
func (e *account) admitted() { e.admits.Add(1) }

// wait counts n tokens more wanted by callers waiting on a store call
// (negative: fewer, as they leave).
func (e *account) wait(n int64) { e.waiting.Add(n) }

// observe samples the key's demand at now and returns the fast-attack
// rate, with when the open sample window began before this sample and
// whether any had (see demand).
func (e *account) observe(now mono) (rate float64, last mono, seen bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	last, seen = e.demand.observed()
	return e.demand.observe(now, e.demandCount()), last, seen
}

// missed counts n tokens asked for that the lease could not give: the
// key's demand beyond what it spent.
func (e *account) missed(n int64) { e.misses.Add(n) }

// refund puts back n tokens a settled charge took from the lease and did
// not use, spendable until end: out of what was spent, not into what was
// leased. False once the lease is closed.
func (e *account) refund(n, end int64) bool { return e.lease.Add(n, end) }

// refundUnder is refund for a stock lease: only while the lease's end is
// still end, the record's term that counted the tokens, and before it
// (now).
func (e *account) refundUnder(n int64, end, now mono) bool {
	e.mu.Lock() // the lease's end moves under it (leaser.extendHeld)
	defer e.mu.Unlock()
	return mono(e.lease.Expiry()) == end && now < end && e.lease.Add(n, int64(end))
}

// extendTo moves the lease's end to end (a record's new term) and
// reports whether the lease is still open. e.mu is held.
func (e *account) extendTo(end int64) bool { return e.lease.Add(0, end) }

// close closes the lease for good and takes its unspent tokens out of the
// books; again reports that it was closed already.
func (e *account) close() (n int64, again bool) {
	e.mu.Lock()
	again = e.lease.Closed()
	n = e.lease.Close()
	e.mu.Unlock()
	e.inflow.Add(-n)
	return n, again
}

// drainExpired takes the lease's tokens out if it expired at or before
// now, and returns how many.
func (e *account) drainExpired(now mono) int64 {
	// An expired lease stays expired until the next grant: most of the
	// keys a sweep visits hold an empty one, which needs no lock.
	if mono(e.lease.Expiry()) > now || e.lease.Tokens() == 0 {
		return 0
	}
	e.mu.Lock()
	n := e.lease.DrainExpired(int64(now))
	e.mu.Unlock()
	e.inflow.Add(-n)
	return n
}

// cut trims the lease to at most keep tokens and returns how many it
// took out.
func (e *account) cut(keep int64) int64 {
	e.mu.Lock()
	n := e.lease.Cut(keep)
	e.mu.Unlock()
	e.inflow.Add(-n)
	return n
}

// take takes n tokens from the lease at now: a now of noExpiry takes
// whatever its expiry (a plain lease, which the sweep drains), any other
// only before it (a stock lease, whose record counts it until then).
func (e *account) take(n int64, now mono) (ok bool, left int64) {
	if now == noExpiry {
		return e.lease.Take(n)
	}
	return e.lease.TakeLive(n, int64(now))
}

func (a *answer) resetAfter(now mono) time.Duration {
	return max(a.resetAt.Load().sub(now), 0)
}

// levelAt returns when the bucket held level tokens: the last answer
// said it is full at resetAt, refilling from level at lim's rate. (A
// bucket in debt answered a level of 0 with a later reset: the estimate
// then refills from later than it could, which errs low.)
func (a *answer) levelAt(lim Limit, level int64) mono {
	return a.resetAt.Load().add(-lim.DurationFor(max(lim.Burst-level, 0)))
}

// remaining estimates what the fleet may still admit on the key at now:
// the bucket level of the store's last answer, refilled at lim's rate
// since (other processes' spending is unknown to this one), plus left,
// this process's unspent lease; at most Burst and never below left.
func (a *answer) remaining(lim Limit, left int64, now mono) int64 {
	level := a.level.Load()
	if level < 0 {
		return left
	}
	level += lim.TokensIn(max(now.sub(a.levelAt(lim, level)), 0))
	return max(min(level+left, lim.Burst), left)
}

// corruption returns the store's cached ErrCorruptState answer for the
// key and how long it stays cached, or nil: a clobbered bucket costs one
// store call per lease TTL, not one per decision.
func (e *account) corruption(now mono) (time.Duration, error) {
	r := e.rare.Load()
	if r == nil {
		return 0, nil
	}
	until := r.corruptUntil.Load()
	if now >= until {
		return 0, nil
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	return time.Duration(until - now), r.corrupt
}

// setCorrupt caches err, an ErrCorruptState answer, until `until`.
func (e *account) setCorrupt(err error, until mono) {
	r := e.extra()
	e.mu.Lock()
	r.corrupt = err
	e.mu.Unlock()
	r.corruptUntil.Store(until)
}

// consumed is the tokens spent from the lease so far: every token that
// entered the cell either was spent, was drained, or is still there.
func (e *account) consumed() int64 {
	return e.inflow.Load() - e.lease.Tokens()
}

// demandCount is the count the key's demand estimate follows, in tokens:
// spent from the lease and from grants, and asked for on the slow path.
// The lease sizing and grant renewals both observe it; a count that
// differed between them made the estimate jump at every renewal
// (TestDemandIsCountedOneWay).
func (e *account) demandCount() int64 {
	_, granted := e.granted()
	return e.consumed() + e.misses.Load() + granted
}

// idleSweep records a sweep of e that saw activity count activity, or
// found it busy, and returns for how many sweeps in a row e has been idle
// (0: active since the last). The count and the activity's low 12 bits
// share sweepMark: 2 bytes instead of 16 on every tracked key. (A key
// whose activity between two sweeps is a multiple of 4 096 looks idle to
// that sweep; eviction takes 8 idle sweeps in a row, and never takes a
// busy key.)
func (e *account) idleSweep(activity int64, busy bool) int {
	const idleBits = 4 // counts to idleSweepsBeforeEvict
	mark := uint16(activity) << idleBits
	if busy || e.sweepMark>>idleBits != mark>>idleBits {
		e.sweepMark = mark
		return 0
	}
	idle := min(e.sweepMark&(1<<idleBits-1)+1, 1<<idleBits-1)
	e.sweepMark = mark | idle
	return int(idle)
}

// busy reports whether e holds anything that eviction would lose or that
// is still changing: tokens, a reservation, a refill, a store call still
// out or callers waiting on one (what it brings is deposited into e: an
// entry forgotten meanwhile takes it out of use, TestKeyWithACallInFlightIsKept),
// outage debt or a cached "empty until" answer.
func (e *account) busy(now mono) bool {
	return e.lease.Tokens() > 0 || e.pendingUntil() != 0 || e.refilling.Load() || e.debt() != 0 ||
		e.callSince.Load() != 0 || e.waiting.Load() != 0 ||
		e.answer.emptyUntil.Load() > now || e.held() != nil
}

// use is the key's demand in this process as a share of lim's rate.
func (e *account) use(lim Limit) float64 { return ofRate(lim, e.demand.rate) }

// steadyUse is use by the key's steady demand (demand.mean): what a
// process can be counted on to spend over a grant's line. Before the
// first sample (a key drained within minSample) there is only the fast
// estimate. e.mu is held.
func (e *account) steadyUse(lim Limit) float64 {
	if e.demand.mean == 0 {
		return e.use(lim)
	}
	return ofRate(lim, e.demand.mean)
}

// ofRate is perSec tokens a second as a share of lim's rate.
func ofRate(lim Limit, perSec float32) float64 {
	return float64(perSec) * lim.Period.Seconds() / float64(max(lim.Rate, 1))
}

// demand estimates a key's token demand per second: a fast-attack,
// slow-decay average over samples at least minSample apart (rate), which
// sizes leases so that a burst does not wait for round trips, and a plain
// moving average of the same samples (mean). A process that stalls (a GC
// pause, a starved CPU) and then serves its backlog at once looks, by the
// fast attack, several times busier for a second or more; the mean
// counts the stall with the burst.
type demand struct {
	since mono  // 1 + the start of the sample window; 0: nothing observed
	base  int64 // count at the window start
	rate  float32
	// mean is 0 until the first sample, which it then starts from (and
	// after an idle spell long enough to decay it to 0 in a float32, the
	// next sample, which spans the spell).
	mean float32
}

const (
	minSample = 2 * time.Millisecond
	demandTau = time.Second
)

// observed reports whether observe has run, and when the open sample
// window began.
func (d *demand) observed() (start mono, ok bool) { return d.since - 1, d.since != 0 }

func (d *demand) observe(now mono, count int64) float64 {
	at, ok := d.observed()
	if !ok {
		d.since, d.base = now+1, count
		return float64(d.rate)
	}
	dt := now - at
	if dt < mono(minSample) {
		// Too soon for a sample, but a burst on a cold key must not wait
		// for one: take it as a rate over the minimum window if that is
		// higher (attack), and keep the window open.
		if r := float32(float64(count-d.base) / minSample.Seconds()); r > d.rate {
			d.rate = r
		}
		return float64(d.rate)
	}
	r := float64(count-d.base) / (float64(dt) / 1e9)
	k := 1 - math.Exp(-float64(dt)/float64(demandTau))
	if d.mean == 0 {
		d.mean = float32(r)
	} else {
		d.mean += float32(k * (r - float64(d.mean)))
	}
	if cur := float64(d.rate); r > cur {
		d.rate = float32(r) // attack at once: a batch too small costs round trips
	} else {
		d.rate = float32(cur + k*(r-cur))
	}
	d.since, d.base = now+1, count
	return float64(d.rate)
}

// mark keeps a reply's spill mark: for a key with rare state already, or
// whose bucket held less than maxLease (one that others draw too, where a
// partition's excess must be paid back). A full bucket spills anyway, and
// its debits charge their unpaid part.
func (e *account) mark(m remote.SpillMark, remaining, maxLease int64) {
	r := e.rare.Load()
	if r == nil {
		if m.Born == 0 || remaining >= maxLease {
			return
		}
		r = e.extra()
	}
	r.markSpill.Store(m.Spill)
	r.markBorn.Store(m.Born)
}

// lastMark is the spill mark of the last answer kept (zero: none).
func (e *account) lastMark() remote.SpillMark {
	if r := e.rare.Load(); r != nil {
		return remote.SpillMark{Born: r.markBorn.Load(), Spill: r.markSpill.Load()}
	}
	return remote.SpillMark{}
}
