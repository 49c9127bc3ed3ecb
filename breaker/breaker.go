// Package breaker owns failure detection for store calls: Store wraps a
// remote.Store with a github.com/sony/gobreaker/v2 two-step circuit
// breaker that opens on consecutive unavailability errors and on calls
// slower than a latency threshold, and probes the store again, half-open,
// with exponential backoff. One Store (one breaker) should front each Redis
// deployment and be shared by every limiter that uses it.
package breaker

import (
	"context"
	"errors"
	"github.com/leasehold/leasehold/internal/errs"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/internal/hooks"
	"github.com/leasehold/leasehold/remote"
	"github.com/sony/gobreaker/v2"
)

// ErrOpen is returned, wrapped with remote.ErrUnavailable, for calls the
// breaker refused without trying the store.
var ErrOpen = errs.New("breaker", "open")

// errSlow marks a call that succeeded but took longer than the latency
// threshold; the breaker counts it as a failure.
var errSlow = errs.New("breaker", "slow call")

// Settings configures a Store. Zero fields take the documented defaults.
type Settings struct {
	// Breaker is passed to gobreaker, except that Name defaults to
	// "leasehold", ReadyToTrip defaults to 3 consecutive failures (and is
	// true at once for a remote.ErrUnreachable failure: a store that
	// refused or dropped the connection is down, not slow),
	// Timeout (the open period before the first half-open probe, default
	// 200 ms) is kept on Clock by this package, and OnStateChange is called
	// after gobreaker has released its lock, in the order of the changes,
	// so it may call back into the Store.
	Breaker gobreaker.Settings
	// Latency is the slowest a successful call may be before it counts as
	// a failure. The default is 500 ms.
	Latency time.Duration
	// MaxBackoff caps the wait between half-open probes, which doubles
	// from Breaker.Timeout after each failed probe. The default is 1 s.
	MaxBackoff time.Duration
	// Clock times the open state, probe backoff and call latency. The
	// default is the system clock; the simulator passes a virtual one.
	Clock clock.Clock
}

// Store is a remote.Store behind a circuit breaker. It is safe for
// concurrent use. The zero value is not usable; call NewStore.
type Store struct {
	next    remote.Store
	cb      *gobreaker.CircuitBreaker[struct{}]
	latency time.Duration
	timeout time.Duration
	maxBack time.Duration
	// clk decides how long the breaker stays open. gobreaker reads the
	// system clock, so it is given a 1 ns open state and this package
	// holds a half-open breaker "open" until nextProbe on clk: the open
	// period follows whatever clock the caller runs on.
	clk clock.Clock
	// realClock: clk is clock.Real, whose readings also time the calls
	// in flight.
	realClock bool

	downSeen  atomic.Bool  // the failure being counted is remote.ErrUnreachable
	stallSeen atomic.Bool  // the failure being counted is a call outstanding past latency
	inflight  inflight     // calls in flight, so a hung one is seen before it returns
	nextProbe atomic.Int64 // unix ns before which a half-open breaker is treated as open
	// closed mirrors gobreaker's state being closed, which it leaves only
	// through a call's outcome (onChange records it): State then needs
	// neither gobreaker's mutex nor a clock reading.
	closed  atomic.Bool
	backoff atomic.Int64 // current probe backoff, ns
	notify  notifier     // the user's OnStateChange, run outside gobreaker's lock
	// full is set by a failure that says the store is out of memory,
	// until the breaker closes: it then closes only after probesToClose
	// good probes in a row, probeSpacing apart; streak counts them.
	full   atomic.Bool
	streak atomic.Int32
}

// probesToClose is how many half-open probes in a row must succeed before
// a breaker opened by an out-of-memory store closes, probeSpacing apart.
// A Redis full under noeviction whose clients keep writing accepts writes
// in spells (measured: 250–430 ms in one piece, 25–43 of 370 small writes
// in 4 s): one good probe there closed the breaker and the next write
// opened it again, three mode changes in 4 s, one limiter on its store
// while the other decided by its share (TestOOMFilledDoesNotFlap). Other
// failures close on one good probe: a store that refused connections or
// hung is back when it answers, and the failover and outage targets
// (healthy within 1–2 s) count on it.
const probesToClose = 5

