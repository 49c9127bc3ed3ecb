package hybrid

import (
	"context"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leasehold/leasehold/internal/background"
	"github.com/leasehold/leasehold/internal/redisopts"
	"github.com/leasehold/leasehold/remote"
)

// One store flight per key: concurrent callers that need the store for a
// key join the flight under way instead of making a call of their own.
// A caller that must answer within the store timeout leaves the flight to
// a worker and waits at most that long; the flight goes on without it,
// so that a slow answer still deposits its tokens. While the store
// answers fast, over a client whose reads end at their deadline, one
// caller at a time flies its own flight instead (see inline). Workers start as
// flights overlap and are kept while the load needs them (see workers):
// a goroutine per flight
// (singleflight.DoChan's, and later one per flight beyond two workers
// per CPU) cost a cold decision its creation, a stack grown again from
// its smallest in every store call (13% of the Zipf benchmark's CPU), and
// several allocations.

// flight is one store call for a key, and its outcome once done closes.
type flight struct {
	// done is made by the first caller that waits for the flight (see
	// wait), under the table's lock: a caller flying its own flight, alone,
	// waits for nothing, and the channel was an allocation of every cold
	// decision.
	done chan struct{}
	out  fetchOutcome
	err  error
	// handout is what is left of out.handout for the callers.
	handout atomic.Int64
	// refs is the callers with a need still on the flight, plus one for
	// the flight until it is done: whoever ends the last drops what no
	// caller took of the handout (a caller that left at its timeout).
	refs atomic.Int64
	// What the call is for: the leaser, the key's account and the
	// leader's need (0 for a background refill).
	ls   *leaser
	e    *account
	need int64
}

// fly makes the call, its context from calls (leaser.calls, or
// inline.calls for a flight its leader flies), and releases those
// waiting.
func (f *flight) fly(calls *background.Deadlines) {
	out, err := fetchOutcome{}, error(ErrClosed)
	if f.ls.bg.Enter() {
		out, err = f.ls.leaseFor(f.e, f.need, calls)
		f.ls.bg.Exit()
	}
	f.ls.flights.finish(f.e.key, f, out, err)
	if f.need == 0 {
		f.e.refilling.Store(false) // a background refill (leaser.refillAsync)
	}
}

// flightTable is the flights under way, by user key.
type flightTable struct {
	mu sync.Mutex
	m  map[string]*flight
}

// join returns the flight under way for e's key, or a new one for need
// that the caller leads.
func (t *flightTable) join(ls *leaser, e *account, need int64) (f *flight, lead bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if f = t.m[e.key]; f == nil {
		if t.m == nil {
			t.m = map[string]*flight{}
		}
		f = &flight{ls: ls, e: e, need: need}
		f.refs.Store(1) // the flight's own, until it is done
		t.m[e.key] = f
		lead = true
	}
	if need > 0 {
		f.refs.Add(1)
	}
	return f, lead
}

// finish records f's outcome and releases those who joined it; a caller
// arriving after it starts a flight of its own. The outcome is written
// before the lock: a caller that asks for the channel after finish gets
// one already closed, and reads the outcome through the lock.
func (t *flightTable) finish(key string, f *flight, out fetchOutcome, err error) {
	f.out, f.err = out, err
	f.handout.Store(out.handout)
	t.mu.Lock()
	delete(t.m, key)
	done := f.done
	f.done = closedDone
	t.mu.Unlock()
	if done != nil {
		close(done)
	}
	f.leave()
}

// wait returns the channel that closes when f is done.
func (t *flightTable) wait(f *flight) <-chan struct{} {
	t.mu.Lock()
	defer t.mu.Unlock()
	if f.done == nil {
		f.done = make(chan struct{})
	}
	return f.done
}

// closedDone is the done of every finished flight.
var closedDone = func() chan struct{} {
	c := make(chan struct{})
	close(c)
	return c
}()

// leave ends a reference to f (a caller with a need, or the flight once
// done); the last drops the handout no caller took. Those tokens were
// admitted by the store and are not spendable later (see granted): they
// count as expired, out of the key's books.
func (f *flight) leave() {
	if f.refs.Add(-1) != 0 {
		return
	}
	if left := f.handout.Swap(0); left > 0 {
		f.e.unhand(left)
		f.ls.stats.tokensExpired.Add(left)
	}
}

// outcomeFor is f's outcome for a caller of need tokens, once done: handed
// when the call's handout still held them, which the caller has then.
func (f *flight) outcomeFor(need int64) fetchOutcome {
	out := f.out
	for {
		left := f.handout.Load()
		if left < need {
			return out
		}
		if f.handout.CompareAndSwap(left, left-need) {
			out.handed = true
			return out
		}
	}
}

// workers runs flights handed over by callers that wait with a deadline.
// A worker starts when every worker is busy and ends when the sweep finds
// more idle than the most that were busy since the last sweep: a burst of
// concurrent cold calls leaves no idle goroutines behind for long.
type workers struct {
	bg   *background.Group
	work chan *flight // a nil flight tells an idle worker to end
	n    atomic.Int32 // workers running
	busy atomic.Int32 // of them, flying
	peak atomic.Int32 // most busy at once since the last trim
}

// maxWorkers bounds the workers running at once; a flight beyond them
// runs on a goroutine of its own. Flights overlap about as much as
// callers need the store at once (256 goroutines on 100 000 Zipf keys
// had more than 128 flights at once on 2 CPUs).
var maxWorkers = int32(1024 * runtime.GOMAXPROCS(0))

