package tiered

import (
	"github.com/leasehold/leasehold/internal/errs"
	"time"

	"github.com/leasehold/leasehold/remote"
)

// micros is a time or duration of the region store's clock (Redis TIME,
// or a MemoryStore's clock), in microseconds: the only clock a pool's
// record knows. Process clocks never enter it.
type micros int64

func (m micros) duration() time.Duration { return time.Duration(m) * time.Microsecond }

func microsOf(d time.Duration) micros { return micros(d / time.Microsecond) }

// A pool is a region's share of a global bucket, kept in the region's own
// store: tokens that the parent store granted and no process of the region
// has leased yet. Unlike a bucket it never refills by itself, so every
// token a process takes from it was granted by the parent. One record per
// bucket, under the bucket's hash tag (keys.Pool); poolLua keeps it in
// Redis and the apply methods below, its Go twin, in a MemoryStore.
type poolState struct {
	level int64  // tokens held
	exp   micros // bucket pools: tokens go back to the parent after; window pools: tokens lapse
	claim micros // until then a refill is in flight
	down  micros // when the parent last failed; 0 once it answers again
	ver   uint64 // the parent bucket's policy version at the last refill
	rem   int64  // the parent bucket's Remaining at the last refill
	full  micros // bucket pools: when the parent bucket is full, as of the last refill
	since micros // window pools: the parent's time of the grant held (0: none)
	used  int64  // tokens taken since the last refill
	at    micros // time of the last refill

	// A grant pool (WithCapacityLeases) holds a capacity grant from the
	// parent and refills itself at the grant's rate, up to the grant's
	// burst, until a margin before the parent's expiry (see accrue).
	gper  int64  // 1/1024 µs per token at the grant's rate; 0: nothing accrues
	gat   micros // accrued up to gat + gfrac/1024 µs
	gfrac int64
	gexp  micros // accrual stops
	gcap  int64  // the grant's burst: accrual stops at this level
	share int64  // the share held, in units of Rate/remote.GrantUnits
	renew micros // non-zero: a grant pool, its next grant call due then
	asks  int64  // grant calls answered since the grant began
	seen  micros // time of the last take
	bat   int64  // of level, tokens of batches and give-backs, spent last: they do not stop the accrual
}

// fracUnits is how finely a grant pool counts time: gper and gfrac are in
// 1/fracUnits µs, so a fast grant's rate rounds down by at most one part
// in fracUnits·(µs per token).
const fracUnits = 1024

// accrue refills a grant pool at its grant's rate up to now (or the
// grant's end), its grant's tokens capped at the grant's burst (a GCRA at
// the grant's rate and burst); tokens of batches and give-backs (bat)
// come on top. Every step is integer arithmetic on numbers
// below 2^53, as in poolLua.
func (st *poolState) accrue(now micros) {
	if st.gper <= 0 {
		return
	}
	end := min(now, st.gexp)
	if end <= st.gat {
		return
	}
	elapsed := int64(end-st.gat)*fracUnits - st.gfrac
	k := elapsed / st.gper
	if g := st.level - st.bat; g+k >= st.gcap {
		st.level = st.bat + max(g, st.gcap)
		st.gat, st.gfrac = end, 0
		return
	}
	adv := k*st.gper + st.gfrac
	st.level += k
	st.gat += micros(adv / fracUnits)
	st.gfrac = adv % fracUnits
}

// live reports whether a grant pool's grant accrues at now.
func (st *poolState) live(now micros) bool { return st.gper > 0 && now < st.gexp }

// poolReply is the record after an operation, and what it took out.
type poolReply struct {
	granted int64  // take: tokens granted; put, drain: tokens taken out for the parent
	since   micros // for a window pool's tokens put or drain took out: the parent's time of their grant
	claimed bool   // take: the caller must refill the pool
	ended   bool   // drain: the pool's grant ended; the caller gives it back
	now     micros // the region store's clock at the operation
	st      poolState
}

// A poolOp is one operation on a pool record: its name in poolLua, its
// arguments as poolLua reads them (encode), and its Go twin (apply). Each
// is kept next to the others, and poolLua's branch for it has the same
// steps.
type poolOp interface {
	name() string
	encode() []any
	apply(st *poolState, now micros) poolReply
}

// poolTake grants N tokens (or all the pool holds if at least Need) unless
// the pool is at a newer version than Version, then claims the refill if
// none is in flight and the usable tokens are under LowWater or under the
// demand since the last refill over Lead.
type poolTake struct {
	N, Need  int64
	Window   bool   // window tokens lapse: usable only if they can be spent by exp
	Hold     micros // (window) how long after the take the caller may spend them
	LowWater int64
	Claim    micros // how long a claimed refill holds the claim
	Lead     micros
	Version  uint64
}

func (o poolTake) name() string { return "take" }

func (o poolTake) encode() []any {
	hold := int64(-1) // -1: tokens never lapse
	if o.Window {
		hold = int64(o.Hold)
	}
	return []any{o.N, max(o.Need, 1), hold, o.LowWater, int64(o.Claim), int64(o.Lead), o.Version}
}

