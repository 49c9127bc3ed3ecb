package hybrid

import (
	"container/heap"
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
// what no decision took, after the grant ends, by one timer per limiter
// (see pacer). A timer per reservation, or per release, ran in a
// goroutine of its own each time (AfterFunc): nearly all the goroutines a
// cold Zipf benchmark started.
type reservation struct {
	n         int64 // tokens granted
	delivered int64 // tokens deposited so far; under reservations.mu
	end       mono  // when the last token becomes spendable
	step      int64 // ns per token, rounded down
	until     mono  // when its tokens stop being spendable (a stock record's term, leaser.stockUntil)
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
	if k == 1 {
		// The common case, a decision of one token on an empty lease (a
		// key at its limit): the earliest next release, with no slice.
		var first, last mono
		for _, r := range rs.list {
			last = max(last, r.end)
			if at := r.at(r.delivered + 1); r.delivered < r.n && (first == 0 || at < first) {
				first = at
			}
		}
		if first == 0 {
			return last + mono(rs.list[len(rs.list)-1].step)
		}
		return first
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
	deposit(e *account, n int64, until, now mono)
	giveBack(e *account, n int64)
}

// pacer releases future-dated grants into leases at the bucket's pace.
// Decisions release what they find due (catchUp); what no decision took
// is released once its reservation has ended, by one timer for every
// key, armed at the earliest end but at most once per paceTick. Each
// pending reservation holds one unit of the background's work, ended by
// whoever takes it off its key's list (its release, a decision that took
// it whole, or cancel), so Close waits for none of them to fire.
type pacer struct {
	cfg   *config
	bg    *background.Group
	stats *counters
	into  depositor

	mu      sync.Mutex
	ends    endQueue    // reservations by end; some already taken off their list
	timer   clock.Timer // armed for ends[0]; nil when none is
	armed   mono        // when timer fires
	fired   mono        // when it last fired
	stopped bool        // by Close
}

// paceTick is the least time between two runs of the pacer's timer. What
// it releases only ever waits for a decision's catchUp, which takes due
// tokens itself, so being this late changes no decision; it bounds the
// goroutines the timer starts (each run is one) to 100 a second.
const paceTick = 10 * time.Millisecond

// pending is a reservation waiting for its end, with its key's account.
type pending struct {
	e *account
	r *reservation
}

// endQueue is a min-heap of pending reservations by end.
type endQueue []pending

func (q endQueue) Len() int           { return len(q) }
func (q endQueue) Less(i, j int) bool { return q[i].r.end < q[j].r.end }
func (q endQueue) Swap(i, j int)      { q[i], q[j] = q[j], q[i] }
func (q *endQueue) Push(x any)        { *q = append(*q, x.(pending)) }
func (q *endQueue) Pop() any {
	old := *q
	x := old[len(old)-1]
	old[len(old)-1] = pending{}
	*q = old[:len(old)-1]
	return x
}

// reserve holds a future-dated grant of n tokens of e under lim, whole at
// now+delay and spendable until until (leaser.stockUntil; never, for a
// plain lease, which the sweep gives back), and releases
// it into e's lease at lim's pace. Until a release the key rejects locally
// with the exact wait for it.
func (pc *pacer) reserve(e *account, lim Limit, n int64, delay time.Duration, now, until mono) {
	if !pc.bg.Enter() {
		pc.into.giveBack(e, n)
		return
	}
	pc.stats.tokensReserved.Add(n)
	r := &reservation{n: n, end: now.add(delay), step: tokenStep(lim), until: until}
	rs := &e.extra().pace
	rs.mu.Lock()
	rs.addLocked(r)
	rs.mu.Unlock()
	pc.wait(pending{e, r}, now)
}

// wait queues p for the timer, arming it earlier if p ends first; after
// stop it cancels p.
func (pc *pacer) wait(p pending, now mono) {
	pc.mu.Lock()
	if pc.stopped {
		pc.mu.Unlock()
		pc.drop(p)
		return
	}
	defer pc.mu.Unlock()
	heap.Push(&pc.ends, p)
	if pc.timer == nil || p.r.end < pc.armed && pc.armed > pc.fired+mono(paceTick) {
		pc.armLocked(now)
	}
}

// armLocked arms the timer for the earliest end, no sooner than paceTick
// after it last fired; pc.mu is held. A manual clock runs a due callback
// inside Advance, never inside AfterFunc, so it cannot run under pc.mu.
func (pc *pacer) armLocked(now mono) {
	if pc.timer != nil && !pc.timer.Stop() {
		return // firing now: it arms again when done
	}
	pc.timer = nil
	if len(pc.ends) == 0 {
		return
	}
	at := max(pc.ends[0].r.end, pc.fired+mono(paceTick), now+1)
	if t := pc.bg.After(at.sub(now), pc.fire); t != nil {
		pc.timer, pc.armed = t, at
	}
}

// fire releases what the reservations that have ended still hold, and
// arms the timer for the next end.
func (pc *pacer) fire() {
	now := pc.cfg.now()
	pc.mu.Lock()
	pc.timer, pc.fired = nil, now
	var buf [16]pending
	due := buf[:0]
	for len(pc.ends) > 0 && pc.ends[0].r.end <= now {
		due = append(due, heap.Pop(&pc.ends).(pending))
	}
	pc.mu.Unlock()
	for _, p := range due {
		pc.releaseDue(p, now)
	}
	pc.mu.Lock()
	if pc.timer == nil && !pc.stopped {
		pc.armLocked(pc.cfg.now())
	}
	pc.mu.Unlock()
}

// stop stops the timer and cancels what is still queued (Close, after
// cancelling every key's reservations: a flight that ended meanwhile may
// have queued more).
func (pc *pacer) stop() {
	pc.mu.Lock()
	pc.stopped = true
	if pc.timer != nil && pc.timer.Stop() {
		pc.timer = nil
	}
	ends := pc.ends
	pc.ends = nil
	pc.mu.Unlock()
	for _, p := range ends {
		pc.drop(p)
	}
}

// drop cancels p's reservation, if still on its key's list, giving back
// what it had not released.
func (pc *pacer) drop(p pending) {
	if left, ok := pc.unlist(p); ok {
		pc.into.giveBack(p.e, left)
		pc.bg.Exit()
	}
}

// releaseDue deposits what p's reservation, ended by now, still holds
// and ends it, unless it was taken off its key's list already (delivered
// whole, or cancelled: whoever took it off ended it).
func (pc *pacer) releaseDue(p pending, now mono) {
	if left, ok := pc.unlist(p); ok {
		if left > 0 {
			pc.into.deposit(p.e, left, p.r.until, now)
		}
		pc.bg.Exit()
	}
}

// unlist takes p's reservation off its key's list and returns what it had
// not released (catchUp may have delivered part, never all: it takes a
// reservation it delivers whole off the list itself); false when it was
// no longer listed.
func (pc *pacer) unlist(p pending) (left int64, ok bool) {
	rs := &p.e.extra().pace
	rs.mu.Lock()
	defer rs.mu.Unlock()
	if !rs.hasLocked(p.r) {
		return 0, false
	}
	rs.removeLocked(p.r)
	rs.publishLocked()
	left = p.r.n - p.r.delivered
	p.r.delivered = p.r.n
	return left, true
}

// catchUp releases what pending reservations owe at now, ahead of the
// timer: a caller told to come back at a release's time finds the
// tokens. A reservation it delivers whole it ends. It reports whether it
// deposited anything.
func (pc *pacer) catchUp(e *account, now mono) bool {
	r := e.rare.Load()
	if r == nil {
		return false
	}
	if next := r.pace.next.Load(); next == 0 || now < next {
		return false
	}
	rs := &r.pace
	rs.mu.Lock()
	var n, ended int64
	until := mono(math.MaxInt64)
	rs.list = slices.DeleteFunc(rs.list, func(x *reservation) bool {
		due := x.dueBy(now)
		if due > x.delivered {
			n += due - x.delivered
			until = min(until, x.until) // the earliest end of those released
			x.delivered = due
		}
		if x.delivered >= x.n {
			ended++
			return true
		}
		return false
	})
	rs.publishLocked()
	rs.mu.Unlock()
	if n > 0 {
		pc.into.deposit(e, n, until, now)
	}
	for range ended {
		pc.bg.Exit()
	}
	return n > 0
}

// spendDue spends n of e's tokens after releasing its reserved tokens
// now due, for a decision the lease alone could not serve: every path that
// spends a lease catches up first, the pacer's timer releasing only after
// a reservation's end. It reports false, spending nothing, when nothing was
// due or the lease still falls short.
func (ls *leaser) spendDue(e *account, n int64, now mono) (ok bool, left int64) {
	if !ls.pace.catchUp(e, now) {
		return false, 0
	}
	return ls.spend(e, n, ls.cfg.spendAtNow(now))
}

// cancel cancels e's reservations and returns how many tokens they had
// not released. The timer finds them gone.
func (pc *pacer) cancel(e *account) int64 {
	r := e.rare.Load()
	if r == nil {
		return 0
	}
	rs := &r.pace
	rs.mu.Lock()
	list := rs.list
	rs.list = nil
	rs.publishLocked()
	rs.mu.Unlock()
	var n int64
	for _, x := range list {
		n += x.n - x.delivered
		pc.bg.Exit()
	}
	return n
}
