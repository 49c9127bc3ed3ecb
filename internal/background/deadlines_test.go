package background

import (
	"context"
	"testing"
	"time"
)

// TestDeadlinesShareWithinSlack: contexts asked for within one slack are
// one context, each ends between d and d+slack after it was asked for,
// and all end with their parent.
func TestDeadlinesShareWithinSlack(t *testing.T) {
	parent, cancel := context.WithCancel(context.Background())
	const d, slack = time.Hour, 50 * time.Millisecond
	s := NewDeadlines(parent, d, slack)
	start := time.Now()
	a := s.Context()
	b := s.Context()
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
	for c = s.Context(); c == a; c = s.Context() {
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
	ctx := s.Context()
	select {
	case <-ctx.Done():
		if ctx.Err() != context.DeadlineExceeded {
			t.Fatalf("ended with %v, want the deadline", ctx.Err())
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a shared context did not end at its deadline")
	}
}
