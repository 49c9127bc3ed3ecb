package clock

import (
	"testing"
	"time"
)

func TestOffsetMidpointAndOutliers(t *testing.T) {
	t.Parallel()
	base := time.Unix(1_000_000, 0)
	var o Offset
	if _, ok := o.Get(); ok {
		t.Fatal("zero Offset has an estimate")
	}
	// Store 2 s ahead; 1 ms round trips, server stamps at the midpoint.
	for i := 0; i < 50; i++ {
		sent := base.Add(time.Duration(i) * time.Second)
		if !o.Observe(sent, sent.Add(time.Millisecond), sent.Add(500*time.Microsecond+2*time.Second)) {
			t.Fatalf("sample %d dropped", i)
		}
	}
	got, _ := o.Get()
	if d := got - 2*time.Second; d < -time.Microsecond || d > time.Microsecond {
		t.Fatalf("offset = %v, want 2s", got)
	}
	// A 500 ms round trip whose server time is skewed by its queueing is
	// an outlier and must not move the estimate.
	sent := base.Add(time.Hour)
	if o.Observe(sent, sent.Add(500*time.Millisecond), sent.Add(2*time.Second+490*time.Millisecond)) {
		t.Fatal("long round trip used")
	}
	if got2, _ := o.Get(); got2 != got {
		t.Fatalf("outlier moved the estimate from %v to %v", got, got2)
	}
}

func TestShifted(t *testing.T) {
	t.Parallel()
	m := NewManual(time.Unix(10, 0))
	s := Shifted(m, -2*time.Second)
	if got := s.Now(); !got.Equal(time.Unix(8, 0)) {
		t.Fatalf("Shifted Now = %v, want 8s", got)
	}
	fired := false
	s.AfterFunc(time.Second, func() { fired = true })
	m.Advance(time.Second)
	if !fired {
		t.Fatal("timer through Shifted did not fire")
	}
}