func (o poolTake) apply(st *poolState, now micros) poolReply {
	usable := st.level
	if o.Window && now+o.Hold > st.exp {
		usable = 0 // window tokens that could be spent too late: the drain gives them back
	}
	// A grant pool that is full when a take comes wastes its grant's
	// accrual: its share is more than the region spends.
	full := st.renew > 0 && st.gcap > 0 && st.level-st.bat >= st.gcap
	var granted int64
	switch {
	case o.Version < st.ver:
	case usable >= o.N:
		granted = o.N
	case usable >= max(o.Need, 1):
		granted = usable
	}
	usable -= granted
	// The grant's tokens go first: while they are under the grant's
	// burst the grant accrues.
	st.bat -= max(granted-(st.level-st.bat), 0)
	st.level -= granted
	if granted > 0 {
		st.used += granted
	} else {
		st.used += o.N // demand the pool could not meet
	}
	st.seen = now
	if st.renew > 0 {
		// A grant pool calls the parent when its grant call is due, or
		// at once for a newer policy version, which ends every grant at
		// the parent: it stops spending the old one.
		if o.Version > st.ver {
			st.gper, st.renew = 0, now
		}
		// A short one (a take it could not serve) may lease a batch of
		// what the grants leave, if the parent's bucket held any.
		due := now >= st.renew || (full && now >= st.at+o.Claim) || (granted == 0 && st.rem > 0)
		claimed := due && now >= st.claim
		if claimed {
			st.claim = now + o.Claim
		}
		return poolReply{granted: granted, claimed: claimed}
	}
	low := o.LowWater
	if st.at > 0 && now > st.at {
		low = max(low, cdiv(st.used*int64(o.Lead), int64(now-st.at)))
	}
	claimed := false
	if usable < low && now >= st.claim {
		st.claim, claimed = now+o.Claim, true
	}
	return poolReply{granted: granted, claimed: claimed}
}

// poolPut deposits a refill from the parent; the parent is up. A bucket
// pool's tokens of an older version are taken out for the caller to give
// back. A window pool holds one grant at a time, with its Since: what is
// left of the one held, lapsed or not, is taken out (with its since) for
// the caller to give back, so lapsed tokens never come back to life.
type poolPut struct {
	N       int64
	Exp     micros
	Version uint64
	Rem     int64  // the parent bucket's Remaining
	Reset   micros // bucket pools: the parent's time to full
	Window  bool
	Since   micros // window pools: the parent's time of the grant
}

func (o poolPut) name() string { return "put" }

func (o poolPut) encode() []any {
	reset := int64(o.Reset)
	if o.Window {
		reset = -1
	}
	return []any{o.N, int64(o.Exp), o.Version, o.Rem, reset, int64(o.Since)}
}

func (o poolPut) apply(st *poolState, now micros) poolReply {
	var rep poolReply
	if o.Version > st.ver && st.ver != 0 && st.level > 0 {
		// Tokens of an older policy version: a bucket pool's go back to
		// the parent, which rescaled its bucket without them; a window
		// pool's lapse.
		if !o.Window {
			rep.granted = st.level
		}
		st.level, st.bat = 0, 0
	}
	switch {
	case !o.Window:
		st.exp, st.full = o.Exp, now+o.Reset
	case o.N == 0: // nothing came: the batch held stays as it is
	default:
		if st.level > 0 {
			rep.granted, rep.since = st.level, st.since
		}
		st.level, st.exp, st.since = 0, o.Exp, o.Since
	}
	st.level += o.N
	if !o.Window {
		st.bat += o.N
	}
	st.down = 0
	st.ver = max(st.ver, o.Version)
	st.rem = o.Rem
	if st.renew == 0 {
		// A grant pool measures its demand from grant call to grant
		// call, whatever batches come between.
		st.used, st.at = 0, now
	}
	return rep
}

// poolGrant deposits a grant call's answer from the parent: the grant's
// first tokens, and its rate (Gper, 0 for a share of 0), burst and end
// from now on; the pool is then a grant pool, its next call due at Renew.
// Share 0 with Renew 0 ends grant mode (the parent takes no grants): the
// pool refills by batches again. Tokens of an older version go back, as
// for a put.
type poolGrant struct {
	Share, Gper, Cap, Tokens int64
	GrantExp, Renew, Exp     micros // Exp: the pool goes back after, if no process took since
	Version                  uint64
	Rem                      int64
	Reset                    micros
}

func (o poolGrant) name() string { return "grant" }

func (o poolGrant) encode() []any {
	return []any{o.Share, o.Gper, o.Cap, o.Tokens, int64(o.GrantExp), int64(o.Renew), int64(o.Exp), o.Version, o.Rem, int64(o.Reset)}
}

