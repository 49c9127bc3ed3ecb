package hybrid

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leasehold/leasehold/clock"
)

// TestWaitSleepsExactlyRetryAfter: on an exhausted key Wait blocks until the
// clock reaches the next token and not a tick earlier.
func TestWaitSleepsExactlyRetryAfter(t *testing.T) {
	t.Parallel()
	w := newFakeWorld()
	p := Policy{Name: "wait", Limit: Limit{Rate: 1, Period: time.Second, Burst: 1}}
	spy := &newTimerSpy{Manual: w.clk}
	l := w.limiter(t, p, WithMaxReservation(0), WithClock(spy))
	ctx := context.Background()
	if !l.Allow(ctx, "k") {
		t.Fatal("first Allow rejected")
	}
	done := make(chan error, 1)
	go func() { done <- l.Wait(ctx, "k") }()
	// Wait has asked the store, learned "empty for 1 s", and set its
	// timer: the only one of a second made by NewTimer (the background's
	// are AfterFuncs, a store call's deadline is shorter). Counting
	// timers of every kind once mistook another for Wait's: the clock
	// moved while Wait decided, and its timer fell past the advances.
	eventually(t, "Wait to sleep", func() bool { return spy.made.Load() > 0 })
	w.clk.Advance(999 * time.Millisecond)
	select {
	case err := <-done:
		t.Fatalf("Wait returned %v after 999ms, want to block until 1s", err)
	case <-time.After(20 * time.Millisecond): // a negative check needs some real time
	}
	w.clk.Advance(time.Millisecond)
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Wait = %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Wait did not return once the token was due")
	}
}

// newTimerSpy is a manual clock that counts the timers of a second or
// more NewTimer made.
type newTimerSpy struct {
	*clock.Manual
	made atomic.Int32
}

func (s *newTimerSpy) NewTimer(d time.Duration) clock.Timer {
	if d >= time.Second {
		s.made.Add(1)
	}
	return s.Manual.NewTimer(d)
}

func TestWaitHonoursContext(t *testing.T) {
	t.Parallel()
	w := newFakeWorld()
	l := w.limiter(t, Policy{Name: "waitctx", Limit: Limit{Rate: 1, Period: time.Hour, Burst: 1}})
	ctx, cancel := context.WithCancel(context.Background())
	if !l.Allow(ctx, "k") {
		t.Fatal("first Allow rejected")
	}
	done := make(chan error, 1)
	go func() { done <- l.Wait(ctx, "k") }()
	cancel()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("Wait = %v, want context.Canceled", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Wait ignored cancellation")
	}
	if err := l.WaitN(ctx, "k", 0); !errors.Is(err, ErrInvalidN) {
		t.Fatalf("WaitN(0) = %v, want ErrInvalidN", err)
	}
}
