package hybrid

import (
	"context"
	"errors"
	"testing"
	"time"
)

// TestReserveN: reservations in x/time/rate's shape on the global bucket:
// granted now when the tokens are there, future-dated when they will be,
// and Cancel gives tokens back for others.
func TestReserveN(t *testing.T) {
	t.Parallel()
	w := newFakeWorld()
	l := w.limiter(t, Policy{Name: "reserve", Limit: PerSecond(10)})
	ctx := context.Background()
	steps := []struct {
		n         int64
		wantOK    bool
		wantDelay time.Duration
		cancel    bool
	}{
		{10, true, 0, false},                     // the whole burst, now
		{5, true, 500 * time.Millisecond, true},  // future-dated, then given back
		{5, true, 500 * time.Millisecond, false}, // the same tokens again
		{5, true, time.Second, false},            // behind it
		{1, false, 0, false},                     // beyond the time to fill from empty (1 s): not OK
	}
	for i, s := range steps {
		r, err := l.ReserveN(ctx, "k", s.n)
		if err != nil {
			t.Fatalf("step %d: ReserveN(%d): %v", i, s.n, err)
		}
		if r.OK() != s.wantOK || r.Delay() != s.wantDelay {
			t.Fatalf("step %d: ReserveN(%d) = OK %v Delay %v, want %v %v", i, s.n, r.OK(), r.Delay(), s.wantOK, s.wantDelay)
		}
		if s.cancel {
			r.Cancel()
			r.Cancel() // idempotent
		}
	}
	if _, err := l.ReserveN(ctx, "k", 11); !errors.Is(err, ErrExceedsBurst) {
		t.Fatalf("ReserveN(11) over burst 10: %v, want ErrExceedsBurst", err)
	}
	// A reservation whose time has come is used: Cancel gives nothing back.
	r, err := l.ReserveN(ctx, "other", 3)
	if err != nil || !r.OK() || r.Delay() != 0 {
		t.Fatalf("ReserveN on a fresh key = %+v, %v", r, err)
	}
	w.clk.Advance(time.Millisecond)
	r.Cancel()
	if d, _ := l.AllowN(ctx, "other", 8); d.Allowed {
		t.Fatalf("8 admitted after 3 were reserved and used, of a burst of 10")
	}
}