func (o poolGrant) apply(st *poolState, now micros) poolReply {
	var rep poolReply
	if o.Version > st.ver && st.ver != 0 && st.level > 0 {
		rep.granted, st.level, st.bat = st.level, 0, 0
	}
	st.level += o.Tokens
	// A renewal at the same rate of a grant still live goes on accruing
	// (a fraction of a token dropped at every renewal adds up: a token a
	// renewal when the rate is a token per take). Else accrual restarts
	// from now at the new rate: what the old rate had accrued below a
	// whole token is dropped, never counted twice.
	if o.Gper != st.gper || !st.live(now) {
		st.gat, st.gfrac = now, 0
	}
	st.gper, st.gexp, st.gcap = o.Gper, o.GrantExp, o.Cap
	st.share, st.renew = o.Share, o.Renew
	if o.Renew == 0 {
		st.gper, st.asks = 0, 0
	} else {
		st.asks++
	}
	st.exp, st.full = o.Exp, now+o.Reset
	st.down = 0
	st.ver = max(st.ver, o.Version)
	st.rem = o.Rem
	st.used, st.at = 0, now
	return rep
}

// poolFail records that the parent failed: takes report it until a put.
type poolFail struct{}

func (poolFail) name() string  { return "fail" }
func (poolFail) encode() []any { return nil }
func (poolFail) apply(st *poolState, now micros) poolReply {
	st.down = now
	return poolReply{}
}

// poolGive takes back tokens a process gave back. A window pool takes them
// only if they came from the batch it holds (Since, the time of the take
// they came from, no earlier than the last refill) and it has not lapsed.
type poolGive struct {
	N     int64
	Since micros // 0 for a bucket pool
}

func (poolGive) name() string    { return "give" }
func (o poolGive) encode() []any { return []any{o.N, int64(o.Since)} }
func (o poolGive) apply(st *poolState, now micros) poolReply {
	if o.Since == 0 || (o.Since >= st.at && now < st.exp) {
		st.level += o.N
		if o.Since == 0 {
			st.bat += o.N
		}
	}
	return poolReply{}
}

// poolDrain takes everything out once exp has passed, to give back to the
// parent (a window pool's with the since of its grant). A grant pool also
// ends its grant, but only once no process took from it for Idle: a
// region cut off from the parent, whose grant calls fail, keeps spending
// its grant until the grant ends.
type poolDrain struct{ Idle micros }

func (poolDrain) name() string    { return "drain" }
func (o poolDrain) encode() []any { return []any{int64(o.Idle)} }
func (o poolDrain) apply(st *poolState, now micros) poolReply {
	var rep poolReply
	if st.exp <= 0 || now < st.exp {
		return rep
	}
	if st.renew > 0 {
		if now < st.seen+o.Idle {
			return rep
		}
		rep.ended = true
		st.gper, st.gat, st.gfrac, st.gexp, st.gcap, st.share, st.renew, st.asks = 0, 0, 0, 0, 0, 0, 0, 0
	}
	rep.granted, rep.since, st.level, st.bat = st.level, st.since, 0, 0
	return rep
}

// poolRead reads the record and writes nothing.
type poolRead struct{}

func (poolRead) name() string                       { return "read" }
func (poolRead) encode() []any                      { return nil }
func (poolRead) apply(*poolState, micros) poolReply { return poolReply{} }

// poolFields is the record's fields in poolLua's order, for encoding and
// parsing in one place.
func (st *poolState) fields() []*int64 {
	return []*int64{&st.level, (*int64)(&st.exp), (*int64)(&st.claim), (*int64)(&st.down), nil,
		&st.rem, (*int64)(&st.full), (*int64)(&st.since), &st.used, (*int64)(&st.at),
		&st.gper, (*int64)(&st.gat), &st.gfrac, (*int64)(&st.gexp), &st.gcap, &st.share, (*int64)(&st.renew),
		&st.asks, (*int64)(&st.seen), &st.bat}
}

// parsePoolReply reads poolLua's reply: {granted, claimed, now, since,
// ended, then the record's fields}.
func parsePoolReply(key string, v []int64) (poolReply, error) {
	const head = 5
	var rep poolReply
	f := rep.st.fields()
	if len(v) != head+len(f) {
		return poolReply{}, errs.Errorf("tiered", "pool %q: %w: reply of %d fields", key, remote.ErrCorruptState, len(v))
	}
	rep.granted, rep.claimed, rep.now, rep.since, rep.ended = v[0], v[1] == 1, micros(v[2]), micros(v[3]), v[4] == 1
	for i, p := range f {
		if p == nil {
			rep.st.ver = uint64(v[head+i])
			continue
		}
		*p = v[head+i]
	}
	return rep, nil
}

// applyPool runs op on st at now, as poolLua does.
func applyPool(st poolState, op poolOp, now micros) (poolState, poolReply) {
	st.accrue(now)
	rep := op.apply(&st, now)
	rep.now, rep.st = now, st
	return st, rep
}

// poolTTL is how long a pool record outlives its last write. Tokens in a
// pool that expires are lost to everyone, which errs on the safe side.
const poolTTL = 10 * time.Minute

// cdiv is a/b rounded up, for b > 0.
func cdiv(a, b int64) int64 {
	q := a / b
	if a%b != 0 && (a < 0) == (b < 0) {
		q++
	}
	return q
}
