package remote

import (
	"github.com/leasehold/leasehold/internal/errs"
	"time"

	"github.com/leasehold/leasehold/internal/exact"
	"github.com/leasehold/leasehold/local"
)

// WindowSlots is how many sub-windows a sliding window's Period is cut
// into. A sub-window's tokens count until the whole sub-window has left
// the window, so a window is exact to Period/WindowSlots and never admits
// more than its Rate.
const WindowSlots = 100

// shaped reports whether r needs the shape script: a sliding window, or
// more than one limit.
func (r *Request) shaped() bool { return r.Window || len(r.Also) > 0 }

// part is one limit of a shaped bucket: a token bucket (exactly the plain
// bucket's state) or a sliding window of sub-window counters.
type part struct {
	window bool
	g      state // token bucket; version unused
	w      window
}

// window is a sliding window: at most rate tokens in any interval of per
// µs, counted in sub-windows of sub µs. counts[i] holds the tokens of
// sub-window base+i; a sub-window's tokens count until (base+i+1)·sub+per.
// counts has a fixed length (slots), so the state does not grow with
// traffic.
type window struct {
	rate, per, sub int64
	last           micros // store time at the last update
	base           int64
	counts         []int64
}

// shapeState is a shaped bucket: its policy version and one part per limit,
// in the request's order (Limit, then Also).
type shapeState struct {
	version uint64
	parts   []part
}

// shapeLimit is one limit of a shaped request in store units: a token
// bucket in lowest terms, or a window's rate and period in µs as given
// (a window is not reducible: 1 000 per 10 s is not 1 per 10 ms).
type shapeLimit struct {
	window bool
	m      exact.Micros
}

// validateShape checks the limits of a shaped request and returns them in
// store units; cap is the largest n any one call may ask for.
func validateShape(op Op, r *Request) ([]shapeLimit, error) {
	all := append([]local.Limit{r.Limit}, r.Also...)
	out := make([]shapeLimit, len(all))
	shortest := time.Duration(1<<63 - 1)
	capN := local.MaxBurst
	for i, l := range all {
		m, err := exact.Reduce(l.Rate, l.Period, l.Burst)
		if err != nil {
			return nil, errs.Errorf("remote", "policy %q limit %d: %w", r.Policy, i, err)
		}
		if r.Window {
			if l.Burst != l.Rate || l.Rate > local.MaxBurst {
				return nil, errs.Errorf("remote", "policy %q limit %d: %w: a sliding window's burst is its rate (%d), not %d",
					r.Policy, i, local.ErrInvalidLimit, l.Rate, l.Burst)
			}
			m = exact.Micros{Rate: l.Rate, Per: int64(l.Period / time.Microsecond), Burst: l.Rate}
		}
		out[i] = shapeLimit{window: r.Window, m: m}
		shortest = min(shortest, l.Period)
		capN = min(capN, m.Burst)
	}
	if len(out) > maxLimits {
		return nil, errs.Errorf("remote", "policy %q: %w: %d limits, at most %d", r.Policy, ErrInvalidPolicy, len(out), maxLimits)
	}
	if r.Hold < 0 || (r.Window && r.Hold > shortest/10) {
		return nil, errs.Errorf("remote", "policy %q: %w: hold %v outside [0, %v]", r.Policy, local.ErrInvalidLimit, r.Hold, shortest/10)
	}
	if op == OpLease && r.N > capN {
		return nil, errs.Errorf("remote", "lease %d on %q, tightest limit %d: %w", r.N, r.Key, capN, local.ErrExceedsBurst)
	}
	return out, nil
}

// maxLimits is the most limits one policy may carry (Limit and Also).
const maxLimits = 8

func newWindow(l shapeLimit, now micros) window {
	w := window{rate: l.m.Rate, per: l.m.Per, last: now}
	w.sub = max(1, w.per/WindowSlots)
	w.counts = make([]int64, cdiv(w.per, w.sub)+cdiv(w.per, 10*w.sub)+2)
	w.base, _ = idiv(int64(now)-w.per, w.sub)
	return w
}

// shift moves the window to now: sub-windows that have wholly left it are
// dropped. A clock that stepped back keeps the window where it was.
func (w *window) shift(now micros) {
	if now <= w.last {
		return
	}
	w.last = now
	lo, _ := idiv(int64(now)-w.per, w.sub)
	d := lo - w.base
	if d <= 0 {
		return
	}
	n := int64(len(w.counts))
	for i := range w.counts {
		if j := int64(i) + d; j < n {
			w.counts[i] = w.counts[j]
		} else {
			w.counts[i] = 0
		}
	}
	w.base = lo
}

func (w *window) sum() int64 {
	var s int64
	for _, c := range w.counts {
		s += c
	}
	return s
}

