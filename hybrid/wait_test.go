package hybrid

import (
	"context"
	"errors"
	"testing"
	"time"
)

// TestWaitSleepsExactlyRetryAfter: on an exhausted key Wait blocks until the
// clock reaches the next token and not a tick earlier.
func TestWaitSleepsExactlyRetryAfter(t *testing.T) {
	t.Parallel()
	w := newFakeWorld()
	p := Policy{Name: "wait", Limit: Limit{Rate: 1, Period: time.Second, Burst: 1}}
	l := w.limiter(t, p, WithMaxReservation(0))
	ctx := context.Background()
	if !l.Allow(ctx, "k") {
		t.Fatal("first Allow rejected")
	}
	// The first Allow's refill may still arm timers of its own: count the
	// limiter's timers once it is done (a fresh-clone make test once saw
	// Pending rise for such a timer, not Wait's, and Wait never woke).
	quiesce(t, l)
	background := w.clk.Pending() // the limiter's own ticks
	done := make(chan error, 1)
	go func() { done <- l.Wait(ctx, "k") }()
	// Wait has asked the store, learned "empty for 1 s", and set a timer.
	eventually(t, "Wait to sleep", func() bool { return w.clk.Pending() > background })
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
