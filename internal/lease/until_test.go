package lease

import (
	"math/rand/v2"
	"sync/atomic"
	"testing"
)

// TestAddDecayingTable: a decaying lease holds at most (end − now)/step
// tokens at now; a grant added while tokens are spendable shares one line
// with them (either's lifted by the other's tokens, at most the other's
// line), or one of the two is dropped when it is worth more alone to an
// owner spending use tokens per token the line falls; decayed tokens are
// dropped by the take that finds them. An add says whether the new tokens
// are all the cell holds.
func TestAddDecayingTable(t *testing.T) {
	t.Parallel()
	const step = 10
	steps := []struct {
		op          string
		n, at, arg  int64 // tokens, now, end (add)
		use         float64
		wantOK      bool
		wantLeft    int64
		wantEnd     int64
		wantDropped int64 // by the add, or decayed by the take
	}{
		{"add", 5, 0, 100, 1, true, 5, 100, 0},   // line 10 at 0: all 5 live
		{"take", 2, 50, 0, 0, true, 3, 100, 0},   // line 5 at 50
		{"take", 1, 80, 0, 0, true, 1, 100, 1},   // line 2 at 80: 1 decayed
		{"take", 1, 100, 0, 0, false, 1, 100, 0}, // line 0 at 100
		{"add", 4, 100, 300, 1, true, 4, 300, 1}, // the decayed one dropped
		// Old line 15 high at 150, new 25: the old lifted by the 2 new,
		// min(300 + 2·10, 400).
		{"add", 2, 150, 400, 1, true, 6, 320, 0},
		// A new line 4 high under an old 12 high: the new lifted by the
		// 6 old, min(240 + 6·10, 320).
		{"add", 3, 200, 240, 1, true, 9, 300, 0},
		{"take", 5, 250, 0, 0, true, 0, 300, 4},  // line 5 at 250: 4 decayed
		{"add", 3, 260, 500, 1, true, 3, 500, 0}, // an empty lease takes the new line
		{"add", 1, 270, 290, 1, true, 4, 320, 0}, // max(min(500 + 10, 290), min(290 + 30, 500))
		// The old line 2 high at 300 holds 2 of 4: lifted by the 10 new.
		{"add", 10, 300, 700, 1, true, 12, 420, 2},
		{"take", 12, 300, 0, 0, true, 0, 420, 0},
		{"take", 1, 420, 0, 0, false, 0, 420, 0},
		{"add", 5, 430, 450, 1, true, 5, 450, 0},
		// An owner spending a tenth of the line's fall: the new 5 alone
		// under a line 46 high (worth 4.6) beat both under 500 (0.6);
		// the old line held 1 of 5.
		{"add", 5, 440, 900, 0.1, true, 5, 900, 5},
	}
	var c Cell
	for i, s := range steps {
		var ok, alone bool
		var dropped int64
		switch s.op {
		case "add":
			ok, dropped, alone = c.AddDecaying(s.n, s.arg, s.at, step, s.use)
			// In this table the new tokens are alone exactly when the
			// cell is left holding as many.
			if want := s.wantLeft == s.n; alone != want {
				t.Errorf("step %d: add(%d) at %d says alone %v, want %v", i, s.n, s.at, alone, want)
			}
		case "take":
			ok, _, dropped = c.TakeDecaying(s.n, s.at)
		}
		if ok != s.wantOK || c.Tokens() != s.wantLeft || c.Expiry() != s.wantEnd || dropped != s.wantDropped {
			t.Errorf("step %d: %s(%d) at %d = ok %v, left %d, end %d, dropped %d; want %v, %d, %d, %d",
				i, s.op, s.n, s.at, ok, c.Tokens(), c.Expiry(), dropped, s.wantOK, s.wantLeft, s.wantEnd, s.wantDropped)
		}
	}
	c.Close()
	if ok, _, _ := c.AddDecaying(1, 1000, 500, step, 1); ok {
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
	// At least 20 000 writes, and on until the takers have taken some.
	for i := 0; i < 20000 || (taken.Load() < 1000 && i < 1e7); i++ {
		now := clock.Add(rng.Int64N(5))
		if rng.IntN(3) == 0 {
			gone.Add(c.DrainExpired(now))
			continue
		}
		end := now + rng.Int64N(40)
		maxEnd.Store(max(maxEnd.Load(), end))
		if ok, d, _ := c.AddDecaying(4, end, now, step, rng.Float64()); ok {
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
	c.AddDecaying(1<<40, 1<<62, 0, 1, 1)
	if a := testing.AllocsPerRun(1000, func() { c.TakeDecaying(1, 1) }); a != 0 {
		t.Fatalf("Cell.TakeDecaying allocates %v per call, want 0", a)
	}
}

// TestAddDecayingWithinTwoLines: a cell that joined tokens under one line
// (eff under a) with a grant under another (n under b) never holds more
// than the two lines would apart, spent in one order fixed from the join
// (the old first or the new first), whatever is taken and when.
func TestAddDecayingWithinTwoLines(t *testing.T) {
	t.Parallel()
	const step = 10
	rng := rand.New(rand.NewPCG(5, 6))
	joined := 0
	for run := range 20000 {
		var c Cell
		eff, a := 1+rng.Int64N(20), rng.Int64N(400)
		c.AddDecaying(eff, a, 0, step, 1)
		now := rng.Int64N(100)
		n, b := 1+rng.Int64N(20), now+rng.Int64N(400)
		c.AddDecaying(n, b, now, step, rng.Float64())
		join := now
		if c.Tokens() > n {
			joined++
		}
		// The two lines apart, spent old first (0) or new first (1).
		type seg struct{ x, end int64 }
		ideal := [2][2]seg{{{eff, a}, {n, b}}, {{n, b}, {eff, a}}}
		held := func(s *seg, at int64) int64 {
			s.x = min(s.x, max(s.end-at, 0)/step) // decayed tokens are gone
			return s.x
		}
		var over [2]bool
		for range 20 {
			now += rng.Int64N(30)
			k := 1 + rng.Int64N(3)
			ok, _, _ := c.TakeDecaying(k, now)
			for o := range ideal {
				s := &ideal[o]
				if ok {
					for i, left := 0, k; i < 2 && left > 0; i++ {
						d := min(left, held(&s[i], now))
						s[i].x -= d
						left -= d
					}
				}
				if c.Spendable(now) > held(&s[0], now)+held(&s[1], now) {
					over[o] = true
				}
			}
			if over[0] && over[1] {
				t.Fatalf("run %d: eff %d under %d joined with %d under %d at %d: at %d the cell holds %d, more than either order allows",
					run, eff, a, n, b, join, now, c.Spendable(now))
			}
		}
	}
	if joined == 0 {
		t.Fatal("no join kept both: the test tested nothing")
	}
	t.Logf("%d of 20000 joins kept both", joined)
}
