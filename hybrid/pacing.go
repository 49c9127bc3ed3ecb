package hybrid

import (
	"github.com/leasehold/leasehold/internal/background"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leasehold/leasehold/clock"
)

// A future-dated grant (a reservation) is released at the pace the bucket
// would have produced its tokens, not as a lump when the last one is due:
// token i of n becomes spendable at end − (n−i)·step, where end is when the
// store said the whole grant is conformant and step is the time the
// bucket takes per token, rounded down so no token is ever early. Spent
// as released, a grant is a GCRA-conformant stream, so the fleet's
// admissions keep Burst + Rate·w in every window, however long the
// horizon the grant covers. That is what lets a key at its limit be
// granted a long horizon per store call (see request).
//
// Tokens are released when a decision finds them due (catchUp) or, for
// what no decision took, when the grant ends: one timer per reservation,
// at end. A timer per release ran in a goroutine of its own each time
// (AfterFunc), nearly all the goroutines a cold Zipf benchmark started.
type reservation struct {
	n         int64       // tokens granted
	delivered int64       // tokens deposited so far; under reservations.mu
	end       mono        // when the last token becomes spendable
	step      int64       // ns per token, rounded down
	timer     clock.Timer // fires at end; under reservations.mu
	until     mono        // the end of its tokens' line (leaser.lifetime)
}

// releaseLag keeps each release strictly after the store's µs-rounded
// conformance time.
const releaseLag = mono(time.Microsecond)

// at returns when token i (1..n) becomes spendable.
func (r *reservation) at(i int64) mono {
	if i >= r.n {
		return r.end
	}
	return r.end - mono((r.n-i)*r.step) + releaseLag
}

// dueBy returns how many tokens are spendable at now.
func (r *reservation) dueBy(now mono) int64 {
	if now >= r.end {
		return r.n
	}
	if r.step <= 0 {
		return 0
	}
	// at(i) <= now  <=>  (n−i)·step >= end − now + lag
	k := int64(r.end-now+releaseLag+mono(r.step)-1) / r.step // tokens still ahead
	return min(max(r.n-k, 0), r.n)
}

// tokenStep is the time the bucket takes per token under lim, rounded
// down to the nanosecond.
func tokenStep(lim Limit) int64 {
	return int64(lim.Period) / max(lim.Rate, 1)
}

// reservations are a key's future-dated grants not yet all released.
// They have their own lock; decisions and refills read, lock-free, when
// the next release is due and how many tokens are still held back.
type reservations struct {
	mu   sync.Mutex
	list []*reservation // under mu
	next atomicMono     // when the next release is due; 0: none pending
	held atomic.Int64   // tokens granted and not yet released
}

// addLocked adds r; mu is held.
func (rs *reservations) addLocked(r *reservation) {
	rs.list = append(rs.list, r)
	rs.publishLocked()
}

// hasLocked reports whether r is still pending (not cancelled); mu is
// held.
func (rs *reservations) hasLocked(r *reservation) bool {
	return slices.Contains(rs.list, r)
}

// removeLocked drops r; mu is held.
func (rs *reservations) removeLocked(r *reservation) {
	if i := slices.Index(rs.list, r); i >= 0 {
		rs.list = slices.Delete(rs.list, i, i+1)
	}
}

// publishLocked publishes, for lock-free readers, when the pending
// reservations next release tokens and how many they still hold; mu is
// held.
func (rs *reservations) publishLocked() {
	var next mono
	var n int64
	for _, r := range rs.list {
		if r.delivered >= r.n {
			continue // delivered ahead of its timer (catchUp); the timer ends it
		}
		if at := r.at(r.delivered + 1); next == 0 || at < next {
			next = at
		}
		n += r.n - r.delivered
	}
	rs.next.Store(next)
	rs.held.Store(n)
}

// readyAt returns when k more tokens will have been released, merging
// the pending reservations' release times; when they hold fewer than k,
// the last release plus the rest at the bucket's pace (the step of the
// last reservation). 0 when none are pending.
func (rs *reservations) readyAt(k int64) mono {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	if len(rs.list) == 0 {
		return 0
	}
	next := make([]int64, len(rs.list)) // the next token of each to count
	var last mono                       // when the last of them all is released
	for i, r := range rs.list {
		next[i] = r.delivered + 1
		last = max(last, r.end)
	}
	for ; k > 0; k-- {
		best := -1
		for i, r := range rs.list {
			if next[i] <= r.n && (best < 0 || r.at(next[i]) < rs.list[best].at(next[best])) {
				best = i
			}
		}
		if best < 0 { // all counted: the rest come at the bucket's pace
			return last + mono(k*rs.list[len(rs.list)-1].step)
		}
		if k == 1 {
			return rs.list[best].at(next[best])
		}
		next[best]++
	}
	return last
}

// depositor puts tokens into a key's lease, or gives them back to the
// store when they can no longer be spent (the leaser).
type depositor interface {
	deposit(e *entry, n int64, until, now mono)
	giveBack(e *entry, n int64)
}

// pacer releases future-dated grants into leases at the bucket's pace,
// one timer per reservation on the limiter's clock. Each pending
// reservation holds one unit of the background's work, so Close waits
// for its timer or cancels it.
type pacer struct {
	cfg   *config
	bg    *background.Group
	stats *counters
	into  depositor
}