// slot returns the index of the sub-window holding store time at, clamped
// to the last slot; negative when that sub-window has left the window.
func (w *window) slot(at micros) int64 {
	q, _ := idiv(int64(at), w.sub)
	return min(q-w.base, int64(len(w.counts))-1)
}

// wait returns the µs until k more tokens fit in the window.
func (w *window) wait(k int64) int64 {
	excess := w.sum() + k - w.rate
	if excess <= 0 {
		return 0
	}
	var dropped int64
	for i, c := range w.counts {
		if dropped += c; dropped >= excess {
			return (w.base+int64(i)+1)*w.sub + w.per - int64(w.last)
		}
	}
	return w.per
}

// reset returns the µs until the window holds no tokens.
func (w *window) reset() int64 {
	for i := len(w.counts) - 1; i >= 0; i-- {
		if w.counts[i] > 0 {
			return (w.base+int64(i)+1)*w.sub + w.per - int64(w.last)
		}
	}
	return 0
}

// avail returns the tokens a part can give now.
func (p *part) avail() int64 {
	if p.window {
		return max(p.w.rate-p.w.sum(), 0)
	}
	return p.g.level
}

// waitFor returns the µs until the part can give k tokens.
func (p *part) waitFor(k int64) int64 {
	if p.window {
		return p.w.wait(k)
	}
	return p.g.waitFor(p.g.level-k, 0)
}

func (p *part) resetAfter() int64 {
	if p.window {
		return p.w.reset()
	}
	return p.g.waitFor(p.g.level, p.g.burst)
}

// used is what a part has taken: tokens in the window, or the bucket's
// deficit below full; carried into another kind on a policy change.
func (p *part) used() int64 {
	if p.window {
		return p.w.sum()
	}
	return p.g.burst - p.g.level
}

func (p *part) same(l shapeLimit) bool {
	if p.window {
		return l.window && p.w.rate == l.m.Rate && p.w.per == l.m.Per
	}
	return !l.window && p.g.rate == l.m.Rate && p.g.per == l.m.Per && p.g.burst == l.m.Burst
}

// freshPart returns a new part for l at now: a full bucket or an empty
// window, with used tokens already taken.
func freshPart(l shapeLimit, now micros, used int64) part {
	if l.window {
		w := newWindow(l, now)
		if used > 0 {
			w.counts[w.slot(now)] = min(used, w.rate)
		}
		return part{window: true, w: w}
	}
	used = min(max(used, 0), l.m.Burst)
	return part{g: state{level: l.m.Burst - used, last: now, burst: l.m.Burst, rate: l.m.Rate, per: l.m.Per}}
}

// rescale moves old, refilled to now, to the limit l of a newer policy:
// tokens used are kept (clamped to a bucket's new burst), and a window
// keeps its counters when its period is unchanged.
func rescale(old part, l shapeLimit, now micros) part {
	switch {
	case !old.window && !l.window:
		g := old.g
		if g.level >= 0 {
			g.level = l.m.Burst - min(g.burst-g.level, l.m.Burst)
		}
		g.carry, g.burst, g.rate, g.per = 0, l.m.Burst, l.m.Rate, l.m.Per
		return part{g: g}
	case old.window && l.window && old.w.per == l.m.Per:
		old.w.rate = l.m.Rate
		return old
	case old.window && l.window:
		// Another period: the old counts all move to the sub-window of
		// the old window's latest one, so they count at least as long.
		nw := freshPart(l, now, 0)
		if last := old.w.reset(); last > 0 {
			nw.w.counts[max(nw.w.slot(now.plus(last-old.w.per-1)), 0)] = min(old.w.sum(), nw.w.rate)
		}
		return nw
	}
	return freshPart(l, now, old.used())
}

// refresh brings every part to now.
func (s *shapeState) refresh(now micros) {
	for i := range s.parts {
		if p := &s.parts[i]; p.window {
			p.w.shift(now)
		} else {
			p.g.refill(now)
		}
	}
}

// applyShape runs op on a shaped bucket at store time now: the Go twin of
// shapeLua. Binding is the part that held the fewest tokens, or on a
// refusal the one with the longest wait (see shapeState.lease).
func applyShape(st shapeState, exists bool, op Op, r *Request, ls []shapeLimit, now micros) (shapeState, Result) {
	stale := st.bring(exists, r.Version, ls, now)
	var granted, retry int64
	binding := 0
	hold := int64(r.Hold / time.Microsecond)
	switch op {
	case OpLease:
		if !stale {
			granted, retry, binding = st.lease(r, hold)
		}
	case OpReturn:
		for i := range st.parts {
			st.parts[i].giveBack(r.N, r.Since, hold)
		}
	case OpDebit:
		for i := range st.parts {
			st.parts[i].charge(r.N)
		}
	}
	remaining, reset := st.parts[0].avail(), int64(0)
	for i := range st.parts {
		remaining = min(remaining, st.parts[i].avail())
		reset = max(reset, st.parts[i].resetAfter())
	}
	return st, Result{
		Granted:    granted,
		Remaining:  max(remaining, 0),
		RetryAfter: time.Duration(retry) * time.Microsecond,
		ResetAfter: time.Duration(reset) * time.Microsecond,
		Now:        time.UnixMicro(int64(now)),
		Version:    st.version,
		Stale:      stale,
		Created:    !exists,
		Binding:    binding,
	}
}

