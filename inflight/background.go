package inflight

import (
	"context"
	"time"
)

// The background work runs in callbacks of the limiter's clock
// (internal/background, as hybrid's): renewals every quarter of the term
// and, for tight keys holding spare slots, every spareCheck, so that they
// learn when others wait; give-backs a release left over, at once;
// forgetting idle keys; counting the fleet every heartbeat interval;
// reading the policy's record every poll interval and when a store reply
// names a newer version. On a manual clock (tests, the simulator) it all
// runs inside Advance, in virtual time, and a run replays exactly.

// start arms the background's timers, counting from New.
func (l *Limiter) start() {
	every := l.tickEvery()
	var sinceRenew time.Duration
	l.bg.Tick(every, every, func() {
		sinceRenew += every
		all := sinceRenew >= l.cfg.term/4
		if all {
			sinceRenew = 0
		}
		l.renewAll(all)
	})
	l.bg.Tick(0, heartbeatEvery, l.heartbeat)
	l.bg.Tick(0, l.cfg.poll, l.reread) // an error: the next poll tries again
}

func (l *Limiter) reread() { _ = l.refresh(context.Background()) }

// soon runs f once, in a callback a nanosecond from now (at the next
// Advance of a manual clock, never inside the caller, which may hold a
// key's lock), unless the limiter is closed by then.
func (l *Limiter) soon(f func()) { l.bg.After(time.Nanosecond, f) }

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
