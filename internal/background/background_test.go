package background

import (
	"testing"
	"time"

	"github.com/leasehold/leasehold/clock"
)

// TestTickAfterAndClose: ticks and callbacks run in virtual time on a
// manual clock, never inside the call that schedules them (for d > 0);
// after Close nothing new runs and Done is closed.
func TestTickAfterAndClose(t *testing.T) {
	clk := clock.NewManual(time.Unix(0, 0))
	g := New(clk)
	ticks, afters := 0, 0
	g.Tick(0, time.Second, func() { ticks++ })
	g.After(time.Nanosecond, func() { afters++ })
	if ticks != 0 || afters != 0 {
		t.Fatalf("ran inside the call: %d ticks, %d afters", ticks, afters)
	}
	clk.Advance(2500 * time.Millisecond)
	if ticks != 3 || afters != 1 {
		t.Fatalf("after 2.5 s: %d ticks (want 3: at 1 ns, 1 s, 2 s), %d afters (want 1)", ticks, afters)
	}
	if !g.Close() || g.Close() {
		t.Fatal("Close reports the first close only")
	}
	g.Wait()
	select {
	case <-g.Done:
	default:
		t.Fatal("Done not closed by Close")
	}
	if g.After(time.Nanosecond, func() { afters++ }) != nil || g.Enter() {
		t.Fatal("work accepted after Close")
	}
	clk.Advance(5 * time.Second)
	if ticks != 3 || afters != 1 {
		t.Fatalf("ran after Close: %d ticks, %d afters", ticks, afters)
	}
}
