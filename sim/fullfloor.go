package main

import (
	"time"

	"github.com/leasehold/leasehold/hybrid"
)

// The full-bucket floor counts, on top of the idle floor, the admitted
// decisions that need a store call under any limiter that keeps the bound
// in every window and takes from the bucket only tokens it admits: those
// whose key's bucket, fed only the run's admissions at their times, stayed
// full for at least one token's refill (Period/Rate) since the process's
// last decision on the key.
//
// Why. Such a limiter keeps bucket + held ≤ Burst at every instant
// (otherwise the bucket could admit Burst + Rate·w to others in the
// window starting then, on top of what is held). Say process p admits at
// t2 from a token it took at its last call c ≤ t1 (its previous decision;
// no call since), and the admissions-fed bucket I was full throughout
// [s−δ, s] ⊂ (t1, t2) with Rate·δ ≥ 1. The store's bucket at s is
// Burst − max over u of (taken(u, s] − Rate·(s − u)). What was taken in
// (u, s] was admitted in (u, s] or is still held at s; I full at s gives
// admitted(u, s] ≤ Rate·(s − u), and I full since s − δ gives
// admitted(u, s] ≤ Rate·(s − u − δ) for u < s − δ. For u ≥ s − δ > c the
// held tokens taken in (u, s] exclude p's; for u < s − δ the slack is at
// least Rate·δ ≥ 1. Either way the store's bucket is at least
// Burst − held(s) + 1, so bucket + held > Burst: no such token exists,
// and the decision at t2 needs a call of p's in (t1, t2].
//
// A limiter that takes tokens it never admits (a lease that lapses
// unspent) can keep a bucket from filling and go under this floor, at the
// price of those tokens: on a key near its limit they are admissions lost.
// It is counted for a single token bucket only (no shaped policy, no regions).
type fullFloor struct {
	keys map[string]*idealBucket
}

// idealBucket is a key's bucket fed only the run's admissions.
type idealBucket struct {
	lim   hybrid.Limit
	level float64       // tokens at at
	at    time.Duration // the last admission
	// longFull is the last stretch the bucket stayed full for at least a
	// token's refill, ended by an admission (end < 0: none yet).
	longFrom, longEnd time.Duration
}

func newFullFloor() *fullFloor { return &fullFloor{keys: map[string]*idealBucket{}} }

func (f *fullFloor) bucket(key string, lim hybrid.Limit, now time.Duration) *idealBucket {
	b := f.keys[key]
	if b == nil || b.lim != lim {
		// A new key, or a new limit: nothing is known to have been full
		// before now.
		b = &idealBucket{lim: lim, level: float64(lim.Burst), at: now, longFrom: -1, longEnd: -1}
		f.keys[key] = b
	}
	return b
}

// fullAt is when the bucket, refilling from its last admission, is full
// again (at most at the last admission itself, if it was full).
func (b *idealBucket) fullAt() time.Duration {
	missing := float64(b.lim.Burst) - b.level
	if missing <= 0 {
		return b.at
	}
	return b.at + time.Duration(missing*float64(b.lim.Period)/float64(b.lim.Rate))
}

// needsCall reports whether an admission on key at now, whose process
// last decided on it at last, is at the full-bucket floor. Call it before
// admit.
func (f *fullFloor) needsCall(key string, lim hybrid.Limit, last, now time.Duration) bool {
	b := f.bucket(key, lim, now)
	step := lim.DurationFor(1)
	from := max(b.fullAt(), last) // full since, within (last, now)
	if now-from >= step {
		return true
	}
	return b.longEnd >= 0 && b.longEnd-max(b.longFrom, last) >= step
}

// admit takes n tokens from key's bucket at now.
func (f *fullFloor) admit(key string, lim hybrid.Limit, n int64, now time.Duration) {
	b := f.bucket(key, lim, now)
	if full := b.fullAt(); full <= now {
		if now-full >= lim.DurationFor(1) {
			b.longFrom, b.longEnd = full, now
		}
		b.level = float64(lim.Burst)
	} else {
		b.level += float64(lim.Rate) * float64(now-b.at) / float64(lim.Period)
	}
	b.level -= float64(n)
	b.at = now
}