// run flies f on an idle worker, or on a new one when every worker is
// busy (a flight never waits for a worker).
func (w *workers) run(f *flight) {
	w.started()
	select {
	case w.work <- f:
		return
	default:
	}
	if w.n.Add(1) <= maxWorkers {
		if w.bg.Enter() {
			go w.loop(f)
			return
		}
		// Closing: the flight ends at once (ErrClosed), here rather
		// than in a goroutine Close would not wait for.
		w.n.Add(-1)
		f.fly(f.ls.calls)
		w.busy.Add(-1)
		return
	}
	w.n.Add(-1)
	go func() {
		f.fly(f.ls.calls)
		w.busy.Add(-1)
	}()
}

// started counts a flight handed over as busy until it lands.
func (w *workers) started() {
	b := w.busy.Add(1)
	for p := w.peak.Load(); b > p && !w.peak.CompareAndSwap(p, b); p = w.peak.Load() {
	}
}

// loop flies f, then the flights handed to it, until Close begins or a
// trim ends it.
func (w *workers) loop(f *flight) {
	defer w.bg.Exit()
	for {
		f.fly(f.ls.calls)
		w.busy.Add(-1)
		select {
		case f = <-w.work:
			if f == nil {
				w.n.Add(-1)
				return
			}
		case <-w.bg.Done:
			return
		}
	}
}

// trim ends the idle workers beyond the most that were busy at once since
// the last trim (the sweep calls it).
func (w *workers) trim() {
	keep := w.peak.Swap(w.busy.Load())
	for range max(w.n.Load()-keep, 0) {
		select {
		case w.work <- nil:
		default:
			return // none idle
		}
	}
}

// inline lets the caller that leads a flight fly it itself, when that
// keeps every promise a worker keeps: handing a flight to a worker and
// waiting for it costs a caller two goroutine switches and the wake
// of an idle thread (measured on 100 000 Zipf keys at 1 goroutine,
// BenchmarkLimiters: 94 and 71 µs of client CPU per store call handed
// over, 59 and 53 flown inline). A worker lets a caller stop waiting at
// the store timeout while the call goes on, so that a slow answer still
// lands its tokens; a caller flying its own call ends it at the store
// timeout instead. So a caller flies inline only while the store answers
// well within that timeout, over a client whose in-flight reads end at
// their context's deadline, at most maxInline flights at a time: a store
// that turns slow costs at most that many calls cut short (their tokens,
// if the store granted any, are lost, and the breaker counts them) before
// flights go back to the workers. A caller whose context is cancelled
// during its own call returns ctx.Err() when the call returns (within
// the store timeout), the call's tokens in the lease, as if it had left
// a worker's flight.
type inline struct {
	// on: the store is a RedisStore whose go-redis client has
	// ContextTimeoutEnabled (see honorsDeadlines).
	on bool
	// calls lends contexts that end within the store timeout.
	calls *background.Deadlines
	// busy is the callers flying inline.
	busy atomic.Int32
	// slowUntil: no flight is flown inline before then, after a call that
	// took over half the store timeout or was cut short.
	slowUntil atomicMono
	// timeout is the store timeout; hold, how long flights stay on the
	// workers after a slow call (the refill timeout).
	timeout, hold time.Duration
}

// newInline builds the inline flights of cfg under parent (Close ends
// their calls). A call may end up to an eighth of the store timeout
// early: calls starting within that share a context (see
// background.Deadlines).
func newInline(on bool, parent context.Context, cfg *config) inline {
	slack := cfg.storeTimeout / 8
	return inline{on: on, calls: background.NewDeadlines(parent, cfg.storeTimeout-slack, slack),
		timeout: cfg.storeTimeout, hold: cfg.refillTimeout}
}

// take reports whether a caller with ctx may fly its flight at now; the
// caller then calls done when the flight has landed. A caller whose
// context ends before the store timeout waits for a worker's flight
// instead, which it can leave at its deadline.
func (in *inline) take(ctx context.Context, now mono) bool {
	if !in.on || now < in.slowUntil.Load() {
		return false
	}
	if dl, ok := ctx.Deadline(); ok && time.Until(dl) < in.timeout {
		return false
	}
	if in.busy.Add(1) > maxInline {
		in.busy.Add(-1)
		return false
	}
	return true
}

func (in *inline) done() { in.busy.Add(-1) }

// maxInline bounds the callers flying inline at once. One at a time left
// every other concurrent cold caller to a worker: at 16 goroutines of
// cold decisions (BenchmarkColdDecisions, 12 rounds of each, the two
// builds alternating), client CPU per store call was 1.21–1.79×
// redis_rate's (median 1.57) with one, 1.14–1.51× (median 1.37) with
// 16. Beyond it callers go to the workers, so that a store that turns
// slow cuts at most this many calls short.
const maxInline = 16

// observe notes a call that took from start to now, cut short or not:
// flights go back to the workers for the hold when it took over half the
// store timeout.
func (in *inline) observe(start, now mono, cut bool) {
	if in.on && (cut || now.sub(start) > in.timeout/2) {
		in.slowUntil.Store(now.add(in.hold))
	}
}

// honorsDeadlines reports a store whose calls end at their context's
// deadline: a RedisStore over a go-redis client with
// ContextTimeoutEnabled (one without it bounds a read by ReadTimeout, 3 s
// by default). Other stores, wrappers of a RedisStore included, keep their
// flights on the workers.
func honorsDeadlines(s remote.Store) bool {
	rs, ok := s.(*remote.RedisStore)
	if !ok {
		return false
	}
	enabled, _, known := redisopts.Of(rs.Client())
	return known && enabled
}
