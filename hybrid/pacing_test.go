package hybrid

import (
	"fmt"
	"github.com/leasehold/leasehold/internal/background"
	"testing"
	"time"

	"github.com/leasehold/leasehold/clock"
)

// countingDepositor counts what a pacer deposits and gives back.
type countingDepositor struct{ deposited, given int64 }

func (c *countingDepositor) deposit(_ *account, n int64, _, _ mono) { c.deposited += n }
func (c *countingDepositor) giveBack(_ *account, n int64)           { c.given += n }

// newTestPacer returns a pacer on a manual clock that counts what it
// deposits and gives back.
func newTestPacer() (*clock.Manual, *config, *background.Group, *countingDepositor, *pacer) {
	clk := clock.NewManual(t0)
	cfg := &config{clk: clk, epoch: t0}
	bg := background.New(clk)
	stats := newCounters()
	into := &countingDepositor{}
	return clk, cfg, bg, into, &pacer{cfg: cfg, bg: bg, stats: &stats, into: into}
}

// TestPacerNeverDeliversTwice: a release timer that read the clock before
// catchUp delivered with a later time must not move delivered back (the
// tokens would be deposited twice: under load this admitted over the
// exact bound).
func TestPacerNeverDeliversTwice(t *testing.T) {
	clk, cfg, bg, into, pc := newTestPacer()
	defer func() { bg.Close(); bg.Wait() }()
	e := newAccount("k")
	lim := Limit{Rate: 20, Period: time.Second, Burst: 20} // 50 ms a token
	pc.reserve(e, lim, 10, 500*time.Millisecond, cfg.now(), cfg.now()+mono(time.Second))
	// A decision that read the clock at t0+300 ms catches up before the
	// timers that are due earlier have run; they then run with earlier
	// times than the one delivered for.
	if !pc.catchUp(e, cfg.now()+mono(300*time.Millisecond)) {
		t.Fatal("catchUp at t0+300 ms delivered nothing")
	}
	early := into.deposited
	for range 20 {
		clk.Advance(50 * time.Millisecond)
	}
	if into.deposited != 10 || early == 0 {
		t.Fatalf("deposited %d of a 10-token reservation (%d by catchUp), want exactly 10", into.deposited, early)
	}
}

// TestPacerEndsWhatCatchUpDelivers: a reservation that decisions took
// whole ends at once, so the timer finds nothing of it to release; one
// they took in part is still released whole after its end.
func TestPacerEndsWhatCatchUpDelivers(t *testing.T) {
	clk, cfg, bg, into, pc := newTestPacer()
	lim := Limit{Rate: 20, Period: time.Second, Burst: 20} // 50 ms a token
	whole, part := newAccount("whole"), newAccount("part")
	pc.reserve(whole, lim, 10, 500*time.Millisecond, cfg.now(), cfg.now()+mono(time.Second))
	pc.reserve(part, lim, 10, 500*time.Millisecond, cfg.now(), cfg.now()+mono(time.Second))
	if !pc.catchUp(whole, cfg.now()+mono(500*time.Millisecond)) || !pc.catchUp(part, cfg.now()+mono(300*time.Millisecond)) {
		t.Fatal("catchUp delivered nothing of a reservation due")
	}
	rs := &whole.extra().pace
	rs.mu.Lock()
	left := len(rs.list)
	rs.mu.Unlock()
	if left != 0 || rs.held.Load() != 0 || rs.next.Load() != 0 {
		t.Fatalf("a reservation delivered whole is still pending: %d listed, %d held", left, rs.held.Load())
	}
	if into.deposited != 10+5 {
		t.Fatalf("deposited %d, want 10 of the whole one and 5 of the other by t0+300 ms (the 6th is due just after)", into.deposited)
	}
	// Had the timer released the ended one, it would end the background
	// work a second time: Wait panics.
	clk.Advance(time.Second)
	if into.deposited != 20 {
		t.Fatalf("deposited %d after both ended, want 20", into.deposited)
	}
	bg.Close()
	bg.Wait()
}

// TestPacerOneTimerForManyEnds: reservations of many keys share one
// timer (a timer each ran a goroutine each), which releases what no
// decision took once each has ended, never before its end and at most
// paceTick after it.
func TestPacerOneTimerForManyEnds(t *testing.T) {
	clk, cfg, bg, into, pc := newTestPacer()
	lim := Limit{Rate: 20, Period: time.Second, Burst: 20} // 50 ms a token
	const keys = 50
	for i := range keys {
		// Ends 1 ms apart, from 100 ms on, queued in reverse order.
		delay := time.Duration(100+keys-1-i) * time.Millisecond
		pc.reserve(newAccount(fmt.Sprint("k", i)), lim, 2, delay, cfg.now(), cfg.now()+mono(time.Second))
	}
	if n := clk.Pending(); n != 1 {
		t.Fatalf("%d timers pending for %d reservations, want 1", n, keys)
	}
	fires := 0
	for step := time.Duration(0); step < 200*time.Millisecond; step += time.Millisecond {
		before := into.deposited
		clk.Advance(time.Millisecond)
		if into.deposited > before {
			fires++
		}
		elapsed := step + time.Millisecond
		// Ended by now: those with end ≤ elapsed, 2 tokens each.
		ended := int64(max(min(elapsed-100*time.Millisecond+time.Millisecond, keys*time.Millisecond), 0) / time.Millisecond)
		lagging := int64(max(min(elapsed-100*time.Millisecond-paceTick+time.Millisecond, keys*time.Millisecond), 0) / time.Millisecond)
		if into.deposited > 2*ended || into.deposited < 2*lagging {
			t.Fatalf("at +%v deposited %d, want between %d (ended a tick ago) and %d (ended)", elapsed, into.deposited, 2*lagging, 2*ended)
		}
	}
	if into.deposited != 2*keys {
		t.Fatalf("deposited %d, want %d", into.deposited, 2*keys)
	}
	// One run per paceTick (10 ms) over 50 ms of ends: 6 at most. A run
	// per end would be 50.
	if fires > 6 {
		t.Fatalf("the timer released tokens %d times for ends over %v, want at most 6", fires, keys*time.Millisecond)
	}
	bg.Close()
	bg.Wait()
}

// TestPacerStopCancelsQueued: Close stops the timer and gives back what
// reservations still queued (one a flight made after its key's
// reservations were cancelled, one queued after stop) had not released,
// so waiting for the background ends at once.
func TestPacerStopCancelsQueued(t *testing.T) {
	clk, cfg, bg, into, pc := newTestPacer()
	lim := Limit{Rate: 20, Period: time.Second, Burst: 20}
	pc.reserve(newAccount("queued"), lim, 10, 500*time.Millisecond, cfg.now(), cfg.now()+mono(time.Second))
	// A flight that entered the background before Close queues its
	// reservation after stop.
	if !bg.Enter() {
		t.Fatal("background closed")
	}
	late := newAccount("late")
	r := &reservation{n: 4, end: cfg.now() + mono(500*time.Millisecond), step: tokenStep(lim)}
	rs := &late.extra().pace
	rs.mu.Lock()
	rs.addLocked(r)
	rs.mu.Unlock()
	bg.Close()
	pc.stop()
	pc.wait(pending{late, r}, cfg.now())
	done := make(chan struct{})
	go func() { bg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("background still busy after stop: a queued reservation kept its unit")
	}
	if into.given != 14 || into.deposited != 0 || clk.Pending() != 0 {
		t.Fatalf("gave back %d and deposited %d with %d timers pending, want 14 given back, none deposited, none pending", into.given, into.deposited, clk.Pending())
	}
}
