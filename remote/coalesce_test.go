package remote

import (
	"context"
	"errors"
	"github.com/leasehold/leasehold/internal/testkit/poll"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leasehold/leasehold/internal/testkit/spawn"
)

// fakeWire is a coalescer's round trips, counted: a single call or a
// pipeline answers each request with N granted, after gate (if any)
// lets it go.
type fakeWire struct {
	gate     chan struct{}
	singles  atomic.Int64
	batches  atomic.Int64
	piped    atomic.Int64 // calls sent in pipelines
	mu       sync.Mutex
	sizes    []int
	inFlight atomic.Int64
	most     atomic.Int64
	delay    func() time.Duration
}

func (f *fakeWire) wait() {
	n := f.inFlight.Add(1)
	for m := f.most.Load(); n > m && !f.most.CompareAndSwap(m, n); m = f.most.Load() {
	}
	if f.gate != nil {
		<-f.gate
	}
	if f.delay != nil {
		time.Sleep(f.delay()) // stands for the wire
	}
	f.inFlight.Add(-1)
}

func (f *fakeWire) coalescer(max int) *coalescer {
	return &coalescer{max: max,
		single: func(ctx context.Context, op Op, r Request) (Result, error) {
			f.singles.Add(1)
			f.wait()
			return Result{Granted: r.N}, ctx.Err()
		},
		batch: func(ctx context.Context, calls []*queued) {
			f.batches.Add(1)
			f.piped.Add(int64(len(calls)))
			f.mu.Lock()
			f.sizes = append(f.sizes, len(calls))
			f.mu.Unlock()
			f.wait()
			for _, q := range calls {
				q.res, q.err = Result{Granted: q.req.N}, ctx.Err()
			}
		}}
}

func queueLen(c *coalescer) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.queue)
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	poll.Until(t, what, 5*time.Second, cond)
}

// TestCoalescerLoneCallGoesAtOnce: with nothing on the wire a call is a
// single round trip; no pipeline, nothing waits.
func TestCoalescerLoneCallGoesAtOnce(t *testing.T) {
	f := &fakeWire{}
	c := f.coalescer(2)
	for i := range 3 {
		res, err := c.call(context.Background(), OpLease, Request{N: int64(i + 1)})
		if err != nil || res.Granted != int64(i+1) {
			t.Fatalf("call %d: %+v, %v", i, res, err)
		}
	}
	if f.singles.Load() != 3 || f.batches.Load() != 0 {
		t.Fatalf("%d single calls and %d pipelines, want 3 and 0", f.singles.Load(), f.batches.Load())
	}
}

// TestCoalescerPipelinesTheQueue: with the one round trip allowed busy,
// three calls wait; when it lands they go out as one pipeline, sent by a
// caller (no goroutine is started), each with its own reply, and a call
// whose context ends while it waits leaves the queue.
func TestCoalescerPipelinesTheQueue(t *testing.T) {
	f := &fakeWire{gate: make(chan struct{})}
	c := f.coalescer(1)
	var wg sync.WaitGroup
	results := make([]int64, 5)
	call := func(i int, ctx context.Context) {
		defer wg.Done()
		res, err := c.call(ctx, OpLease, Request{N: int64(i + 1)})
		if err == nil {
			results[i] = res.Granted
		}
	}
	wg.Add(1)
	go call(0, context.Background())
	waitFor(t, "the first call on the wire", func() bool { return f.inFlight.Load() == 1 })
	gone, cancel := context.WithCancel(context.Background())
	for i := 1; i <= 4; i++ {
		ctx := context.Background()
		if i == 2 {
			ctx = gone
		}
		wg.Add(1)
		go call(i, ctx)
		waitFor(t, "the call to queue", func() bool { return queueLen(c) == i })
	}
	cancel()
	waitFor(t, "the cancelled call to leave", func() bool { return queueLen(c) == 3 })
	before := spawn.Count()
	close(f.gate)
	wg.Wait()
	if started := spawn.Count() - before; started != 0 {
		t.Errorf("%d goroutines started to send the pipeline, want 0", started)
	}
	if f.singles.Load() != 1 || f.batches.Load() != 1 || f.sizes[0] != 3 {
		t.Fatalf("%d single calls, %d pipelines of %v, want 1 and one of 3", f.singles.Load(), f.batches.Load(), f.sizes)
	}
	if want := []int64{1, 2, 0, 4, 5}; !slices.Equal(results, want) {
		t.Fatalf("granted %v, want %v (the cancelled call gets nothing)", results, want)
	}
	if c.flying != 0 || len(c.queue) != 0 {
		t.Fatalf("after the last landed: %d on the wire, %d queued", c.flying, len(c.queue))
	}
}

// TestCoalescerUnderLoad: 64 callers, a quarter of them with contexts
// that end at random, on a wire of 0–200 µs round trips. Every call
// returns its own reply or its context's error, never more than max
// round trips are on the wire, and everything drains.
func TestCoalescerUnderLoad(t *testing.T) {
	f := &fakeWire{delay: func() time.Duration { return time.Duration(rand.IntN(200)) * time.Microsecond }}
	const max = 3
	c := f.coalescer(max)
	var wg sync.WaitGroup
	var wrong, cancelled atomic.Int64
	for g := range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 200 {
				ctx, cancel := context.Background(), context.CancelFunc(func() {})
				if g%4 == 0 {
					ctx, cancel = context.WithTimeout(ctx, time.Duration(rand.IntN(300))*time.Microsecond)
				}
				n := int64(g*1000 + i)
				res, err := c.call(ctx, OpLease, Request{N: n})
				cancel()
				switch {
				case errors.Is(err, context.DeadlineExceeded):
					cancelled.Add(1)
				case err != nil || res.Granted != n:
					wrong.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	t.Logf("%d single calls, %d pipelines carrying %d calls, %d ended by their context, at most %d on the wire",
		f.singles.Load(), f.batches.Load(), f.piped.Load(), cancelled.Load(), f.most.Load())
	if wrong.Load() != 0 {
		t.Fatalf("%d calls got another call's reply or an error", wrong.Load())
	}
	if f.most.Load() > max {
		t.Fatalf("%d round trips on the wire at once, want at most %d", f.most.Load(), max)
	}
	if f.batches.Load() == 0 {
		t.Fatal("no pipeline under load")
	}
	if c.flying != 0 || len(c.queue) != 0 {
		t.Fatalf("after the last call: %d on the wire, %d queued", c.flying, len(c.queue))
	}
}
