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
	cur      atomic.Pointer[shared]
}

// shared is one context and until when it is handed out (nanoseconds
// since base, monotonic).
type shared struct {
	ctx    context.Context
	cancel context.CancelFunc // kept for vet; the deadline or parent ends it
	until  int64
}

var base = time.Now()

// NewDeadlines returns Deadlines of d under parent; slack must be positive
// and is small against d.
func NewDeadlines(parent context.Context, d, slack time.Duration) *Deadlines {
	return &Deadlines{parent: parent, d: d, slack: slack}
}

// Context returns a context that ends between d and d+slack from now, or
// when the parent ends.
func (s *Deadlines) Context() context.Context {
	now := int64(time.Since(base))
	if c := s.cur.Load(); c != nil && now < c.until {
		return c.ctx
	}
	ctx, cancel := context.WithTimeout(s.parent, s.d+s.slack)
	// Two callers may both make one: each uses its own, the later stays.
	s.cur.Store(&shared{ctx: ctx, cancel: cancel, until: now + int64(s.slack)})
	return ctx
}
