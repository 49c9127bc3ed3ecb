package allocs

import (
	"sync/atomic"
	"testing"
)

var sink atomic.Pointer[[64]byte]

func TestFewest(t *testing.T) {
	seen := make([]bool, 3*(10+1))
	// Every call allocates once, and the second batch's calls once more:
	// the fewest batch is 1.
	got := Fewest(3, 10, func(i int) {
		seen[i] = true
		sink.Store(new([64]byte))
		if i >= 11 && i < 22 {
			sink.Store(new([64]byte))
		}
	})
	if got != 1 {
		t.Fatalf("Fewest = %v, want 1", got)
	}
	for i, ok := range seen {
		if !ok {
			t.Fatalf("call %d never made", i)
		}
	}
}
