package inflight

import (
	"context"
	"time"

	"github.com/leasehold/leasehold/clock"
)

// The background work runs in timer callbacks on the limiter's clock
// (clock.AfterFunc): renewals every quarter of the term and, for tight
// keys holding spare slots, every spareCheck, so that they learn when
// others wait; give-backs a release left over, at once; forgetting idle
// keys; counting the fleet every heartbeat interval; reading the policy's
// record every poll interval and when a store reply names a newer
// version. On a manual clock (tests, the simulator) it all runs inside
// Advance, in virtual time, and a run replays exactly.

// start arms the background's timers, counting from New.
func (l *Limiter) start() {
	every := l.tickEvery()
	var sinceRenew time.Duration
	l.every(every, func() {
		sinceRenew += every
		all := sinceRenew >= l.cfg.term/4
		if all {
			sinceRenew = 0
		}
		l.renewAll(all)
	})
	l.every(heartbeatEvery, l.heartbeat)
	l.every(l.cfg.poll, l.reread) // an error: the next poll tries again
	l.soon(l.heartbeat)
	l.soon(l.reread)
}

func (l *Limiter) reread() { _ = l.refresh(context.Background()) }

// every runs f every d until Close; a run that starts before Close ends
// before Close returns.
func (l *Limiter) every(d time.Duration, f func()) {
	var t clock.Timer // set under timersMu before run can read it
	run := func() {
		if !l.enter() {
			return
		}
		defer l.wg.Done()
		f()
		l.timersMu.Lock()
		defer l.timersMu.Unlock()
		if !l.closed.Load() {
			t.Reset(d)
		}
	}
	l.timersMu.Lock()
	defer l.timersMu.Unlock()
	t = l.cfg.clk.AfterFunc(d, run)
	l.timers = append(l.timers, t)
}

// enter registers a background run, unless the limiter is closed.
func (l *Limiter) enter() bool {
	l.timersMu.Lock()
	defer l.timersMu.Unlock()
	if l.closed.Load() {
		return false
	}
	l.wg.Add(1)
	return true
}

// soon runs f once, in a timer callback a nanosecond from now (at the
// next Advance of a manual clock, never inside the caller, which may hold
// a key's lock), unless the limiter is closed by then.
func (l *Limiter) soon(f func()) {
	l.cfg.clk.AfterFunc(time.Nanosecond, func() {
		if !l.enter() {
			return
		}
		defer l.wg.Done()
		f()
	})
}

// stopBackground stops the timers and waits for runs under way.
func (l *Limiter) stopBackground() {
	l.timersMu.Lock()
	for _, t := range l.timers {
		t.Stop()
	}
	l.timersMu.Unlock()
	l.wg.Wait()
}

// drainKicks gives back what the releases queued in kick left over.
func (l *Limiter) drainKicks() {
	l.kicking.Store(false)
	for {
		select {
		case k := <-l.kick:
			k.queued.Store(false)
			l.adjust(k, k.renew.Swap(false))
		default:
			return
		}
	}
}

func (l *Limiter) tickEvery() time.Duration { return min(l.cfg.term/4, spareCheck) }

// spareCheck is how often a key holding spare slots asks the store
// whether others wait for them: a process that waits gets them within
// about that long.
const spareCheck = 250 * time.Millisecond

// heartbeatEvery is how often the fleet is counted; a member is counted
// for three intervals after its last beat.
const heartbeatEvery = time.Second

func (l *Limiter) heartbeat() {
	if l.fleet == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), l.cfg.timeout)
	defer cancel()
	if n, err := l.fleet.Heartbeat(ctx, l.cfg.prefix, l.name, l.holder, 3*heartbeatEvery); err == nil && n > 0 {
		l.size.Store(int64(n))
	}
}

// renewAll renews the holding of every key (all) or of tight keys holding
// spare slots, and then forgets keys idle for a quarter of the term with
// nothing held or in use.
func (l *Limiter) renewAll(all bool) {
	var keys []*slotKey
	for _, k := range l.keys.all() {
		if held, inUse := split(k.word.Load()); all || held > inUse && k.tight.Load() {
			keys = append(keys, k)
		}
	}
	for _, k := range keys {
		l.adjust(k, true)
	}
	if all {
		l.forgetIdle()
	}
}

// adjust sets k's holding at the store to what is in use plus its spare,
// or to nothing once k has been idle for a quarter of the term; renew also
// renews a holding that needs no change. Slots go back here before the
// store is told, so that in use never passes held. An answer that says
// others wait gives the spare back at once.
func (l *Limiter) adjust(k *slotKey, renew bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	for range 2 {
		held, inUse := split(k.word.Load())
		want := inUse + l.spare(k)
		if inUse == 0 && l.now()-mono(k.usedAt.Load()) > mono(l.cfg.term/4) {
			want = 0
		}
		if want >= held && (!renew || held == 0) {
			return
		}
		wasFull := k.full.Load()
		want = l.lower(k, want)
		ctx, cancel := context.WithTimeout(context.Background(), l.cfg.timeout)
		_, err := l.call(ctx, k, want)
		cancel()
		// A failure leaves the store counting more, which is safe.
		if err != nil || wasFull || !k.full.Load() {
			return
		}
		renew = false // others wait: give the spare back now
	}
}

// lower brings k's local holding down to want, or to what is in use if
// more; it returns the holding kept.
func (l *Limiter) lower(k *slotKey, want int64) int64 {
	for {
		w := k.word.Load()
		held, inUse := split(w)
		keep := max(want, inUse)
		if keep >= held {
			return held
		}
		if k.word.CompareAndSwap(w, pack(keep, inUse)) {
			return keep
		}
	}
}

// forgetIdle drops keys with nothing held or in use: a tombstone in their
// word turns away a caller that found the key just before, which then
// looks it up again.
func (l *Limiter) forgetIdle() {
	for _, k := range l.keys.all() {
		if !k.mu.TryLock() {
			continue // a store call is under way: not idle
		}
		if k.word.CompareAndSwap(0, tombstone) {
			l.keys.delete(k)
		}
		k.mu.Unlock()
	}
}

// tombstone marks a forgotten key: no acquire fits it.
const tombstone = uint64(1<<31 - 1)