// bring makes the bucket current for a request of version under ls at
// now: a new bucket if it did not exist, refilled parts, and parts
// rescaled to a newer version or other limits. It reports whether the
// bucket's version is newer than the request's (stale).
func (s *shapeState) bring(exists bool, version uint64, ls []shapeLimit, now micros) (stale bool) {
	if !exists {
		*s = shapeState{version: version, parts: make([]part, len(ls))}
		for i, l := range ls {
			s.parts[i] = freshPart(l, now, 0)
		}
		return false
	}
	s.refresh(now)
	if s.version > version {
		return true
	}
	if s.version < version || !s.matches(ls) {
		parts := make([]part, len(ls))
		for i, l := range ls {
			if i < len(s.parts) {
				parts[i] = rescale(s.parts[i], l, now)
			} else {
				parts[i] = freshPart(l, now, 0)
			}
		}
		s.parts, s.version = parts, version
	}
	return false
}

// lease takes the same tokens from every part: n if all have them, else
// the fewest any part has if that covers need (no future-dating, so min
// changes nothing), else nothing, with the longest wait for need. A
// window counts the tokens in the sub-window of its time plus hold (µs).
func (s *shapeState) lease(r *Request, hold int64) (granted, retry int64, binding int) {
	least := s.parts[0].avail()
	for i := range s.parts {
		if a := s.parts[i].avail(); a < least {
			least, binding = a, i
		}
	}
	switch {
	case least >= r.N:
		granted = r.N
	case least >= r.Need:
		granted = least
	default:
		for i := range s.parts {
			if w := s.parts[i].waitFor(r.Need); w > retry {
				retry, binding = w, i
			}
		}
		return 0, retry, binding
	}
	for i := range s.parts {
		if p := &s.parts[i]; p.window {
			p.w.counts[p.w.slot(p.w.last.plus(hold))] += granted
		} else {
			p.g.level -= granted
		}
	}
	return granted, 0, binding
}

// giveBack returns n unspent tokens: to a bucket up to its burst, to a
// window from the sub-window of since plus hold (µs), where a lease at
// since counted them, or nothing without since.
func (p *part) giveBack(n int64, since time.Time, hold int64) {
	if !p.window {
		p.g.level = min(p.g.level+n, p.g.burst)
		if p.g.level >= p.g.burst {
			p.g.carry = 0
		}
		return
	}
	if since.IsZero() {
		return
	}
	if k := p.w.slot(micros(since.UnixMicro()).plus(hold)); k >= 0 {
		p.w.counts[k] = max(p.w.counts[k]-n, 0)
	}
}

// charge takes n tokens admitted elsewhere: a bucket may go into debt; a
// window counts them now, a sub-window holding at most the rate (more only
// keeps the window full for a period, which the rate does).
func (p *part) charge(n int64) {
	if !p.window {
		p.g.level = max(p.g.level-n, -maxDebt)
		return
	}
	k := p.w.slot(p.w.last)
	p.w.counts[k] = min(p.w.counts[k]+n, p.w.rate)
}

func (s *shapeState) matches(ls []shapeLimit) bool {
	if len(s.parts) != len(ls) {
		return false
	}
	for i, l := range ls {
		if !s.parts[i].same(l) {
			return false
		}
	}
	return true
}

// fromPlain reads a plain bucket as a shaped one of one token bucket.
func fromPlain(st state) shapeState {
	return shapeState{version: st.version, parts: []part{{g: st}}}
}

// toPlain reads a shaped bucket as a plain one, for a policy that went back
// to one token bucket: its first part if that is a bucket, else a bucket
// that has used what the window holds. The plain rescale then applies.
func (s *shapeState) toPlain(now micros) state {
	p := s.parts[0]
	if !p.window {
		st := p.g
		st.version = s.version
		return st
	}
	p.w.shift(now)
	used := p.w.sum()
	return state{level: p.w.rate - min(used, p.w.rate), last: p.w.last, version: s.version, burst: p.w.rate,
		rate: p.w.rate, per: p.w.per}
}

// clone returns a copy of s that shares no counters with it.
func (s shapeState) clone() shapeState {
	parts := make([]part, len(s.parts))
	copy(parts, s.parts)
	for i := range parts {
		if parts[i].window {
			parts[i].w.counts = append([]int64(nil), parts[i].w.counts...)
		}
	}
	return shapeState{version: s.version, parts: parts}
}
