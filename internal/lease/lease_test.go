package lease

import (
	"math"
	"sync"
	"sync/atomic"
	"testing"
)

// TestLeaseNeverSpendsMoreThanGranted races takers against adders, a drainer
// and a closer: taken + drained + closed must equal what was added.
func TestLeaseNeverSpendsMoreThanGranted(t *testing.T) {
	t.Parallel()
	var c Cell
	var added, taken, returned atomic.Int64
	stop := takers(8, func(g int) {
		if ok, _ := c.Take(1 + int64(g%3)); ok {
			taken.Add(1 + int64(g%3))
		}
	})
	for i := 0; i < 20000; i++ {
		if c.Add(5, int64(i)) {
			added.Add(5)
		}
		if i%97 == 0 {
			returned.Add(c.DrainExpired(int64(i)))
		}
		if i%31 == 0 {
			returned.Add(c.Cut(3))
		}
	}
	returned.Add(c.Close())
	if c.Add(5, 0) {
		t.Fatal("Add after Close = true, want false")
	}
	stop()
	if ok, _ := c.Take(1); ok {
		t.Fatal("Take after Close succeeded")
	}
	if got, want := taken.Load()+returned.Load(), added.Load(); got != want {
		t.Fatalf("taken %d + returned %d = %d, want added %d", taken.Load(), returned.Load(), got, want)
	}
}

// takers runs take(g) on goroutine g of n in a loop until the returned
// stop is called, which waits for them.
func takers(n int, take func(g int)) (stop func()) {
	var wg sync.WaitGroup
	done := make(chan struct{})
	for g := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-done:
					return
				default:
				}
				take(g)
			}
		}()
	}
	return func() { close(done); wg.Wait() }
}

func TestLeaseTakeTable(t *testing.T) {
	t.Parallel()
	var c Cell
	steps := []struct {
		op       string
		n        int64
		wantOK   bool
		wantLeft int64
	}{
		{"take", 1, false, 0},
		{"add", 3, true, 3},
		{"take", 2, true, 1},
		{"take", 2, false, 1},
		{"drain", 0, true, 0},
		{"add", 4, true, 4},
		{"close", 0, true, 0},
		{"take", 1, false, 0},
	}
	for i, s := range steps {
		var ok bool
		switch s.op {
		case "take":
			ok, _ = c.Take(s.n)
		case "add":
			ok = c.Add(s.n, 100)
		case "drain":
			c.Drain()
			ok = true
		case "close":
			c.Close()
			ok = true
		}
		if ok != s.wantOK || c.Tokens() != s.wantLeft {
			t.Errorf("step %d %s(%d) = ok %v left %d, want ok %v left %d", i, s.op, s.n, ok, c.Tokens(), s.wantOK, s.wantLeft)
		}
	}
}

func TestTakeAllocatesNothing(t *testing.T) {
	var c Cell
	c.Add(1<<40, 0)
	if a := testing.AllocsPerRun(1000, func() { c.Take(1) }); a != 0 {
		t.Fatalf("Cell.Take allocates %v per call, want 0", a)
	}
}

func BenchmarkTake(b *testing.B) {
	var c Cell
	c.Add(math.MaxInt64/4, 0)
	b.Run("serial", func(b *testing.B) {
		b.ReportAllocs()
		for i := 0; i < b.N; i++ {
			c.Take(1)
		}
	})
	b.Run("parallel", func(b *testing.B) {
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				c.Take(1)
			}
		})
	})
}
