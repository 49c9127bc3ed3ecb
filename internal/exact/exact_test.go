package exact

import (
	"errors"
	"testing"
	"time"
)

// TestReduceAllocatesNothing: every store request validates its limit, so
// a valid limit must cost no allocation (a description built for errors
// only was once 3% of a cold decision's allocations).
func TestReduceAllocatesNothing(t *testing.T) {
	if a := testing.AllocsPerRun(100, func() { _, _ = Reduce(10, time.Second, 10) }); a != 0 {
		t.Fatalf("Reduce of a valid limit allocates %v times", a)
	}
}

// TestReduce: exact forms and the errors that describe bad limits.
func TestReduce(t *testing.T) {
	for _, tc := range []struct {
		rate   int64
		period time.Duration
		burst  int64
		want   Micros
		bad    bool
	}{
		{10, time.Second, 10, Micros{Rate: 1, Per: 100_000, Burst: 10}, false},
		{3, time.Minute, 5, Micros{Rate: 1, Per: 20_000_000, Burst: 5}, false},
		{0, time.Second, 1, Micros{}, true},
		{1, time.Nanosecond, 1, Micros{}, true},
		{1 << 40, time.Hour + time.Microsecond, 1, Micros{}, true},
		{1, 24 * 365 * time.Hour, MaxBurst, Micros{}, true},
	} {
		got, err := Reduce(tc.rate, tc.period, tc.burst)
		if tc.bad != (err != nil) || !tc.bad && got != tc.want {
			t.Errorf("Reduce(%d, %v, %d) = %+v, %v", tc.rate, tc.period, tc.burst, got, err)
		}
		if tc.bad && !errors.Is(err, ErrInvalidLimit) {
			t.Errorf("Reduce(%d, %v, %d): %v, want ErrInvalidLimit", tc.rate, tc.period, tc.burst, err)
		}
	}
}
