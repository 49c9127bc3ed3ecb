package hybrid

import (
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
type reservation struct {
	n         int64       // tokens granted
	delivered int64       // tokens deposited so far; under entry.mu
	end       mono        // when the last token becomes spendable
	step      int64       // ns per token, rounded down
	timer     clock.Timer // the next release; under entry.mu
}

// releaseLag keeps each release strictly after the store's µs-rounded
// conformance time.
const releaseLag = mono(time.Microsecond)

// minRelease is the shortest interval between two releases of one
// reservation: tokens due within it are released together, at the due time
// of the last of them (late, never early).
const minRelease = 2 * time.Millisecond

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

// nextRelease returns when the next release is due: the due time of the
// last token of the next chunk.
func (r *reservation) nextRelease() mono {
	chunk := max(int64(minRelease)/max(r.step, 1), 1)
	return r.at(min(r.delivered+chunk, r.n))
}

// tokenStep is the time the bucket takes per token under lim, rounded
// down to the nanosecond.
func tokenStep(lim Limit) int64 {
	return int64(lim.Period) / max(lim.Rate, 1)
}

// reserve holds a future-dated grant of n tokens, whole at now+delay, and
// releases it into e's lease at the bucket's pace. Until a release the key
// rejects locally with the exact wait for it.
func (ls *leaser) reserve(e *entry, n int64, delay time.Duration, now mono) {
	if !ls.bg.enter() {
		ls.giveBack(ls.returnItem(ls.policy.load(), e, n))
		return
	}
	ls.stats.tokensReserved.Add(n)
	r := &reservation{n: n, end: now.add(delay), step: tokenStep(ls.policy.load().tier(e).limits[0])}
	x := e.extra()
	e.mu.Lock()
	defer e.mu.Unlock()
	x.pending = append(x.pending, r)
	e.setPendingLocked()
	// Scheduled under e.mu: the callback takes e.mu, so it cannot run
	// before r.timer is set (the delay is > 0, so it never runs inline).
	ls.armLocked(e, r, now)
}

// armLocked schedules r's next release; e.mu is held.
func (ls *leaser) armLocked(e *entry, r *reservation, now mono) {
	r.timer = ls.cfg.clk.AfterFunc(time.Duration(max(r.nextRelease()-now, 1)), func() { ls.releaseDue(e, r) })
}

// releaseDue deposits r's tokens that are due and schedules the next
// release, or, once r is delivered or was cancelled (Close, eviction,
// policy change), ends the reservation's background work.
func (ls *leaser) releaseDue(e *entry, r *reservation) {
	now := ls.cfg.now()
	e.mu.Lock()
	if !e.hasPendingLocked(r) {
		e.mu.Unlock()
		ls.bg.exit() // cancelled: release returns what was not delivered
		return
	}
	due := r.dueBy(now)
	n := due - r.delivered
	r.delivered = due
	done := due >= r.n
	if done {
		e.removePendingLocked(r)
	} else {
		ls.armLocked(e, r, now)
	}
	e.setPendingLocked()
	e.mu.Unlock()
	if n > 0 {
		ls.deposit(e, n, now)
	}
	if done {
		ls.bg.exit()
	}
}

func (e *entry) hasPendingLocked(r *reservation) bool {
	for _, x := range e.extra().pending {
		if x == r {
			return true
		}
	}
	return false
}

// removePendingLocked drops r from the pending list.
func (e *entry) removePendingLocked(r *reservation) {
	x := e.extra()
	for i, p := range x.pending {
		if p == r {
			x.pending = append(x.pending[:i], x.pending[i+1:]...)
			return
		}
	}
}

// setPendingLocked publishes, for lock-free readers (decisions, refills,
// Stats), when the pending reservations next release tokens and how many
// they still hold.
func (e *entry) setPendingLocked() {
	x := e.extra()
	var next mono
	var n int64
	for _, r := range x.pending {
		if at := r.at(r.delivered + 1); next == 0 || at < next {
			next = at
		}
		n += r.n - r.delivered
	}
	x.pendingUntil.Store(next)
	x.reserved.Store(n)
}
