package background

import (
	"context"
	"testing"
	"time"

	"github.com/leasehold/leasehold/internal/testkit/spawn"
)

// TestDeadlinesShareWithinSlack: contexts asked for within one slack are
// one context, each ends between d and d+slack after it was asked for,
// and all end with their parent.
func TestDeadlinesShareWithinSlack(t *testing.T) {
	parent, cancel := context.WithCancel(context.Background())
	const d, slack = time.Hour, 50 * time.Millisecond
	s := NewDeadlines(parent, d, slack)
	start := time.Now()
	ta, tb := s.Take(), s.Take()
	a, b := ta.Context(), tb.Context()
	if a != b {
		t.Fatal("two contexts asked for at once are not shared")
	}
	dl, ok := a.Deadline()
	if !ok || dl.Sub(start) < d || time.Until(dl) > d+slack {
		t.Fatalf("deadline %v after the ask, want within [%v, %v]", dl.Sub(start), d, d+slack)
	}
	// Past the slack a new context, again at least d away.
	deadline := time.Now().Add(5 * time.Second)
	var c context.Context
	for {
		tc := s.Take()
		if c = tc.Context(); c != a {
			break
		}
		tc.Done()
		if time.Now().After(deadline) {
			t.Fatal("still the first context 5 s on")
		}
	}
	asked := time.Now()
	if dl, _ := c.Deadline(); dl.Before(asked.Add(d)) {
		t.Fatalf("a later context ends %v after it was asked for, want at least %v", dl.Sub(asked), d)
	}
	cancel()
	for _, x := range []context.Context{a, c} {
		select {
		case <-x.Done():
		case <-time.After(5 * time.Second):
			t.Fatal("a shared context outlived its parent")
		}
	}
}

// TestDeadlinesEnd: a shared context ends at its deadline.
func TestDeadlinesEnd(t *testing.T) {
	s := NewDeadlines(context.Background(), 10*time.Millisecond, time.Millisecond)
	ctx := s.Take().Context()
	select {
	case <-ctx.Done():
		if ctx.Err() != context.DeadlineExceeded {
			t.Fatalf("ended with %v, want the deadline", ctx.Err())
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a shared context did not end at its deadline")
	}
}

// TestDeadlinesCancelWhatIsGivenBack: a context no longer handed out
// ends once its last call gives it back, not before, so its deadline
// timer never fires: 200 contexts in turn start no goroutine.
func TestDeadlinesCancelWhatIsGivenBack(t *testing.T) {
	const d, slack = 20 * time.Millisecond, time.Millisecond
	s := NewDeadlines(context.Background(), d, slack)
	held := s.Take()
	started := spawn.Count()
	var given []context.Context
	deadline := time.Now().Add(10 * time.Second)
	for len(given) < 200 {
		c := s.Take()
		if n := len(given); n == 0 || given[n-1] != c.Context() {
			given = append(given, c.Context())
		}
		c.Done()
		if len(given) == 2 && held != nil { // held is no longer handed out
			if err := held.Context().Err(); err != nil {
				t.Fatalf("a context still held ended with %v when it stopped being handed out", err)
			}
			held.Done()
			if err := held.Context().Err(); err != context.Canceled {
				t.Fatalf("a context given back by its last call: %v, want cancelled", err)
			}
			held = nil
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d contexts in 10 s, want 200", len(given))
		}
	}
	<-time.After(3 * d) // past every deadline: a timer left armed would have fired
	for i, c := range given[:len(given)-1] {
		if c.Err() != context.Canceled {
			t.Fatalf("context %d of %d: %v, want cancelled when given back", i, len(given), c.Err())
		}
	}
	// The one still handed out reaches its deadline: at most its goroutine.
	if n := spawn.Count() - started; n > 2 {
		t.Fatalf("%d goroutines started by 200 contexts given back, want none (but the last one's deadline)", n)
	}
}
