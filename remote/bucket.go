package remote

import (
	"cmp"
	"slices"
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
	// The capacity grants (the script keeps them in their own key), by
	// expiry, and the part of the carry below per while they live: the
	// carry then counts in per·grantUnits units (see refill).
	grants []grantRec
	gfrac  int64
	// born is the store time the bucket was made (0: made before spill
	// marks), spill the refill it lost at its cap that no debit has
	// claimed yet (see SpillMark).
	born  micros
	spill int64
	// owed is the part of a negative level that debits charged (the rest
	// is future-dated tokens): while more than Burst/8 is out, no grant
	// gets more than half its allocation, so the bucket refills and is
	// paid (a smaller debt, such as a few decisions a slow call made by
	// the share, is paid by what the grants leave).
	owed int64
}

// grantRec is one live capacity grant, as the script keeps it.
type grantRec struct {
	holder string
	share  int64  // units of rate/grantUnits the bucket counts
	burst  int64  // taken from the level when the grant began
	exp    micros // store time the grant ends
	want   int64  // the holder's last want, for the division; 0: no grant
	stock  int64  // tokens the holder may still hold (Request.Stock)
	seq    int64  // the number of the holder's last lease
}

// gsum returns the records' total share, and their bursts and stock,
// which the bucket's cap leaves out.
func (s *state) gsum() (share, burst int64) {
	for _, g := range s.grants {
		share += g.share
		burst += g.burst + g.stock
	}
	return share, burst
}

// flows counts the records of capacity grants (a holder with a want).
func (s *state) flows() int {
	c := 0
	for _, g := range s.grants {
		if g.want > 0 {
			c++
		}
	}
	return c
}

// clamp keeps the level within the cap the records leave.
func (s *state) clamp() { s.giveBack(0) }

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

// waitFor returns the µs until the level rises from `from` to `to` at the
// bucket's full rate.
func (s *state) waitFor(from, to int64) int64 {
	if to <= from {
		return 0
	}
	q, r := idiv(to-from, s.rate)
	return q*s.per + cdiv(r*s.per-s.carry, s.rate)
}

// netWait is waitFor at the rate the live grants leave, as if they stay;
// -1 when they leave nothing.
func (s *state) netWait(from, to int64) int64 {
	if len(s.grants) == 0 {
		return s.waitFor(from, to)
	}
	if to <= from {
		return 0
	}
	sh, _ := s.gsum()
	r, p := s.rate*(grantUnits-sh), s.per*grantUnits
	if r <= 0 {
		return -1
	}
	q, rm := idiv(to-from, r)
	return q*p + cdiv(rm*p-(s.carry*grantUnits+s.gfrac), r)
}

// seg refills elapsed µs at r tokens every p µs up to limit from carry c
// and returns the new carry; what the limit cuts off is spilled.
func (s *state) seg(elapsed, r, p, limit, c int64) int64 {
	if r <= 0 {
		if s.level >= limit {
			return 0
		}
		return c
	}
	q, rm := idiv(elapsed, p)
	t, c2 := idiv(rm*r+c, p)
	var tokens int64
	if q > (maxDebt-t)/r {
		tokens = maxDebt // more than any debit claims
	} else {
		tokens = q*r + t
	}
	if s.level >= limit {
		s.spill = min(s.spill+tokens, maxDebt)
		return 0
	}
	if tokens >= limit-s.level {
		s.spill = min(s.spill+tokens-(limit-s.level), maxDebt)
		s.level = limit
		return 0
	}
	s.level += tokens
	return c2
}

