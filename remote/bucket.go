package remote

import (
	"time"

	"github.com/leasehold/leasehold/internal/exact"
)

// maxDebt bounds how far below zero a bucket may go, so every value stays
// exact in a double.
const maxDebt = int64(1) << 51

// state is one bucket, exactly as the Lua script keeps it (see scripts.go
// for the meaning of each field). MemoryStore runs this Go twin of the
// script; the conformance suite holds the two to the same answers.
type state struct {
	level   int64  // whole tokens; negative while reservations or debt are out
	carry   int64  // refill progress toward the next token, in [0, per)
	last    micros // store time when level was computed
	version uint64
	burst   int64
	rate    int64 // tokens every per µs, lowest terms
	per     int64
}

// idiv is floor division with a non-negative remainder, for b > 0.
func idiv(a, b int64) (q, r int64) {
	q, r = a/b, a%b
	if r < 0 {
		q--
		r += b
	}
	return q, r
}

func cdiv(a, b int64) int64 {
	q, r := idiv(a, b)
	if r > 0 {
		q++
	}
	return q
}

// waitFor returns the µs until the level rises from `from` to `to`.
func (s *state) waitFor(from, to int64) int64 {
	if to <= from {
		return 0
	}
	q, r := idiv(to-from, s.rate)
	return q*s.per + cdiv(r*s.per-s.carry, s.rate)
}

func (s *state) refill(now micros) {
	if now <= s.last {
		return // same µs, or the store clock stepped back: wait for it
	}
	elapsed := now.since(s.last)
	s.last = now
	if s.level >= s.burst {
		s.carry = 0
		return
	}
	need := s.burst - s.level
	q, r := idiv(elapsed, s.per)
	if q >= cdiv(need, s.rate) {
		s.level, s.carry = s.burst, 0
		return
	}
	t, c := idiv(r*s.rate+s.carry, s.per)
	s.level += q*s.rate + t
	s.carry = c
	if s.level >= s.burst {
		s.level, s.carry = s.burst, 0
	}
}

// apply runs op on the bucket at store time now (µs) and returns the new
// state and the reply. It mirrors bucketLua step for step.
func apply(st state, exists bool, op Op, r *Request, m exact.Micros, now micros) (state, Result) {
	stale := false
	if !exists {
		st = state{level: m.Burst, last: now, version: r.Version, burst: m.Burst, rate: m.Rate, per: m.Per}
	} else if st.version > r.Version {
		stale = true
		st.refill(now)
	} else if st.version < r.Version || st.burst != m.Burst || st.rate != m.Rate || st.per != m.Per {
		st.refill(now)
		if st.level >= 0 {
			used := min(st.burst-st.level, m.Burst)
			st.level = m.Burst - used
		}
		st.carry, st.version, st.burst, st.rate, st.per = 0, r.Version, m.Burst, m.Rate, m.Per
	} else {
		st.refill(now)
	}

	var granted, delay, retry int64
	switch op {
	case OpLease:
		if !stale {
			granted, delay, retry = st.lease(r)
		}
		st.level -= granted
	case OpReturn:
		st.level = min(st.level+r.N, st.burst)
		if st.level >= st.burst {
			st.carry = 0
		}
	case OpDebit:
		st.level = max(st.level-r.N, -maxDebt)
	}
	reset := st.waitFor(st.level, st.burst)
	return st, Result{
		Granted:    granted,
		Delay:      time.Duration(delay) * time.Microsecond,
		Remaining:  max(st.level, 0),
		RetryAfter: time.Duration(retry) * time.Microsecond,
		ResetAfter: time.Duration(reset) * time.Microsecond,
		Now:        time.UnixMicro(int64(now)),
		Version:    st.version,
		Stale:      stale,
		Created:    !exists,
	}
}

// lease decides a lease on the refilled bucket: n if there, else the level
// if at least min, else n future-dated within maxdelay, else the level if
// it covers need, else need future-dated, else a refusal with the wait for
// need (all in µs). The lease branch of bucketLua.
func (st *state) lease(r *Request) (granted, delay, retry int64) {
	switch {
	case st.level >= r.N:
		return r.N, 0, 0
	case st.level >= r.Min:
		return st.level, 0, 0
	}
	d := st.waitFor(st.level-r.N, 0)
	dNeed := st.waitFor(st.level-r.Need, 0)
	maxDelay := int64(r.MaxDelay / time.Microsecond)
	switch {
	case maxDelay > 0 && d <= maxDelay:
		return r.N, d, 0
	case st.level >= r.Need:
		return st.level, 0, 0
	case maxDelay > 0 && dNeed <= maxDelay:
		return r.Need, dNeed, 0
	}
	return 0, 0, dNeed
}

// ttl is how long a bucket key lives after a write: time to full plus a
// margin, after which its absence means the same thing (a full bucket).
func ttl(reset time.Duration) time.Duration {
	return reset.Round(time.Millisecond) + TTLMargin
}

// TTLMargin is how long a bucket key outlives its time to full: a bucket
// missing well before then was removed by someone else.
const TTLMargin = time.Second

// micros is a time on the store's clock (Redis TIME, or the MemoryStore's
// clock): microseconds since the Unix epoch. Durations in the arithmetic
// stay plain int64 microseconds; an instant is a micros, so passing a
// duration, or a process clock's nanoseconds, where an instant is wanted
// needs a conversion that shows.
type micros int64

// plus returns t moved by d microseconds.
func (t micros) plus(d int64) micros { return t + micros(d) }

// since returns the microseconds from u to t.
func (t micros) since(u micros) int64 { return int64(t - u) }