// probeSpacing is the least time between two probes of an out-of-memory
// store.
const probeSpacing = 200 * time.Millisecond

// errProbation marks a good answer from an out-of-memory store still on
// probation: the caller gets the answer, the breaker a failure, so that
// it stays open until the streak is long enough.
var errProbation = errs.New("breaker", "store on probation after running out of memory")

func init() {
	hooks.ReportTimeout = func(s any) {
		if bs, ok := s.(*Store); ok {
			bs.reportTimeout()
		}
	}
}

var _ remote.Store = (*Store)(nil)

// NewStore returns next behind a breaker configured by st.
func NewStore(next remote.Store, st Settings) *Store {
	if st.Latency <= 0 {
		st.Latency = 500 * time.Millisecond
	}
	if st.MaxBackoff <= 0 {
		st.MaxBackoff = time.Second
	}
	if st.Clock == nil {
		st.Clock = clock.Real()
	}
	bs := st.Breaker
	if bs.Name == "" {
		bs.Name = "leasehold"
	}
	if bs.Timeout <= 0 {
		bs.Timeout = 200 * time.Millisecond
	}
	if bs.ReadyToTrip == nil {
		bs.ReadyToTrip = func(c gobreaker.Counts) bool { return c.ConsecutiveFailures >= 3 }
	}
	s := &Store{next: next, latency: st.Latency, timeout: bs.Timeout, maxBack: st.MaxBackoff, clk: st.Clock, realClock: st.Clock == clock.Real()}
	s.backoff.Store(int64(bs.Timeout))
	s.closed.Store(true)
	userTrip := bs.ReadyToTrip
	bs.ReadyToTrip = func(c gobreaker.Counts) bool {
		// A store that refused or dropped the connection is down, not
		// slow: waiting for more failures only delays degraded mode.
		return s.downSeen.Swap(false) || s.stallSeen.Swap(false) || userTrip(c)
	}
	userIsSuccessful := bs.IsSuccessful
	bs.IsSuccessful = func(err error) bool {
		if userIsSuccessful != nil {
			return userIsSuccessful(err)
		}
		// Only unavailability trips the breaker: bad input or a corrupt
		// bucket says nothing about the store's health.
		return err == nil || (!remote.IsUnavailable(err) && !errors.Is(err, errSlow) && !errors.Is(err, errProbation))
	}
	if bs.IsExcluded == nil {
		bs.IsExcluded = func(err error) bool { return errors.Is(err, context.Canceled) }
	}
	s.notify.fn = bs.OnStateChange
	bs.OnStateChange = func(name string, from, to gobreaker.State) {
		// gobreaker holds its mutex here: only record. The user's callback
		// runs from flush, once the breaker call that caused this returned.
		s.onChange(from, to)
		s.notify.add(stateChange{name, from, to})
	}
	bs.Timeout = time.Nanosecond // see Store.clk
	s.cb = gobreaker.NewCircuitBreaker[struct{}](bs)
	return s
}

// Unwrap returns the store behind the breaker.
func (s *Store) Unwrap() remote.Store { return s.next }

// State returns the breaker's state. A half-open breaker waiting out its
// probe backoff reports StateOpen. A closed breaker with a call in flight
// for longer than the latency threshold opens first: a hung store (a
// paused process, a black-holed link) answers nothing, and a client whose
// reads ignore the context's deadline (go-redis without
// ContextTimeoutEnabled) would otherwise hold the breaker closed until its
// own read timeout.
func (s *Store) State() gobreaker.State {
	s.checkStalled()
	if s.closed.Load() {
		return gobreaker.StateClosed
	}
	st := s.cb.State()
	s.notify.flush()
	if st == gobreaker.StateHalfOpen && s.clk.Now().UnixNano() < s.nextProbe.Load() {
		return gobreaker.StateOpen
	}
	return st
}