// refill brings the level to now: at the full rate without grants, else
// piecewise between grant expiries at the rate and up to the cap the live
// grants leave, each expired grant dropped at its expiry.
func (s *state) refill(now micros) {
	if now <= s.last {
		return // same µs, or the store clock stepped back: wait for it
	}
	if len(s.grants) == 0 {
		s.carry = s.seg(now.since(s.last), s.rate, s.per, s.burst, s.carry)
		s.last = now
		return
	}
	c := s.carry*grantUnits + s.gfrac
	for len(s.grants) > 0 {
		sh, b := s.gsum()
		stop := min(now, s.grants[0].exp)
		if stop > s.last {
			c = s.seg(stop.since(s.last), s.rate*(grantUnits-sh), s.per*grantUnits, s.burst-b, c)
			s.last = stop
		}
		if s.grants[0].exp > now {
			break
		}
		s.grants = s.grants[1:]
	}
	s.carry, s.gfrac = idiv(c, grantUnits)
	if len(s.grants) == 0 {
		s.gfrac = 0
		if now > s.last {
			s.carry = s.seg(now.since(s.last), s.rate, s.per, s.burst, s.carry)
		}
	}
	s.last = now
}

// apply runs op on the bucket at store time now (µs) and returns the new
// state and the reply. It mirrors bucketLua step for step.
func apply(st state, exists bool, op Op, r *Request, m exact.Micros, now micros) (state, Result) {
	st.grants = slices.Clone(st.grants)
	stale := st.bring(exists, r, m, now)
	st.owed = min(st.owed, max(-st.level, 0))
	var granted, delay, retry int64
	var held bool
	switch op {
	case OpLease:
		granted, delay, retry, held = st.leaseHeld(r, stale, now)
	case OpReturn:
		if r.Stock.Holder != "" {
			st.returnHeld(r)
			break
		}
		st.giveBack(r.N)
	case OpDebit:
		c := st.charge(r)
		st.level = max(st.level-c, -maxDebt)
		if r.Mark.Born != 0 && r.Mark.Born == int64(st.born) {
			// Only a debit that names the bucket's mark owes a payback:
			// one without is charged its unpaid part, as before.
			st.owed = min(st.owed+c, max(-st.level, 0))
		}
	case opGrant:
		if !stale {
			granted, delay, retry = st.grant(r, now)
		}
	case opUngrant:
		st.ungrant(r)
	}
	st.grants = slices.DeleteFunc(st.grants, func(g grantRec) bool {
		return g.share == 0 && g.burst == 0 && g.want == 0 && g.stock == 0
	})
	reset := st.resetAfter(now)
	holders := st.flows()
	if len(st.grants) == 0 {
		st.grants, st.gfrac = nil, 0 // the script deletes the grants key
	}
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
		Holders:    holders,
		Mark:       SpillMark{Born: int64(st.born), Spill: st.spill},
		Held:       held,
	}
}

// leaseHeld decides a lease r on the refilled bucket, under its holder's
// record when it names one (see Stock): a late call grants nothing, and
// past the records the bucket keeps a lease grants at most Need and
// reports held false. The lease branch of bucketLua.
func (st *state) leaseHeld(r *Request, stale bool, now micros) (granted, delay, retry int64, held bool) {
	rr, mine, late := *r, -1, false
	if h := r.Stock.Holder; h != "" {
		mine = st.find(h)
		late = mine >= 0 && r.Stock.Seq <= st.grants[mine].seq
		held = mine >= 0 || int64(len(st.grants)) < r.Stock.maxRecords()
		if !held {
			rr.N, rr.Min, rr.MaxDelay = rr.Need, rr.Need, 0
		}
	}
	if !stale && !late {
		granted, delay, retry = st.lease(&rr, now)
	}
	st.level -= granted
	if held && !stale && !late {
		st.record(r, mine, granted, delay, now)
	}
	return granted, delay, retry, held && !late && !stale
}

// returnHeld gives r.N tokens back, up to the cap, for r's holder: off
// its record when r names the record's lease, or all of it for a
// release no later lease overtook.
func (st *state) returnHeld(r *Request) {
	switch i := st.find(r.Stock.Holder); {
	case i < 0:
	case r.Stock.Release:
		if st.grants[i].seq <= r.Stock.Seq {
			st.grants[i].stock = 0
		}
	case st.grants[i].seq == r.Stock.Seq:
		st.grants[i].stock = max(st.grants[i].stock-r.N, 0)
	}
	st.giveBack(r.N)
}

