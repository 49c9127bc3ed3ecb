// Package exact reduces a limit to the integer form every store computes
// with: Rate tokens every Per microseconds, in lowest terms, with every
// intermediate below 2^53 so that Redis Lua's doubles stay exact. It is
// shared by local (validation) and remote (the stores' arithmetic).
package exact

import (
	"fmt"
	"github.com/leasehold/leasehold/internal/errs"
	"math/bits"
	"time"
)

// ErrInvalidLimit reports a limit that cannot be enforced exactly;
// local.ErrInvalidLimit is the same value.
var ErrInvalidLimit = errs.New("local", "invalid limit")

const (
	// MaxBurst is the largest Burst accepted: stores do their arithmetic
	// in IEEE doubles, so every value must stay below 2^53 with room for
	// debt.
	MaxBurst = int64(1) << 50
	// MaxTimeToFull is the longest time an empty bucket may take to fill.
	MaxTimeToFull = 100 * 365 * 24 * time.Hour
	maxExact      = int64(1) << 53
)

// Micros is a limit in lowest terms in microseconds: Rate tokens every Per
// microseconds, with (Rate+1)·Per < 2^53.
type Micros struct {
	Rate  int64
	Per   int64
	Burst int64
}

// Reduce validates rate tokens per period with burst and returns them in
// lowest terms, or an error wrapping ErrInvalidLimit.
func Reduce(rate int64, period time.Duration, burst int64) (Micros, error) {
	if err := checkFields(rate, period, burst); err != nil {
		return Micros{}, err
	}
	per := int64(period / time.Microsecond)
	g := gcd(rate, per)
	m := Micros{Rate: rate / g, Per: per / g, Burst: burst}
	// Built only for an error: every store request validates its limit.
	show := func() string { return fmt.Sprintf("%d/%v burst %d", rate, period, burst) }
	// (Rate+1)·Per bounds every intermediate the stores compute (refill
	// progress plus carry), so it must stay below 2^53.
	if hi, lo := bits.Mul64(uint64(m.Rate)+1, uint64(m.Per)); hi != 0 || lo >= uint64(maxExact) {
		return Micros{}, fmt.Errorf("%w: %s has no exact microsecond form below 2^53", ErrInvalidLimit, show())
	}
	// Time to fill from empty, in microseconds: Burst·Per/Rate.
	hi, lo := bits.Mul64(uint64(m.Burst), uint64(m.Per))
	if hi >= uint64(m.Rate) {
		return Micros{}, fmt.Errorf("%w: %s takes longer than %v to fill", ErrInvalidLimit, show(), MaxTimeToFull)
	}
	if q, _ := bits.Div64(hi, lo, uint64(m.Rate)); q > uint64(MaxTimeToFull/time.Microsecond) {
		return Micros{}, fmt.Errorf("%w: %s takes longer than %v to fill", ErrInvalidLimit, show(), MaxTimeToFull)
	}
	return m, nil
}

func checkFields(rate int64, period time.Duration, burst int64) error {
	switch {
	case rate <= 0:
		return fmt.Errorf("%w: rate %d must be positive", ErrInvalidLimit, rate)
	case period <= 0:
		return fmt.Errorf("%w: period %v must be positive", ErrInvalidLimit, period)
	case burst <= 0:
		return fmt.Errorf("%w: burst %d must be positive", ErrInvalidLimit, burst)
	case burst > MaxBurst:
		return fmt.Errorf("%w: burst %d above %d", ErrInvalidLimit, burst, MaxBurst)
	case period%time.Microsecond != 0:
		return fmt.Errorf("%w: period %v is not a whole number of microseconds", ErrInvalidLimit, period)
	}
	return nil
}

func gcd(a, b int64) int64 {
	for b != 0 {
		a, b = b, a%b
	}
	return a
}
