package background

import (
	"context"
	"sync/atomic"
	"time"
)

// Deadlines hands out contexts for store calls that end at least d and at
// most d+slack after they were handed out: calls that start within one
// slack share a context, so that a call does not arm and stop a timer of
// its own (context.WithTimeout and its cancel were 13% of a cold store
// flight's CPU outside the store call, measured on the Zipf benchmark).
// The deadline is real time, as a context's is: with a manual clock the
// contexts still end.
type Deadlines struct {
	parent   context.Context
	d, slack time.Duration
	cur      atomic.Pointer[Shared]
}

// Shared is a context lent to store calls; each call gives it back with
// Done. Once it is no longer handed out and its last call is done it is
// cancelled, which stops its deadline timer: a deadline that fires runs
// in a goroutine of its own, and one context per slack reaching its
// deadline was half the goroutines a cold Zipf benchmark started.
type Shared struct {
	ctx    context.Context
	cancel context.CancelFunc
	until  int64        // handed out until then (nanoseconds since base, monotonic)
	users  atomic.Int64 // calls holding it, plus 1 while it is handed out
}

var base = time.Now()

// NewDeadlines returns Deadlines of d under parent; slack must be positive
// and is small against d.
func NewDeadlines(parent context.Context, d, slack time.Duration) *Deadlines {
	return &Deadlines{parent: parent, d: d, slack: slack}
}

// Take lends a context that ends between d and d+slack from now, or when
// the parent ends; the caller gives it back with Done when its call
// returns.
func (s *Deadlines) Take() *Shared {
	now := int64(time.Since(base))
	if c := s.cur.Load(); c != nil && now < c.until && c.join() {
		return c
	}
	ctx, cancel := context.WithTimeout(s.parent, s.d+s.slack)
	c := &Shared{ctx: ctx, cancel: cancel, until: now + int64(s.slack)}
	c.users.Store(2) // handed out, and this call
	// Two callers may both make one: each uses its own, the later stays.
	if old := s.cur.Swap(c); old != nil {
		old.Done() // no longer handed out
	}
	return c
}

// join counts one more call on c unless c is already cancelled.
func (c *Shared) join() bool {
	for u := c.users.Load(); u > 0; u = c.users.Load() {
		if c.users.CompareAndSwap(u, u+1) {
			return true
		}
	}
	return false
}

// Context is the lent context.
func (c *Shared) Context() context.Context { return c.ctx }

// Done gives c back.
func (c *Shared) Done() {
	if c.users.Add(-1) == 0 {
		c.cancel()
	}
}
