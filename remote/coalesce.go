package remote

import (
	"context"
	"runtime"
	"slices"
	"sync"
)

// coalescer bounds a RedisStore's round trips in flight without a flush
// tick: a call that finds fewer than max on the wire goes out at once, as
// it would without the coalescer; a call that finds them all busy queues,
// and the first round trip to land hands the whole queue to one of its
// callers, who sends it as one pipeline. A lone call never waits for a
// batch, and no goroutine is started: the callers send.
type coalescer struct {
	single func(ctx context.Context, op Op, r Request) (Result, error)
	batch  func(ctx context.Context, calls []*queued)
	max    int

	mu     sync.Mutex
	flying int       // round trips on the wire, or handed to a caller to send
	queue  []*queued // calls waiting for a round trip
}

// queued is one call waiting in a coalescer.
type queued struct {
	ctx context.Context
	op  Op
	req Request
	res Result
	err error
	// next is set, under the coalescer's lock, when this caller is to
	// send these calls (its own among them).
	next  []*queued
	taken bool          // out of the queue, under the lock
	done  chan struct{} // one value: the result is in, or next is set
}

// call runs op on r: at once when a round trip is free, else in the next
// pipeline.
func (c *coalescer) call(ctx context.Context, op Op, r Request) (Result, error) {
	c.mu.Lock()
	if c.flying < c.max && len(c.queue) == 0 {
		c.flying++
		c.mu.Unlock()
		res, err := c.single(ctx, op, r)
		c.landed()
		return res, err
	}
	q := &queued{ctx: ctx, op: op, req: r, done: make(chan struct{}, 1)}
	c.queue = append(c.queue, q)
	c.mu.Unlock()
	select {
	case <-q.done:
	case <-ctx.Done():
		c.mu.Lock()
		if !q.taken {
			c.queue = slices.DeleteFunc(c.queue, func(o *queued) bool { return o == q })
			c.mu.Unlock()
			return Result{}, ctx.Err()
		}
		lead := q.next != nil
		c.mu.Unlock()
		if !lead {
			// In a pipeline another caller sends: its reply is dropped.
			return Result{}, ctx.Err()
		}
		<-q.done // the hand-over's signal; the others wait on this caller
	}
	if q.next != nil {
		c.send(q.next)
	}
	return q.res, q.err
}

// send sends calls as one pipeline, under the context of the one whose
// deadline is latest, delivers each reply, and hands the queue on.
func (c *coalescer) send(calls []*queued) {
	ctx := calls[0].ctx
	for _, q := range calls[1:] {
		ctx = later(ctx, q.ctx)
	}
	c.batch(ctx, calls)
	for _, q := range calls {
		if q.next == nil {
			q.done <- struct{}{}
		}
	}
	c.landed()
}

// landed frees a round trip: the queue, if any, goes to its first caller
// to send.
func (c *coalescer) landed() {
	c.mu.Lock()
	if len(c.queue) == 0 {
		c.flying--
		c.mu.Unlock()
		return
	}
	calls := c.queue
	c.queue = nil
	for _, q := range calls {
		q.taken = true
	}
	lead := calls[0]
	lead.next = calls
	c.mu.Unlock()
	lead.done <- struct{}{}
	// The next sender is readied on this P, to run when this goroutine
	// blocks; a caller that goes on deciding from leases may not block
	// for a whole time slice (10 ms), and every waiting call would wait
	// with it (measured: 2 runs in 3 at 16 goroutines took 4× as long).
	runtime.Gosched()
}

// later returns whichever of a and b may run longer: one not yet done,
// then one without a deadline, then the later deadline.
func later(a, b context.Context) context.Context {
	switch {
	case a.Err() != nil:
		return b
	case b.Err() != nil:
		return a
	}
	da, okA := a.Deadline()
	db, okB := b.Deadline()
	if okA && (!okB || db.After(da)) {
		return b
	}
	return a
}
