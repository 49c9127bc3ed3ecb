package lease

import (
	"math/rand/v2"
	"sync/atomic"
	"testing"
)

// TestTakeLiveTable: TakeLive spends only before the lease's expiry;
// what is left then waits for DrainExpired.
func TestTakeLiveTable(t *testing.T) {
	t.Parallel()
	steps := []struct {
		op          string
		n, at, arg  int64 // tokens, now, expiry (add)
		wantOK      bool
		wantLeft    int64
		wantDrained int64
	}{
		{"add", 5, 0, 100, true, 5, 0},
		{"take", 2, 50, 0, true, 3, 0},
		{"take", 4, 60, 0, false, 3, 0}, // too few, not expired
		{"take", 1, 99, 0, true, 2, 0},
		{"take", 1, 100, 0, false, 0, 0}, // expired: nothing spendable
		{"drain", 0, 100, 0, true, 0, 2}, // the 2 left drained
		{"add", 3, 110, 200, true, 3, 0},
		{"drain", 0, 150, 0, true, 3, 0}, // not expired: nothing drained
		{"take", 9, 250, 0, false, 0, 0},
	}
	var c Cell
	for i, s := range steps {
		switch s.op {
		case "add":
			if ok := c.Add(s.n, s.arg); ok != s.wantOK || c.Tokens() != s.wantLeft {
				t.Fatalf("step %d: Add = %v with %d held, want %v with %d", i, ok, c.Tokens(), s.wantOK, s.wantLeft)
			}
		case "take":
			ok, left := c.TakeLive(s.n, s.at)
			if ok != s.wantOK || left != s.wantLeft {
				t.Fatalf("step %d: TakeLive(%d, %d) = %v, %d left; want %v, %d", i, s.n, s.at, ok, left, s.wantOK, s.wantLeft)
			}
		case "drain":
			if got := c.DrainExpired(s.at); got != s.wantDrained {
				t.Fatalf("step %d: DrainExpired(%d) = %d, want %d", i, s.at, got, s.wantDrained)
			}
		}
		if got := c.Spendable(s.at); s.op == "take" && got != s.wantLeft {
			t.Fatalf("step %d: Spendable(%d) = %d, want %d", i, s.at, got, s.wantLeft)
		}
	}
	c.Close()
	if ok, _ := c.TakeLive(1, 0); ok {
		t.Fatal("TakeLive after Close = true, want false")
	}
}

// TestTakeLiveAccountsForEveryToken: with takers racing adds and
// expiries, every token added is taken or drained once, and no take
// succeeds on a lease whose every expiry so far has passed.
func TestTakeLiveAccountsForEveryToken(t *testing.T) {
	t.Parallel()
	var c Cell
	var clock atomic.Int64
	var added, taken, gone, late atomic.Int64
	var maxEnd atomic.Int64
	stop := takers(6, func(g int) {
		n, now := 1+int64(g%3), clock.Load()
		if ok, _ := c.TakeLive(n, now); ok {
			taken.Add(n)
			if now >= maxEnd.Load() {
				late.Add(1)
			}
		}
	})
	rng := rand.New(rand.NewPCG(3, 4))
	for i := 0; i < 20000 || (taken.Load() < 1000 && i < 1e7); i++ {
		now := clock.Add(rng.Int64N(5))
		if rng.IntN(3) == 0 {
			gone.Add(c.DrainExpired(now))
			continue
		}
		end := now + rng.Int64N(40)
		maxEnd.Store(max(maxEnd.Load(), end))
		if c.Add(4, end) {
			added.Add(4)
		}
	}
	stop()
	gone.Add(c.Close())
	if got, want := taken.Load()+gone.Load(), added.Load(); got != want {
		t.Fatalf("taken %d + drained %d = %d, want added %d", taken.Load(), gone.Load(), got, want)
	}
	if late.Load() != 0 {
		t.Fatalf("%d takes past every expiry set", late.Load())
	}
	if taken.Load() == 0 || gone.Load() == 0 {
		t.Fatalf("taken %d, drained %d: the race tested nothing", taken.Load(), gone.Load())
	}
}

func TestTakeLiveAllocatesNothing(t *testing.T) {
	var c Cell
	c.Add(1<<40, 1<<62)
	if a := testing.AllocsPerRun(1000, func() { c.TakeLive(1, 1) }); a != 0 {
		t.Fatalf("Cell.TakeLive allocates %v per call, want 0", a)
	}
}
