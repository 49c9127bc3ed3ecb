package hybrid

import (
	"github.com/leasehold/leasehold/internal/background"
	"testing"
	"time"

	"github.com/leasehold/leasehold/clock"
)

// countingDepositor counts what a pacer deposits and gives back.
type countingDepositor struct{ deposited, given int64 }

func (c *countingDepositor) deposit(_ *entry, n int64, _, _ mono) { c.deposited += n }
func (c *countingDepositor) giveBack(_ *entry, n int64)           { c.given += n }

// TestPacerNeverDeliversTwice: a release timer that read the clock before
// catchUp delivered with a later time must not move delivered back (the
// tokens would be deposited twice: under load this admitted over the
// exact bound).
func TestPacerNeverDeliversTwice(t *testing.T) {
	clk := clock.NewManual(t0)
	cfg := &config{clk: clk, epoch: t0}
	bg := background.New(clk)
	defer func() { bg.Close(); bg.Wait() }()
	stats := newCounters()
	into := &countingDepositor{}
	pc := pacer{cfg: cfg, bg: bg, stats: &stats, into: into}
	e := newEntry("k")
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
// whole ends at once, its timer stopped, so no callback (and no goroutine)
// runs for it; one they took in part is still released whole at its end.
func TestPacerEndsWhatCatchUpDelivers(t *testing.T) {
	clk := clock.NewManual(t0)
	cfg := &config{clk: clk, epoch: t0}
	bg := background.New(clk)
	stats := newCounters()
	into := &countingDepositor{}
	pc := pacer{cfg: cfg, bg: bg, stats: &stats, into: into}
	lim := Limit{Rate: 20, Period: time.Second, Burst: 20} // 50 ms a token
	whole, part := newEntry("whole"), newEntry("part")
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
	// Had the stopped timer's callback run, it would find the reservation
	// gone and end the background work a second time: Wait panics.
	clk.Advance(time.Second)
	if into.deposited != 20 {
		t.Fatalf("deposited %d after both ended, want 20", into.deposited)
	}
	bg.Close()
	bg.Wait()
}
