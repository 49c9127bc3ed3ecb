package local

import (
	"github.com/leasehold/leasehold/internal/errs"
	"sync/atomic"
	"time"
)

// Bucket is a lock-free GCRA (generic cell rate algorithm) limiter. Its
// whole state is one atomic word, the theoretical arrival time (TAT) in
// nanoseconds, updated by a CAS loop; refill is computed lazily from the
// time passed in, so no goroutine or ticker is involved.
//
// Each take advances the TAT by n emission intervals (Period/Rate) rounded up
// to the nanosecond, and admission compares exactly, so the bucket never
// admits more than Burst + Rate·w/Period in any window w. When Period/Rate is
// not a whole number of nanoseconds the rounding under-admits by less than
// one nanosecond of refill per take.
//
// Time is whatever monotonic nanosecond count the caller passes to TakeAt;
// the zero TAT means "full at any time ≥ 0". If time goes backwards the
// bucket stays conservative until it catches up.
//
// A Bucket is safe for concurrent use. The zero value is not usable; call
// NewBucket.
type Bucket struct {
	tat atomic.Int64
	lim Limit
	// inc1 is the TAT increment of one token, precomputed for the common n=1.
	inc1 int64
	// slack1 is floor((Burst-1)·Period/Rate): how far ahead of now the TAT
	// may be for a single token to pass.
	slack1 int64
}

// Result is the outcome of a take.
type Result struct {
	// Allowed reports whether the n tokens were taken.
	Allowed bool
	// Remaining is how many tokens the bucket holds after the call.
	Remaining int64
	// RetryAfter is how long until n tokens will be available; 0 when
	// Allowed.
	RetryAfter time.Duration
	// ResetAfter is how long until the bucket is full again.
	ResetAfter time.Duration
}

// NewBucket returns a full bucket enforcing l, or an error wrapping
// ErrInvalidLimit.
func NewBucket(l Limit) (*Bucket, error) {
	if err := l.Validate(); err != nil {
		return nil, err
	}
	return &Bucket{lim: l, inc1: int64(l.DurationFor(1)), slack1: int64(l.floorDuration(l.Burst - 1))}, nil
}

// Limit returns the limit the bucket enforces.
func (b *Bucket) Limit() Limit { return b.lim }

// TakeAt tries to take n tokens at time now (nanoseconds on the caller's
// monotonic clock). n ≤ 0 returns ErrInvalidN, n > Burst ErrExceedsBurst.
func (b *Bucket) TakeAt(now, n int64) (Result, error) {
	if n <= 0 {
		return Result{}, errs.Errorf("local", "take %d: %w", n, ErrInvalidN)
	}
	if n > b.lim.Burst {
		return Result{}, errs.Errorf("local", "take %d of burst %d: %w", n, b.lim.Burst, ErrExceedsBurst)
	}
	inc, slack := b.inc1, b.slack1
	if n != 1 {
		inc, slack = int64(b.lim.DurationFor(n)), int64(b.lim.floorDuration(b.lim.Burst-n))
	}
	for {
		tat := b.tat.Load()
		base := max(tat, now)
		if ahead := base - now; ahead > slack {
			return Result{RetryAfter: time.Duration(ahead - slack), ResetAfter: time.Duration(ahead), Remaining: b.remaining(ahead)}, nil
		}
		next := base + inc
		if b.tat.CompareAndSwap(tat, next) {
			ahead := next - now
			return Result{Allowed: true, Remaining: b.remaining(ahead), ResetAfter: time.Duration(ahead)}, nil
		}
	}
}

// Tokens returns the number of tokens available at now.
func (b *Bucket) Tokens(now int64) int64 {
	return b.remaining(max(b.tat.Load()-now, 0))
}

// remaining converts how far the TAT is ahead of now into whole tokens left.
func (b *Bucket) remaining(ahead int64) int64 {
	if ahead <= 0 {
		return b.lim.Burst
	}
	used, ok := mulDiv(uint64(ahead), uint64(b.lim.Rate), uint64(b.lim.Period), true)
	if !ok || int64(used) >= b.lim.Burst {
		return 0
	}
	return b.lim.Burst - int64(used)
}

// floorDuration returns n·Period/Rate rounded down.
func (l Limit) floorDuration(n int64) time.Duration {
	if n <= 0 {
		return 0
	}
	d, _ := mulDiv(uint64(n), uint64(l.Period), uint64(l.Rate), false)
	return time.Duration(d)
}

// Empty sets the bucket to hold no tokens at now: it refills from there at
// its rate.
func (b *Bucket) Empty(now int64) {
	b.tat.Store(now + int64(b.lim.floorDuration(b.lim.Burst)))
}

// Drain takes every token the bucket holds at now and returns how many
// there were: a take racing with it gets either those tokens or none.
func (b *Bucket) Drain(now int64) int64 {
	empty := now + int64(b.lim.floorDuration(b.lim.Burst))
	for {
		tat := b.tat.Load()
		n := b.remaining(max(tat-now, 0))
		if n == 0 || b.tat.CompareAndSwap(tat, max(tat, empty)) {
			return n
		}
	}
}

// Resize drains b at now and returns a bucket of b's rate and the given
// burst that holds what b held, at most burst, and owes what b owed: a
// take racing with it gets its tokens from b or from the new bucket,
// never both. A holder of a capacity grant gives up part of its burst
// this way before it tells the store.
func (b *Bucket) Resize(now, burst int64) (*Bucket, error) {
	nb, err := NewBucket(Limit{Rate: b.lim.Rate, Period: b.lim.Period, Burst: burst})
	if err != nil {
		return nil, err
	}
	empty := now + int64(b.lim.floorDuration(b.lim.Burst))
	for {
		tat := b.tat.Load()
		n := b.remaining(max(tat-now, 0))
		if !b.tat.CompareAndSwap(tat, max(tat, empty)) {
			continue
		}
		if debt := tat - empty; debt > 0 {
			nb.tat.Store(now + int64(nb.lim.floorDuration(burst)) + debt)
		} else {
			nb.SetTokens(now, n)
		}
		return nb, nil
	}
}

// Owe takes up to n tokens at now whatever the bucket holds, going into
// debt that its refill pays before it admits again, but no further than
// its refill pays by the time by: a take after by finds the bucket at
// least empty, not in debt. It returns how many tokens it took, which
// keeps the bound: what the bucket admits and owes from any start to by
// is at most Burst + Rate·(by − start)/Period, as it is without debt.
func (b *Bucket) Owe(now, by, n int64) int64 {
	for {
		tat := b.tat.Load()
		base := max(tat, now)
		end := by + int64(b.lim.floorDuration(b.lim.Burst)) // empty at by
		room, ok := mulDiv(uint64(max(end-base, 0)), uint64(b.lim.Rate), uint64(b.lim.Period), false)
		k := min(n, int64(min(room, uint64(n))))
		if !ok || k <= 0 {
			return 0
		}
		if b.tat.CompareAndSwap(tat, base+int64(b.lim.DurationFor(k))) {
			return k
		}
	}
}

// SetTokens sets the bucket to hold n tokens at now (0 to Burst): it
// refills from there at its rate.
func (b *Bucket) SetTokens(now, n int64) {
	n = min(max(n, 0), b.lim.Burst)
	b.tat.Store(now + int64(b.lim.DurationFor(b.lim.Burst-n)))
}
