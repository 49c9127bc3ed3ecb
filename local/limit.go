// Package local owns the in-process layer of leasehold: the Limit type and
// its validation, a lock-free GCRA bucket (one atomic word), and the lease
// cell the hybrid limiter spends leased tokens from. It knows nothing about
// Redis or any layer above it.
package local

import (
	"errors"
	"fmt"
	"math"
	"math/bits"
	"time"
)

// Sentinel errors. Wrapped errors keep them reachable through errors.Is.
var (
	// ErrInvalidLimit reports a Limit that cannot be enforced exactly:
	// a non-positive field, a Period that is not a whole number of
	// microseconds, or values whose arithmetic would overflow.
	ErrInvalidLimit = errors.New("leasehold: invalid limit")
	// ErrInvalidN reports a request for n ≤ 0 tokens.
	ErrInvalidN = errors.New("leasehold: n must be positive")
	// ErrExceedsBurst reports a request for more tokens than Burst: it can
	// never be admitted.
	ErrExceedsBurst = errors.New("leasehold: n exceeds burst")
)

const (
	// MaxBurst is the largest Burst accepted. Stores do their arithmetic in
	// IEEE doubles (Redis Lua), so every value must stay below 2^53 with room
	// for debt.
	MaxBurst = int64(1) << 50
	// MaxTimeToFull is the longest time an empty bucket may take to fill:
	// Burst·Period/Rate. Longer limits (one per millennium with a burst of a
	// trillion) are rejected instead of overflowing.
	MaxTimeToFull = 100 * 365 * 24 * time.Hour
	maxExact      = int64(1) << 53
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
	_, err := l.Micros()
	return err
}

// Micros is a Limit reduced to lowest terms in microseconds: Rate tokens
// every Per microseconds, with Rate·Per < 2^53 so that integer arithmetic in
// doubles stays exact. Stores compute with it.
type Micros struct {
	Rate  int64
	Per   int64
	Burst int64
}

// Micros validates l and returns it in lowest terms.
func (l Limit) Micros() (Micros, error) {
	switch {
	case l.Rate <= 0:
		return Micros{}, fmt.Errorf("%w: rate %d must be positive", ErrInvalidLimit, l.Rate)
	case l.Period <= 0:
		return Micros{}, fmt.Errorf("%w: period %v must be positive", ErrInvalidLimit, l.Period)
	case l.Burst <= 0:
		return Micros{}, fmt.Errorf("%w: burst %d must be positive", ErrInvalidLimit, l.Burst)
	case l.Burst > MaxBurst:
		return Micros{}, fmt.Errorf("%w: burst %d above %d", ErrInvalidLimit, l.Burst, MaxBurst)
	case l.Period%time.Microsecond != 0:
		return Micros{}, fmt.Errorf("%w: period %v is not a whole number of microseconds", ErrInvalidLimit, l.Period)
	}
	per := int64(l.Period / time.Microsecond)
	g := gcd(l.Rate, per)
	m := Micros{Rate: l.Rate / g, Per: per / g, Burst: l.Burst}
	// (Rate+1)·Per bounds every intermediate the stores compute (refill
	// progress plus carry), so it must stay below 2^53.
	if hi, lo := bits.Mul64(uint64(m.Rate)+1, uint64(m.Per)); hi != 0 || lo >= uint64(maxExact) {
		return Micros{}, fmt.Errorf("%w: %v has no exact microsecond form below 2^53", ErrInvalidLimit, l)
	}
	// Time to fill from empty, in microseconds: Burst·Per/Rate.
	hi, lo := bits.Mul64(uint64(m.Burst), uint64(m.Per))
	if hi >= uint64(m.Rate) {
		return Micros{}, fmt.Errorf("%w: %v takes longer than %v to fill", ErrInvalidLimit, l, MaxTimeToFull)
	}
	if q, _ := bits.Div64(hi, lo, uint64(m.Rate)); q > uint64(MaxTimeToFull/time.Microsecond) {
		return Micros{}, fmt.Errorf("%w: %v takes longer than %v to fill", ErrInvalidLimit, l, MaxTimeToFull)
	}
	return m, nil
}

// TimeToFull returns how long an empty bucket takes to refill completely.
func (l Limit) TimeToFull() time.Duration {
	d, ok := mulDiv(uint64(l.Burst), uint64(l.Period), uint64(l.Rate), true)
	if !ok || d > math.MaxInt64 {
		return math.MaxInt64
	}
	return time.Duration(d)
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

func gcd(a, b int64) int64 {
	for b != 0 {
		a, b = b, a%b
	}
	return a
}