func (s *Store) onChange(from, to gobreaker.State) {
	s.closed.Store(to == gobreaker.StateClosed)
	now := s.clk.Now().UnixNano()
	switch {
	case from == gobreaker.StateHalfOpen && to == gobreaker.StateOpen && s.streak.Load() > 0:
		// A good probe of an out-of-memory store on probation.
		s.nextProbe.Store(now + int64(probeSpacing))
	case from == gobreaker.StateHalfOpen && to == gobreaker.StateOpen:
		// A failed probe: wait twice as long before the next one.
		b := min(2*s.backoff.Load(), int64(s.maxBack))
		s.backoff.Store(b)
		s.nextProbe.Store(now + b)
	case to == gobreaker.StateClosed:
		s.backoff.Store(int64(s.timeout))
		s.nextProbe.Store(0)
		s.full.Store(false)
		s.streak.Store(0)
	case to == gobreaker.StateOpen:
		s.nextProbe.Store(now + int64(s.timeout))
	}
}

// reportTimeout tells a closed breaker that a caller gave up waiting for
// the store and counts it as a failed call. Callers report only when the
// store has answered nothing at all for a while: a store that answers
// slowly is judged by its calls' own latency. Reached through
// hooks.ReportTimeout.
func (s *Store) reportTimeout() {
	defer s.notify.flush()
	if s.cb.State() != gobreaker.StateClosed {
		return
	}
	s.failOnce()
}

// checkStalled opens a closed breaker whose oldest call in flight began
// longer than the latency threshold ago, on the real clock.
func (s *Store) checkStalled() {
	if !s.inflight.overdue(time.Now(), s.latency) || s.cb.State() != gobreaker.StateClosed {
		return
	}
	defer s.notify.flush()
	if s.failOnce() {
		s.stallSeen.Store(true)
	}
}

// failOnce counts a failed call on the breaker unless it refuses calls,
// and reports whether it counted one.
func (s *Store) failOnce() bool {
	counted := false
	_, _ = s.cb.Execute(func() (struct{}, error) {
		counted = true
		return struct{}{}, errSlow
	})
	return counted
}

// inflight is the start times of the calls in flight, so that State sees
// a hung call before it returns. Each call takes a slot of its own without
// a lock: a mutex here was taken twice per store call and once per State,
// on every cold decision, and among 16 concurrent callers on 2 cores its
// handoffs cost more than the rest of the breaker (BenchmarkStoreCall).
// Calls beyond the slots (a slow store with many callers) are kept under
// the mutex, by tickets that rise with start times, so the oldest of them
// is the lowest ticket still present.
//
// A call writes only its slot, and the overflow beyond: a count of the
// calls in flight, and a shared cursor to spread them over the slots,
// were two more lines that both cores took from each other on every call.
// A call starts looking at a random slot instead, and the count is what
// the slots hold, read by a scan that overdue makes rarely.
type inflight struct {
	slots [inflightSlots]atomic.Int64 // 1 + the start, ns after monoBase; 0: free
	over  atomic.Int64                // calls in flight beyond the slots

	// scanAt is when, in ns after monoBase, overdue next needs to look
	// at the slots: before it no call in flight can be overdue.
	scanAt atomic.Int64

	mu     sync.Mutex
	next   uint64           // last ticket given; under mu
	low    uint64           // no ticket below it is in flight; under mu
	starts map[uint64]int64 // ticket → slot value; under mu
}

// inflightSlots is how many calls inflight keeps without its mutex: more
// than a limiter flies inline at once (16), with room for its workers.
const inflightSlots = 64

// monoBase is the origin of inflight's start times, which are read on the
// monotonic clock: a wall clock stepped forward must not make a quick call
// look hung.
var monoBase = time.Now()

