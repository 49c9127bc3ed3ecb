package lease

import (
	"math/rand/v2"
	"sync/atomic"
	"testing"
)

// TestAddUntilTable: tokens are spendable before their expiry only; a
// grant added while live tokens remain keeps the later of their expiry
// and its own less the time they take (step per token); expired tokens
// are dropped by the next grant.
func TestAddUntilTable(t *testing.T) {
	t.Parallel()
	const step = 10
	steps := []struct {
		op          string
		n, at, arg  int64 // tokens, now, expiry (add)
		wantOK      bool
		wantLeft    int64
		wantExpiry  int64
		wantDropped int64
	}{
		{"add", 5, 0, 100, true, 5, 100, 0},
		{"take", 2, 50, 0, true, 3, 100, 0},
		{"take", 1, 100, 0, false, 3, 100, 0}, // expired at 100
		{"add", 4, 100, 300, true, 4, 300, 3}, // the 3 expired ones dropped
		{"add", 2, 150, 200, true, 6, 300, 0}, // 4 live until 300: max(300, 200−40)
		{"add", 1, 160, 500, true, 7, 440, 0}, // 6 live: max(300, 500−60)
		{"take", 7, 439, 0, true, 0, 440, 0},
		{"add", 3, 450, 460, true, 3, 460, 0}, // an empty lease takes the new expiry
		{"take", 3, 460, 0, false, 3, 460, 0},
	}
	var c Cell
	for i, s := range steps {
		var ok bool
		var dropped int64
		switch s.op {
		case "add":
			ok, dropped = c.AddUntil(s.n, s.arg, s.at, step)
		case "take":
			ok, _ = c.TakeBefore(s.n, s.at)
		}
		if ok != s.wantOK || c.Tokens() != s.wantLeft || c.Expiry() != s.wantExpiry || dropped != s.wantDropped {
			t.Errorf("step %d: %s(%d) at %d = ok %v, left %d, expiry %d, dropped %d; want %v, %d, %d, %d",
				i, s.op, s.n, s.at, ok, c.Tokens(), c.Expiry(), dropped, s.wantOK, s.wantLeft, s.wantExpiry, s.wantDropped)
		}
	}
	c.Close()
	if ok, _ := c.AddUntil(1, 1000, 500, step); ok {
		t.Fatal("AddUntil after Close = true, want false")
	}
}

// TestTakeBeforeNeverSpendsExpired races takers against a serialized
// writer that adds tokens with moving expiries and drains: no take
// succeeds at or after the expiry its tokens were added under, and every
// token added is taken, dropped or drained once.
func TestTakeBeforeNeverSpendsExpired(t *testing.T) {
	t.Parallel()
	var c Cell
	var clock atomic.Int64
	var added, taken, gone atomic.Int64
	var late atomic.Int64 // takes at or past the latest expiry ever set
	var maxExpiry atomic.Int64
	stop := takers(6, func(g int) {
		n, now := 1+int64(g%3), clock.Load()
		if ok, _ := c.TakeBefore(n, now); ok {
			taken.Add(n)
			if now >= maxExpiry.Load() {
				late.Add(1)
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
		until := now + rng.Int64N(40)
		maxExpiry.Store(max(maxExpiry.Load(), until))
		if ok, d := c.AddUntil(4, until, now, 3); ok {
			added.Add(4)
			gone.Add(d)
		}
	}
	stop()
	gone.Add(c.Close())
	if got, want := taken.Load()+gone.Load(), added.Load(); got != want {
		t.Fatalf("taken %d + dropped or drained %d = %d, want added %d", taken.Load(), gone.Load(), got, want)
	}
	if late.Load() != 0 {
		t.Fatalf("%d takes at or after every expiry set", late.Load())
	}
}

func TestTakeBeforeAllocatesNothing(t *testing.T) {
	var c Cell
	c.AddUntil(1<<40, 1<<62, 0, 1)
	if a := testing.AllocsPerRun(1000, func() { c.TakeBefore(1, 1) }); a != 0 {
		t.Fatalf("Cell.TakeBefore allocates %v per call, want 0", a)
	}
}