// record counts a lease's granted tokens, future-dated by delay, under
// r's holder record (index mine, -1: a new one): Keep plus granted, less
// what the holder spends at once, until the term. The stock branch of
// bucketLua's lease.
func (st *state) record(r *Request, mine int, granted, delay int64, now micros) {
	if mine < 0 {
		st.grants = append(st.grants, grantRec{holder: r.Stock.Holder})
		mine = len(st.grants) - 1
	}
	x := &st.grants[mine]
	x.stock, x.seq = r.Stock.Keep+granted, r.Stock.Seq
	if delay == 0 {
		x.stock -= min(granted, r.Stock.Spend)
	}
	if end := now.plus(delay + r.Stock.Term.Microseconds()); x.stock > 0 && end > x.exp {
		x.exp = end
	}
	slices.SortStableFunc(st.grants, func(a, b grantRec) int { return cmp.Compare(a.exp, b.exp) })
	st.clamp()
}

// charge is what a debit r costs the bucket: with a mark of this bucket,
// every token r spent less what the bucket spilled since the mark (that
// spill is then claimed, so no other debit claims it again); else r.N.
func (st *state) charge(r *Request) int64 {
	if r.Mark.Born == 0 || r.Mark.Born != int64(st.born) || r.Spent <= 0 {
		return r.N
	}
	forgiven := min(r.Spent, max(st.spill-r.Mark.Spill, 0))
	st.spill -= forgiven
	return r.Spent - forgiven
}

// bring brings the bucket to now under r's limit m: a full bucket when
// it did not exist, a refill, and a rescale when the limit changed. It
// reports a request older than the bucket's version.
func (st *state) bring(exists bool, r *Request, m exact.Micros, now micros) (stale bool) {
	switch {
	case !exists:
		// Redis keeps grants in a key of their own, which outlives the
		// bucket only if someone evicted the bucket: here both go together.
		*st = state{level: m.Burst, last: now, version: r.Version, burst: m.Burst, rate: m.Rate, per: m.Per, born: now}
	case st.version > r.Version:
		st.refill(now)
		return true
	case st.version < r.Version || st.burst != m.Burst || st.rate != m.Rate || st.per != m.Per:
		st.refill(now)
		// A new limit ends every grant; stock still held stays counted.
		st.grants = slices.DeleteFunc(st.grants, func(g grantRec) bool { return g.stock == 0 })
		for i := range st.grants {
			st.grants[i].share, st.grants[i].burst, st.grants[i].want = 0, 0, 0
		}
		st.gfrac = 0
		if st.level >= 0 {
			used := min(st.burst-st.level, m.Burst)
			st.level = m.Burst - used
		}
		st.carry, st.version, st.burst, st.rate, st.per = 0, r.Version, m.Burst, m.Rate, m.Per
		st.clamp()
	default:
		st.refill(now)
	}
	return false
}

// ungrant ends r's holder's grant: the unspent part of its burst (r.N)
// comes back to the level.
func (st *state) ungrant(r *Request) {
	if i := st.find(r.grant.holder); i >= 0 {
		// Its stock, if any, stays counted until reported or its term.
		st.level += min(r.N, st.grants[i].burst)
		g := &st.grants[i]
		g.share, g.burst, g.want = 0, 0, 0
	}
	st.giveBack(0)
}

// resetAfter is how long until the bucket is full (µs) and every grant
// has expired: absent means full, and full is only true once the grants
// are gone, so the bucket outlives every grant.
func (st *state) resetAfter(now micros) int64 {
	maxExp := now
	for _, g := range st.grants {
		maxExp = max(maxExp, g.exp)
	}
	return st.waitFor(st.level, st.burst) + maxExp.since(now)
}

// giveBack adds n to the level, up to the cap the grants leave.
func (st *state) giveBack(n int64) {
	_, b := st.gsum()
	st.level += n
	if st.level >= st.burst-b {
		st.level, st.carry, st.gfrac = st.burst-b, 0, 0
	}
}

// find returns the index of holder's grant, or -1.
func (st *state) find(holder string) int {
	return slices.IndexFunc(st.grants, func(g grantRec) bool { return g.holder == holder })
}

