// Package poll waits in tests for a condition another goroutine or
// process brings about, by polling it with a deadline instead of sleeping
// for a guessed time.
package poll

import (
	"testing"
	"time"
)

// Until polls cond every millisecond until it holds, and fails t with
// what when it does not hold within d.
func Until(t testing.TB, what string, d time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(time.Millisecond) // polling with a deadline
	}
}
