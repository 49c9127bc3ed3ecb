package lease

import (
	"math/rand/v2"
	"sync/atomic"
	"testing"
)

// TestAddDecayingTable: a decaying lease holds at most (end − now)/step
// tokens at now; a grant added while tokens are spendable shares a line
// with them (the old lifted by the new tokens, at most the new), or one
// of the two is dropped, whichever leaves the most token-time; decayed
// tokens are dropped by the take that finds them.
func TestAddDecayingTable(t *testing.T) {
	t.Parallel()
	const step = 10
	steps := []struct {
		op          string
		n, at, arg  int64 // tokens, now, end (add)
		wantOK      bool
		wantLeft    int64
		wantEnd     int64
		wantDropped int64 // by the add, or decayed by the take
	}{
		{"add", 5, 0, 100, true, 5, 100, 0},   // line 10 at 0: all 5 live
		{"take", 2, 50, 0, true, 3, 100, 0},   // line 5 at 50
		{"take", 1, 80, 0, true, 1, 100, 1},   // line 2 at 80: 1 decayed
		{"take", 1, 100, 0, false, 1, 100, 0}, // line 0 at 100
		{"add", 4, 100, 300, true, 4, 300, 1}, // the decayed one dropped
		// Old line 15 high at 150, new 25: the old lifted by the 2 new,
		// min(300 + 2·10, 400). Token-steps: 84 for both, 48 for the
		// new alone.
		{"add", 2, 150, 400, true, 6, 320, 0},
		// A new line 4 high under an old 12 high: the old 6 alone (54)
		// beat both under 240 (8) and the new alone (7.5).
		{"add", 3, 200, 240, true, 6, 320, 3},
		// The old line is 2 high at 300: the new 10 under 500 (150) beat
		// both under 420 (72).
		{"add", 10, 300, 500, true, 10, 500, 6},
		{"take", 10, 380, 0, true, 0, 500, 0}, // line 12 at 380
		{"add", 3, 400, 500, true, 3, 500, 0}, // an empty lease takes the new line
		// Both under min(500 + 20, 600) (47.5) beat the new alone (38)
		// and the old alone (25.5).
		{"add", 2, 400, 600, true, 5, 520, 0},
		{"take", 5, 470, 0, true, 0, 520, 0}, // line 5 at 470
		{"take", 1, 520, 0, false, 0, 520, 0},
	}
	var c Cell
	for i, s := range steps {
		var ok bool
		var dropped int64
		switch s.op {
		case "add":
			ok, dropped = c.AddDecaying(s.n, s.arg, s.at, step)
		case "take":
			ok, _, dropped = c.TakeDecaying(s.n, s.at)
		}
		if ok != s.wantOK || c.Tokens() != s.wantLeft || c.Expiry() != s.wantEnd || dropped != s.wantDropped {
			t.Errorf("step %d: %s(%d) at %d = ok %v, left %d, end %d, dropped %d; want %v, %d, %d, %d",
				i, s.op, s.n, s.at, ok, c.Tokens(), c.Expiry(), dropped, s.wantOK, s.wantLeft, s.wantEnd, s.wantDropped)
		}
	}
	c.Close()
	if ok, _ := c.AddDecaying(1, 1000, 500, step); ok {
		t.Fatal("AddDecaying after Close = true, want false")
	}
}

// TestTakeDecayingKeepsToItsLines races takers against a serialized
// writer that adds tokens under random lines and drains: no take leaves
// more spendable than the lines the writer set allow at its time (each
// line's height then, summed over lines still above zero), and every token
// added is taken, decayed, dropped or drained once.
func TestTakeDecayingKeepsToItsLines(t *testing.T) {
	t.Parallel()
	const step = 3
	var c Cell
	var clock atomic.Int64
	var added, taken, gone atomic.Int64
	var over atomic.Int64 // takes beyond what every line set so far allows
	var maxEnd atomic.Int64
	stop := takers(6, func(g int) {
		n, now := 1+int64(g%3), clock.Load()
		ok, left, decayed := c.TakeDecaying(n, now)
		gone.Add(decayed)
		if ok {
			taken.Add(n)
			// What is left plus what was taken fits under the latest
			// end any line had, the loosest bound a writer allowed.
			if left+n > max(maxEnd.Load()-now, 0)/step {
				over.Add(1)
			}
		}
	})
	rng := rand.New(rand.NewPCG(3, 4))
	for range 20000 {
		now := clock.Add(rng.Int64N(5))
		if rng.IntN(3) == 0 {
			gone.Add(c.DrainExpired(now))
			continue
		}
		end := now + rng.Int64N(40)
		maxEnd.Store(max(maxEnd.Load(), end))
		if ok, d := c.AddDecaying(4, end, now, step); ok {
			added.Add(4)
			gone.Add(d)
		}
	}
	stop()
	gone.Add(c.Close())
	if got, want := taken.Load()+gone.Load(), added.Load(); got != want {
		t.Fatalf("taken %d + dropped, decayed or drained %d = %d, want added %d", taken.Load(), gone.Load(), got, want)
	}
	if over.Load() != 0 {
		t.Fatalf("%d takes above every line set", over.Load())
	}
	if taken.Load() == 0 {
		t.Fatal("nothing taken: the race tested nothing")
	}
}

func TestTakeDecayingAllocatesNothing(t *testing.T) {
	var c Cell
	c.AddDecaying(1<<40, 1<<62, 0, 1)
	if a := testing.AllocsPerRun(1000, func() { c.TakeDecaying(1, 1) }); a != 0 {
		t.Fatalf("Cell.TakeDecaying allocates %v per call, want 0", a)
	}
}
