package clock

import (
	"testing"
	"time"
)

func TestSince(t *testing.T) {
	m := NewManual(time.Unix(100, 0))
	start := m.Now()
	m.Advance(3 * time.Second)
	if got := Since(m, start); got != 3*time.Second {
		t.Fatalf("Since on a manual clock = %v, want 3s", got)
	}
	r := Real()
	t0 := r.Now()
	if got := Since(r, t0); got < 0 || got > time.Minute {
		t.Fatalf("Since on the real clock = %v", got)
	}
}

var sink time.Duration

// BenchmarkSince compares a read of the limiter's clock through Now with
// one through Since.
func BenchmarkSince(b *testing.B) {
	r := Real()
	t0 := r.Now()
	b.Run("Now", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			sink += r.Now().Sub(t0)
		}
	})
	b.Run("Since", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			sink += Since(r, t0)
		}
	})
}