// reserve holds a future-dated grant of n tokens of e under lim, whole at
// now+delay and spendable under a line ending at until (leaser.lifetime), and releases
// it into e's lease at lim's pace. Until a release the key rejects locally
// with the exact wait for it.
func (pc *pacer) reserve(e *entry, lim Limit, n int64, delay time.Duration, now, until mono) {
	if !pc.bg.Enter() {
		pc.into.giveBack(e, n)
		return
	}
	pc.stats.tokensReserved.Add(n)
	r := &reservation{n: n, end: now.add(delay), step: tokenStep(lim), until: until}
	rs := &e.extra().pace
	rs.mu.Lock()
	defer rs.mu.Unlock()
	rs.addLocked(r)
	// Scheduled under rs.mu: the callback takes rs.mu, so it cannot run
	// before r.timer is set (the delay is > 0, so it never runs inline).
	pc.armLocked(e, r, now)
}

// armLocked schedules the release of what r still holds at its end; the
// reservations' mu is held.
func (pc *pacer) armLocked(e *entry, r *reservation, now mono) {
	r.timer = pc.cfg.clk.AfterFunc(max(r.end.sub(now), 1), func() { pc.releaseDue(e, r) })
}

// releaseDue, r's timer at its end, deposits what no decision took and
// ends the reservation's background work; a timer that fired a little
// before the end is armed again, and one of a cancelled reservation
// (Close, eviction, policy change) only ends it.
func (pc *pacer) releaseDue(e *entry, r *reservation) {
	now := pc.cfg.now()
	rs := &e.extra().pace
	rs.mu.Lock()
	if !rs.hasLocked(r) {
		rs.mu.Unlock()
		pc.bg.Exit() // cancelled: cancel returned what was not delivered
		return
	}
	// Never below delivered: catchUp may have delivered with a later now
	// than this callback read before taking the lock, and going back would
	// deliver those tokens twice.
	due := max(r.dueBy(now), r.delivered)
	n := due - r.delivered
	r.delivered = due
	done := due >= r.n
	if done {
		rs.removeLocked(r)
	} else {
		pc.armLocked(e, r, now)
	}
	rs.publishLocked()
	rs.mu.Unlock()
	if n > 0 {
		pc.into.deposit(e, n, r.until, now)
	}
	if done {
		pc.bg.Exit()
	}
}

// catchUp releases what pending reservations owe at now, ahead of their
// timers: a caller told to come back at a release's time finds the
// tokens. A reservation it delivers whole it ends, stopping its timer
// (whose callback would run in a goroutine of its own), unless the timer
// already fired. It reports whether it deposited anything.
func (pc *pacer) catchUp(e *entry, now mono) bool {
	r := e.rare.Load()
	if r == nil {
		return false
	}
	if next := r.pace.next.Load(); next == 0 || now < next {
		return false
	}
	rs := &r.pace
	rs.mu.Lock()
	var n int64
	until := mono(math.MaxInt64)
	var buf [2]*reservation
	whole := buf[:0] // delivered whole now, their timers still armed
	for _, x := range rs.list {
		due := x.dueBy(now)
		if due > x.delivered {
			n += due - x.delivered
			until = min(until, x.until) // the earliest lifetime of those released
			if due >= x.n {
				whole = append(whole, x)
			}
		}
		x.delivered = max(due, x.delivered)
	}
	rs.publishLocked()
	var tbuf [2]clock.Timer
	timers := tbuf[:0]
	for _, x := range whole {
		timers = append(timers, x.timer) // read under mu, as cancel does
	}
	rs.mu.Unlock()
	if n > 0 {
		pc.into.deposit(e, n, until, now)
	}
	pc.end(rs, whole, timers)
	return n > 0
}

// end ends the reservations delivered whole whose timers it stops: no
// callback will run for them. A timer that fired already ends its own
// (releaseDue finds it delivered). Stopped outside rs.mu, as cancel does:
// a manual clock runs callbacks, which take rs.mu, under its own lock.
func (pc *pacer) end(rs *reservations, whole []*reservation, timers []clock.Timer) {
	for i, x := range whole {
		if !timers[i].Stop() {
			continue
		}
		rs.mu.Lock()
		rs.removeLocked(x)
		rs.publishLocked()
		rs.mu.Unlock()
		pc.bg.Exit()
	}
}

// spendDue spends n of e's tokens after releasing its reserved tokens
// now due, for a decision the lease alone could not serve: every path that
// spends a lease catches up first, the timers releasing only at a
// reservation's end. It reports false, spending nothing, when nothing was
// due or the lease still falls short.
func (ls *leaser) spendDue(e *entry, n int64, now mono) (ok bool, left int64) {
	if !ls.pace.catchUp(e, now) {
		return false, 0
	}
	return ls.spend(e, n, ls.cfg.spendAtNow(now))
}

// cancel cancels e's reservations and returns how many tokens they had
// not released.
func (pc *pacer) cancel(e *entry) int64 {
	r := e.rare.Load()
	if r == nil {
		return 0
	}
	rs := &r.pace
	rs.mu.Lock()
	list := rs.list
	rs.list = nil
	rs.publishLocked()
	timers := make([]clock.Timer, len(list))
	for i, x := range list {
		timers[i] = x.timer // read under mu: a firing callback re-arms it
	}
	rs.mu.Unlock()
	var n int64
	for i, x := range list {
		n += x.n - x.delivered
		if timers[i].Stop() {
			pc.bg.Exit() // no callback will run; a running one finds r gone and exits
		}
	}
	return n
}