// begin records a call that starts at t and returns its ticket.
func (f *inflight) begin(t time.Time) uint64 {
	v := int64(t.Sub(monoBase)) + 1
	p := rand.Uint32()
	for i := range uint32(inflightSlots) {
		j := (p + i) % inflightSlots
		if f.slots[j].Load() == 0 && f.slots[j].CompareAndSwap(0, v) {
			return uint64(j)
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.starts == nil {
		f.starts = make(map[uint64]int64)
	}
	f.next++
	f.starts[f.next] = v
	f.over.Add(1)
	return inflightSlots + f.next
}

// end forgets the call of ticket id.
func (f *inflight) end(id uint64) {
	if id < inflightSlots {
		f.slots[id].Store(0)
	} else {
		f.mu.Lock()
		delete(f.starts, id-inflightSlots)
		f.over.Add(-1)
		f.mu.Unlock()
	}
}

// overdue reports whether a call in flight at now began more than limit
// ago. State asks on every cold decision, and a scan of the slots, which
// the callers' cores keep writing, cost more than the rest of State; a
// scan also tells when the next can first find a call overdue (the oldest
// call's start plus limit, or now plus limit with none in flight: calls
// that begin later are younger), so calls before then skip it. That time
// is moved a quarter of limit earlier for a call that read its start
// before the scan but took its slot after (a caller descheduled in
// between): it is then seen at most that late.
func (f *inflight) overdue(now time.Time, limit time.Duration) bool {
	t := int64(now.Sub(monoBase))
	if t < f.scanAt.Load() {
		return false
	}
	age, ok := f.oldest(now)
	if ok && age > limit {
		return true
	}
	f.scanAt.Store(t + int64(max(limit-age-limit/4, 0)))
	return false
}

// oldest returns how long ago, at now, the oldest call in flight began.
func (f *inflight) oldest(now time.Time) (time.Duration, bool) {
	first := int64(0)
	for i := range f.slots {
		if v := f.slots[i].Load(); v != 0 && (first == 0 || v < first) {
			first = v
		}
	}
	if f.over.Load() > 0 {
		f.mu.Lock()
		for ; f.low <= f.next; f.low++ {
			if v, ok := f.starts[f.low]; ok {
				if first == 0 || v < first {
					first = v
				}
				break
			}
		}
		f.mu.Unlock()
	}
	if first == 0 {
		return 0, false
	}
	return now.Sub(monoBase) - time.Duration(first-1), true
}

// call runs fn through the breaker.
func (s *Store) call(fn func() error) error {
	defer s.notify.flush()
	// nextProbe is 0 while closed: no clock reading, no gobreaker mutex.
	if np := s.nextProbe.Load(); np != 0 && s.clk.Now().UnixNano() < np && s.cb.State() == gobreaker.StateHalfOpen {
		return errs.Errorf("breaker", "%w (probe backoff): %w", ErrOpen, remote.ErrUnavailable)
	}
	// Execute rather than the two-step breaker's Allow: Allow's completion
	// callback was an allocation on every store call.
	ran, probe := false, !s.closed.Load()
	_, err := s.cb.Execute(func() (struct{}, error) {
		ran = true
		start := s.clk.Now()
		// In flight is timed on the process's real clock, whatever Clock
		// is: a hung call is one this process is waiting on, and a manual
		// or simulated clock that jumps while a quick call runs must not
		// make it look hung.
		began := start
		if !s.realClock {
			began = time.Now()
		}
		id := s.inflight.begin(began)
		err := fn()
		s.inflight.end(id)
		if err == nil && s.clk.Now().Sub(start) > s.latency {
			return struct{}{}, errSlow // the answer is still good; only the health verdict changes
		}
		if errors.Is(err, remote.ErrUnreachable) {
			s.downSeen.Store(true)
		}
		if err != nil && remote.IsUnavailable(err) {
			s.streak.Store(0)
			if errors.Is(err, hooks.ErrFull) {
				s.full.Store(true)
			}
		}
		if err == nil && probe && s.full.Load() && s.streak.Add(1) < probesToClose {
			return struct{}{}, errProbation
		}
		return struct{}{}, err
	})
	if s.downSeen.Load() { // a store on every call kept its line moving between cores
		s.downSeen.Store(false)
	}
	if !ran {
		return errs.Errorf("breaker", "%w: %w: %w", ErrOpen, err, remote.ErrUnavailable)
	}
	if errors.Is(err, errSlow) || errors.Is(err, errProbation) {
		return nil
	}
	return err
}

// Lease implements remote.Store.
func (s *Store) Lease(ctx context.Context, r remote.Request) (res remote.Result, err error) {
	err = s.call(func() error { res, err = s.next.Lease(ctx, r); return err })
	return res, err
}

// Return implements remote.Store.
func (s *Store) Return(ctx context.Context, r remote.Request) (res remote.Result, err error) {
	err = s.call(func() error { res, err = s.next.Return(ctx, r); return err })
	return res, err
}

// Debit implements remote.Store.
func (s *Store) Debit(ctx context.Context, r remote.Request) (res remote.Result, err error) {
	err = s.call(func() error { res, err = s.next.Debit(ctx, r); return err })
	return res, err
}

// Grant asks the wrapped store for a capacity grant through the breaker;
// it fails with remote.ErrNoGrants when that store keeps none.
func (s *Store) Grant(ctx context.Context, r remote.GrantRequest) (g remote.Grant, err error) {
	gs, ok := s.next.(remote.Granter)
	if !ok {
		return g, errs.Errorf("breaker", "%T: %w", s.next, remote.ErrNoGrants)
	}
	err = s.call(func() error { g, err = gs.Grant(ctx, r); return err })
	return g, err
}

// Ungrant gives a capacity grant back through the breaker.
func (s *Store) Ungrant(ctx context.Context, r remote.GrantRequest, unspent int64) (res remote.Result, err error) {
	gs, ok := s.next.(remote.Granter)
	if !ok {
		return res, errs.Errorf("breaker", "%T: %w", s.next, remote.ErrNoGrants)
	}
	err = s.call(func() error { res, err = gs.Ungrant(ctx, r, unspent); return err })
	return res, err
}

// Batch implements remote.Store. The batch counts as one call: it fails
// when any reply reports the store unavailable.
func (s *Store) Batch(ctx context.Context, op remote.Op, rs []remote.Request) []remote.Reply {
	var out []remote.Reply
	err := s.call(func() error {
		out = s.next.Batch(ctx, op, rs)
		for _, r := range out {
			if remote.IsUnavailable(r.Err) {
				return r.Err
			}
		}
		return nil
	})
	if out == nil {
		out = remote.FailedReplies(len(rs), err)
	}
	return out
}

var _ remote.Fleet = (*Store)(nil)

// errNoFleet reports a store that cannot count its fleet.
var errNoFleet = errs.New("breaker", "store does not implement remote.Fleet")

// Heartbeat implements remote.Fleet when the wrapped store does. It is
// refused while the breaker is not closed, and its outcome never counts
// toward the breaker: the fleet key may live on another node than the
// buckets (Redis Cluster), and a heartbeat failing there says nothing
// about whether decisions can reach theirs.
func (s *Store) Heartbeat(ctx context.Context, prefix, policy, member string, expiry time.Duration) (int, error) {
	f, ok := s.next.(remote.Fleet)
	if !ok {
		return 0, errNoFleet
	}
	if err := s.sideCall("heartbeats"); err != nil {
		return 0, err
	}
	return f.Heartbeat(ctx, prefix, policy, member, expiry)
}

// sideCall refuses a call on a key that is not a bucket (the fleet and
// policy records) unless the breaker is closed; the call that follows
// is neither counted nor watched for stalls. Those keys may live on
// another node than the buckets (Redis Cluster): a policy read that hung
// on a node still failing over reopened the breaker of limiters whose
// buckets were back (TestClusterFailover's reopen after the promotion),
// and a read succeeding says nothing about writes (Redis out of memory).
func (s *Store) sideCall(what string) error {
	if s.State() != gobreaker.StateClosed {
		return errs.Errorf("breaker", "%w (%s do not probe): %w", ErrOpen, what, remote.ErrUnavailable)
	}
	return nil
}

// Leave implements remote.Fleet when the wrapped store does. Like
// Heartbeat, it is refused while the breaker is not closed and never
// counts toward it.
func (s *Store) Leave(ctx context.Context, prefix, policy, member string) error {
	f, ok := s.next.(remote.Fleet)
	if !ok {
		return errNoFleet
	}
	if err := s.sideCall("fleet calls"); err != nil {
		return err
	}
	return f.Leave(ctx, prefix, policy, member)
}

var _ remote.Policies = (*Store)(nil)

var errNoPolicies = errs.New("breaker", "store does not implement remote.Policies")

// SetPolicy implements remote.Policies when the wrapped store does. It is
// refused while the breaker is not closed and never counts toward it: the
// policy record lives under its own key, which may be on another node
// than the buckets.
func (s *Store) SetPolicy(ctx context.Context, prefix, name string, rec remote.PolicyRecord) (cur remote.PolicyRecord, applied bool, err error) {
	p, ok := s.next.(remote.Policies)
	if !ok {
		return remote.PolicyRecord{}, false, errNoPolicies
	}
	if err := s.sideCall("policy writes"); err != nil {
		return remote.PolicyRecord{}, false, err
	}
	return p.SetPolicy(ctx, prefix, name, rec)
}

// GetPolicy implements remote.Policies when the wrapped store does. It is
// refused while the breaker is not closed and never counts toward it, nor
// is it watched for stalls: only bucket calls judge the buckets' store.
func (s *Store) GetPolicy(ctx context.Context, prefix, name string) (rec remote.PolicyRecord, found bool, err error) {
	p, ok := s.next.(remote.Policies)
	if !ok {
		return remote.PolicyRecord{}, false, errNoPolicies
	}
	if err := s.sideCall("reads"); err != nil {
		return remote.PolicyRecord{}, false, err
	}
	return p.GetPolicy(ctx, prefix, name)
}

// WatchPolicy implements remote.Policies when the wrapped store does. The
// subscription is not a call and does not pass through the breaker.
func (s *Store) WatchPolicy(ctx context.Context, prefix, name string, changed func()) (func(), error) {
	p, ok := s.next.(remote.Policies)
	if !ok {
		return nil, errNoPolicies
	}
	return p.WatchPolicy(ctx, prefix, name, changed)
}

// stateChange is one transition reported by gobreaker.
type stateChange struct {
	name     string
	from, to gobreaker.State
}

// notifier delivers state changes to the user's callback in order, from
// whichever goroutine finishes a breaker call first, never under a lock:
// a callback may call State or make store calls without deadlocking.
type notifier struct {
	fn func(name string, from, to gobreaker.State)
	mu struct {
		sync.Mutex
		pending    []stateChange
		delivering bool // a goroutine is draining pending
	}
}

func (n *notifier) add(c stateChange) {
	if n.fn == nil {
		return
	}
	n.mu.Lock()
	n.mu.pending = append(n.mu.pending, c)
	n.mu.Unlock()
}

func (n *notifier) flush() {
	if n.fn == nil {
		return
	}
	n.mu.Lock()
	if n.mu.delivering {
		// The goroutine delivering (possibly this one, from inside the
		// callback) will find what was added after it started.
		n.mu.Unlock()
		return
	}
	n.mu.delivering = true
	for len(n.mu.pending) > 0 {
		batch := n.mu.pending
		n.mu.pending = nil
		n.mu.Unlock()
		for _, c := range batch {
			n.fn(c.name, c.from, c.to)
		}
		n.mu.Lock()
	}
	n.mu.delivering = false
	n.mu.Unlock()
}
