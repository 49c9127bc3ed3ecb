// Package reconcile owns settling accounts after a store outage: it charges
// the tokens each key admitted while degraded (Debit) and gives back leased
// tokens that could not be returned during the outage (Return), in batches
// (one pipeline per Redis node per batch), after a random delay and at a
// paced rate, so a fleet recovering at once does not stampede the store.
// It never runs on a request's path.
package reconcile

import (
	"context"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/remote"
)

// Settler settles outage accounts on a store. Zero fields take the
// documented defaults; a Settler is safe for concurrent use.
type Settler struct {
	// Store receives the debits and returns.
	Store remote.Store
	// Clock paces the work. The default is the system clock.
	Clock clock.Clock
	// BatchSize is the most requests sent per batch. The default is 256.
	BatchSize int
	// MaxJitter bounds the random delay before the first batch. The
	// default is 250 ms.
	MaxJitter time.Duration
	// Pace is the pause between batches. The default is 5 ms.
	Pace time.Duration
	// Timeout bounds each batch. The default is 1 s.
	Timeout time.Duration
	// After schedules Start's steps. The default is Clock.AfterFunc; a
	// caller that must account for its callbacks (to wait for them on
	// close) passes its own.
	After func(d time.Duration, f func()) clock.Timer
	// Jitter returns a random delay in [0, max]. The default draws from
	// math/rand/v2; a simulation passes a seeded source to replay runs.
	Jitter func(max time.Duration) time.Duration
}

// Report says what a settlement (Start or Send) did.
type Report struct {
	Debited, Returned int64 // tokens
	Batches           int
	// Dropped counts requests the store refused for good (bad input, a
	// corrupt bucket).
	Dropped int
	// Failed holds the requests the store could not take (unavailable);
	// the caller keeps them for the next attempt.
	Failed []Item
}

// Item is one request to settle.
type Item struct {
	Op  remote.Op // remote.OpDebit or remote.OpReturn
	Req remote.Request
}

// Send settles items at once, in batches of up to batchSize (debits first),
// with no jitter or pacing: for small periodic flushes.
func Send(ctx context.Context, store remote.Store, items []Item, batchSize int) Report {
	if batchSize <= 0 {
		batchSize = 256
	}
	return send(ctx, store, items, batchSize, time.Second)
}

// send sends items in batches of one op each, debits first.
func send(ctx context.Context, store remote.Store, items []Item, batchSize int, timeout time.Duration) Report {
	var rep Report
	ordered := make([]Item, 0, len(items))
	for _, op := range []remote.Op{remote.OpDebit, remote.OpReturn} {
		for _, it := range items {
			if it.Op == op {
				ordered = append(ordered, it)
			}
		}
	}
	for start := 0; start < len(ordered); {
		op := ordered[start].Op
		end := start
		for end < len(ordered) && end-start < batchSize && ordered[end].Op == op {
			end++
		}
		chunk := ordered[start:end]
		reqs := make([]remote.Request, len(chunk))
		for i, it := range chunk {
			reqs[i] = it.Req
		}
		bctx, cancel := context.WithTimeout(ctx, timeout)
		replies := store.Batch(bctx, op, reqs)
		cancel()
		rep.Batches++
		for i, r := range replies {
			switch {
			case r.Err == nil && op == remote.OpDebit:
				rep.Debited += reqs[i].N
			case r.Err == nil:
				rep.Returned += reqs[i].N
			case remote.IsUnavailable(r.Err) || ctx.Err() != nil:
				rep.Failed = append(rep.Failed, chunk[i])
			default:
				// Bad input or a corrupt bucket cannot succeed on retry.
				rep.Dropped++
			}
		}
		start = end
	}
	return rep
}

// Start settles items, debits first (so the bucket reflects what was
// admitted before anyone leases again), then returns, without blocking:
// the jitter, each batch
// and each pause are steps scheduled with After, so on a manual clock the
// whole run is driven, deterministically, by advancing it. done is called
// once, from the last step, with the report. cancel stops the run before
// its next step and returns the items not yet sent; it returns nil if the
// run already finished.
func (s Settler) Start(items []Item, done func(Report)) (cancel func() []Item) {
	s = s.withDefaults()
	r := &stepper{s: s, done: done}
	for _, op := range []remote.Op{remote.OpDebit, remote.OpReturn} {
		for _, it := range items {
			if it.Op == op {
				r.items = append(r.items, it)
			}
		}
	}
	r.mu.Lock()
	r.scheduleLocked(s.Jitter(s.MaxJitter))
	r.mu.Unlock()
	return r.cancel
}

type stepper struct {
	s     Settler
	done  func(Report)
	mu    sync.Mutex
	items []Item // debits first, then returns
	next  int    // first item not yet sent
	rep   Report
	timer clock.Timer
	over  bool // finished or cancelled
}

func (r *stepper) scheduleLocked(d time.Duration) {
	// A timer that fires inline (a manual clock and d ≤ 0) would take
	// r.mu again; every delay here is at least 1 ns.
	r.timer = r.s.After(max(d, time.Nanosecond), r.step)
	if r.timer == nil { // the caller is shutting down
		r.over = true
	}
}

func (r *stepper) step() {
	r.mu.Lock()
	if r.over {
		r.mu.Unlock()
		return
	}
	if r.next >= len(r.items) { // nothing to send at all
		r.over = true
		final := r.rep
		r.mu.Unlock()
		r.done(final)
		return
	}
	start := r.next
	op := r.items[start].Op
	end := start
	for end < len(r.items) && end-start < r.s.BatchSize && r.items[end].Op == op {
		end++
	}
	r.next = end
	r.mu.Unlock()

	rep := send(context.Background(), r.s.Store, r.items[start:end], r.s.BatchSize, r.s.Timeout)

	r.mu.Lock()
	r.rep.Debited += rep.Debited
	r.rep.Returned += rep.Returned
	r.rep.Dropped += rep.Dropped
	r.rep.Batches += rep.Batches
	r.rep.Failed = append(r.rep.Failed, rep.Failed...)
	if r.next < len(r.items) && !r.over {
		r.scheduleLocked(r.s.Pace)
		r.mu.Unlock()
		return
	}
	finished := !r.over
	r.over = true
	final := r.rep
	r.mu.Unlock()
	if finished {
		r.done(final)
	}
}

func (r *stepper) cancel() []Item {
	r.mu.Lock()
	if r.over {
		r.mu.Unlock()
		return nil
	}
	r.over = true
	t := r.timer
	rest := append([]Item(nil), r.items[r.next:]...)
	r.mu.Unlock()
	if t != nil {
		t.Stop()
	}
	return rest
}

func (s Settler) withDefaults() Settler {
	if s.Clock == nil {
		s.Clock = clock.Real()
	}
	if s.BatchSize <= 0 {
		s.BatchSize = 256
	}
	if s.MaxJitter <= 0 {
		s.MaxJitter = 250 * time.Millisecond
	}
	if s.Pace <= 0 {
		s.Pace = 5 * time.Millisecond
	}
	if s.Timeout <= 0 {
		s.Timeout = time.Second
	}
	if s.After == nil {
		s.After = s.Clock.AfterFunc
	}
	if s.Jitter == nil {
		s.Jitter = func(max time.Duration) time.Duration { return time.Duration(rand.Int64N(int64(max) + 1)) }
	}
	return s
}
