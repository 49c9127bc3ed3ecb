// Package local owns the in-process layer of leasehold: the Limit type and
// its validation, and a lock-free GCRA bucket (one atomic word) that the
// hybrid limiter runs in degraded mode. It knows nothing about Redis or any
// layer above it.
package local

import (
	"fmt"
	"github.com/leasehold/leasehold/internal/errs"
	"math"
	"math/bits"
	"time"

	"github.com/leasehold/leasehold/internal/exact"
)

// Sentinel errors. Wrapped errors keep them reachable through errors.Is.
var (
	// ErrInvalidLimit reports a Limit that cannot be enforced exactly:
	// a non-positive field, a Period that is not a whole number of
	// microseconds, or values whose arithmetic would overflow.
	ErrInvalidLimit = exact.ErrInvalidLimit
	// ErrInvalidN reports a request for n ≤ 0 tokens.
	ErrInvalidN = errs.New("local", "n must be positive")
	// ErrExceedsBurst reports a request for more tokens than Burst: it can
	// never be admitted.
	ErrExceedsBurst = errs.New("local", "n exceeds burst")
)

const (
	// MaxBurst is the largest Burst accepted. Stores do their arithmetic in
	// IEEE doubles (Redis Lua), so every value must stay below 2^53 with room
	// for debt.
	MaxBurst = exact.MaxBurst
	// MaxTimeToFull is the longest time an empty bucket may take to fill:
	// Burst·Period/Rate. Longer limits (one per millennium with a burst of a
	// trillion) are rejected instead of overflowing.
	MaxTimeToFull = exact.MaxTimeToFull
)

// Limit is a token-bucket limit: Burst tokens at most, refilled at Rate
// tokens per Period. The zero value is invalid; use PerSecond, PerMinute,
// PerHour or fill every field.
type Limit struct {
	Rate   int64
	Period time.Duration
	Burst  int64
}

// PerSecond returns a Limit of rate tokens per second with Burst = rate.
func PerSecond(rate int64) Limit { return Limit{Rate: rate, Period: time.Second, Burst: rate} }

// PerMinute returns a Limit of rate tokens per minute with Burst = rate.
func PerMinute(rate int64) Limit { return Limit{Rate: rate, Period: time.Minute, Burst: rate} }

// PerHour returns a Limit of rate tokens per hour with Burst = rate.
func PerHour(rate int64) Limit { return Limit{Rate: rate, Period: time.Hour, Burst: rate} }

// String formats the limit as "rate/period burst b".
func (l Limit) String() string {
	return fmt.Sprintf("%d/%v burst %d", l.Rate, l.Period, l.Burst)
}

// Validate reports whether l can be enforced exactly by every layer. The
// error wraps ErrInvalidLimit.
func (l Limit) Validate() error {
	_, err := exact.Reduce(l.Rate, l.Period, l.Burst)
	return err
}

// TokensIn returns how many whole tokens refill in d, saturating.
func (l Limit) TokensIn(d time.Duration) int64 {
	if d <= 0 || l.Period <= 0 {
		return 0
	}
	n, ok := mulDiv(uint64(d), uint64(l.Rate), uint64(l.Period), false)
	if !ok || n > math.MaxInt64 {
		return math.MaxInt64
	}
	return int64(n)
}

// DurationFor returns how long n tokens take to refill, rounded up.
func (l Limit) DurationFor(n int64) time.Duration {
	if n <= 0 || l.Rate <= 0 {
		return 0
	}
	d, ok := mulDiv(uint64(n), uint64(l.Period), uint64(l.Rate), true)
	if !ok || d > math.MaxInt64 {
		return math.MaxInt64
	}
	return time.Duration(d)
}

// mulDiv returns a·b/c rounded down (or up), and false if it overflows 64
// bits.
func mulDiv(a, b, c uint64, up bool) (uint64, bool) {
	hi, lo := bits.Mul64(a, b)
	if hi >= c {
		return 0, false
	}
	q, r := bits.Div64(hi, lo, c)
	if up && r != 0 {
		if q == math.MaxUint64 {
			return 0, false
		}
		q++
	}
	return q, true
}
