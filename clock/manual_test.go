package clock

import (
	"sort"
	"testing"
	"time"
)

func TestManualFiresInDeadlineOrder(t *testing.T) {
	t0 := time.Unix(1000, 0)
	m := NewManual(t0)
	var got []int
	m.AfterFunc(3*time.Second, func() { got = append(got, 3) })
	m.AfterFunc(1*time.Second, func() { got = append(got, 1) })
	stopped := m.AfterFunc(2*time.Second, func() { got = append(got, 2) })
	if !stopped.Stop() {
		t.Fatal("Stop() = false on a pending timer, want true")
	}
	tm := m.NewTimer(2500 * time.Millisecond)
	if got, want := m.sortedDeadlines(), 3; len(got) != want {
		t.Fatalf("pending = %d, want %d", len(got), want)
	}
	m.Advance(2 * time.Second)
	if len(got) != 1 || got[0] != 1 {
		t.Fatalf("after 2s fired %v, want [1]", got)
	}
	select {
	case <-tm.C():
		t.Fatal("timer at 2.5s fired at 2s")
	default:
	}
	m.Advance(time.Second)
	if len(got) != 2 || got[1] != 3 {
		t.Fatalf("after 3s fired %v, want [1 3]", got)
	}
	select {
	case at := <-tm.C():
		if want := t0.Add(2500 * time.Millisecond); !at.Equal(want) {
			t.Fatalf("timer fired at %v, want %v", at, want)
		}
	default:
		t.Fatal("timer at 2.5s did not fire by 3s")
	}
	if got := m.Now(); !got.Equal(t0.Add(3 * time.Second)) {
		t.Fatalf("Now() = %v, want t0+3s", got)
	}
}

func TestManualCallbackCanReschedule(t *testing.T) {
	m := NewManual(time.Unix(0, 0))
	n := 0
	var tick func()
	tick = func() {
		n++
		if n < 5 {
			m.AfterFunc(time.Second, tick)
		}
	}
	m.AfterFunc(time.Second, tick)
	m.Advance(10 * time.Second)
	if n != 5 {
		t.Fatalf("ticks = %d, want 5", n)
	}
	if m.Pending() != 0 {
		t.Fatalf("Pending() = %d, want 0", m.Pending())
	}
}

func TestManualBackwardsAndReset(t *testing.T) {
	t0 := time.Unix(50, 0)
	m := NewManual(t0)
	fired := false
	tm := m.AfterFunc(time.Second, func() { fired = true })
	m.Backwards(5 * time.Second)
	if got := m.Now(); !got.Equal(t0.Add(-5 * time.Second)) {
		t.Fatalf("Now() after Backwards = %v", got)
	}
	if !tm.Reset(10 * time.Second) {
		t.Fatal("Reset on pending timer = false, want true")
	}
	m.Advance(9 * time.Second)
	if fired {
		t.Fatal("fired before reset deadline")
	}
	m.Advance(time.Second)
	if !fired {
		t.Fatal("did not fire at reset deadline")
	}
	if d, ok := m.NextDeadline(); ok {
		t.Fatalf("NextDeadline() = %v, want none", d)
	}
}

func TestRealClockTimers(t *testing.T) {
	c := Real()
	done := make(chan struct{})
	c.AfterFunc(time.Millisecond, func() { close(done) })
	tm := c.NewTimer(time.Millisecond)
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("AfterFunc did not fire")
	}
	select {
	case <-tm.C():
	case <-time.After(5 * time.Second):
		t.Fatal("timer did not fire")
	}
	if c.Now().IsZero() {
		t.Fatal("Now() is zero")
	}
}

// sortedDeadlines is used by tests to inspect the queue.
func (m *Manual) sortedDeadlines() []time.Time {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]time.Time, 0, len(m.mu.timers))
	for _, t := range m.mu.timers {
		out = append(out, t.when)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Before(out[j]) })
	return out
}