// grant creates or renews r's holder's grant on the refilled bucket and
// returns the share offered, the grant's burst and the tokens it took from
// the level for the holder (all 0: no grant). The grant branch of
// bucketLua.
func (st *state) grant(r *Request, now micros) (share, burst, tokens int64) {
	g := r.grant
	mine := st.find(g.holder)
	if st.rate > maxGrantRatePer/st.per || ((mine < 0 || st.grants[mine].want == 0) && int64(st.flows()) >= g.maxHolders) {
		return 0, 0, 0
	}
	sh, b := st.gsum()
	want := r.N
	wants := []int64{want}
	sum := want
	for i, x := range st.grants {
		if i != mine && x.want > 0 {
			wants = append(wants, x.want)
			sum += x.want
		}
	}
	alloc := want
	if sum > grantUnits {
		// Proportional share (Doorman), as bucketLua computes it.
		e := grantUnits / int64(len(wants))
		if want > e {
			spare, excess := int64(grantUnits), int64(0)
			for _, w := range wants {
				if w <= e {
					spare -= w
				} else {
					spare -= e
					excess += w - e
				}
			}
			alloc = e + spare*(want-e)/excess
		}
	}
	if mine < 0 {
		// Kept without a share, so that its want counts when others renew.
		st.grants = append(st.grants, grantRec{holder: g.holder})
		mine = len(st.grants) - 1
	}
	x := &st.grants[mine]
	offer := min(alloc, grantUnits-(sh-x.share))
	if base := min(g.running, x.share); offer > base && st.level < 0 {
		offer = base // no rise while future-dated tokens or debt are out
	}
	if half := alloc / 2; offer > half && st.owed > st.burst/8 {
		offer = half // half the rate goes to paying a debt
	}
	counted := max(offer, min(g.running, x.share))
	tokens = st.fitBurst(x, g.burst, b)
	if x.burst < 1 {
		offer, counted = 0, 0 // no burst left to give: a share could not be spent
	}
	x.share, x.exp, x.want = counted, max(x.exp, now.plus(g.term)), want
	burst = x.burst
	slices.SortStableFunc(st.grants, func(a, b grantRec) int { return cmp.Compare(a.exp, b.exp) })
	return offer, burst, tokens
}

// fitBurst sets x's local burst to want as far as the grants' bursts (b,
// x's included) leave room, and returns the tokens a growth takes from
// the level for the holder. A holder asking less than it has gave the rest
// up before it asked (see GrantRequest.Burst): the room is the bucket's
// again.
func (st *state) fitBurst(x *grantRec, want, b int64) (tokens int64) {
	if want > 0 && want < x.burst {
		b -= x.burst - want
		x.burst = want
	}
	if grow := min(want-x.burst, st.burst-b); grow > 0 {
		tokens = min(grow, max(st.level, 0))
		st.level -= tokens
		x.burst += grow
	}
	return tokens
}

// lease decides a lease on the refilled bucket: n if there, else the level
// if at least min, else n future-dated within maxdelay, else the level if
// it covers need, else need future-dated, else a refusal with the wait for
// need (all in µs). The lease branch of bucketLua.
func (st *state) lease(r *Request, now micros) (granted, delay, retry int64) {
	switch {
	case st.level >= r.N:
		return r.N, 0, 0
	case st.level >= r.Min:
		return st.level, 0, 0
	}
	d := st.netWait(st.level-r.N, 0)
	dNeed := st.netWait(st.level-r.Need, 0)
	maxDelay := int64(r.MaxDelay / time.Microsecond)
	switch {
	case maxDelay > 0 && d >= 0 && d <= maxDelay:
		return r.N, d, 0
	case st.level >= r.Need:
		return st.level, 0, 0
	case maxDelay > 0 && dNeed >= 0 && dNeed <= maxDelay:
		return r.Need, dNeed, 0
	case dNeed >= 0:
		return 0, 0, dNeed
	}
	return 0, 0, min(st.grants[0].exp.since(now), grantRetry.Microseconds())
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
