package local

import (
	"fmt"
	"sync"
	"time"
)

// taker is what every local test runs against: the lock-free Bucket and the
// mutex reference below.
type taker interface {
	TakeAt(now, n int64) (Result, error)
}

// mutexBucket is the reference: a textbook token bucket (fractional tokens
// kept as an exact numerator) under a mutex. The lock-free GCRA must agree
// with it whenever Period/Rate is a whole number of nanoseconds.
type mutexBucket struct {
	mu     sync.Mutex
	lim    Limit
	last   int64 // ns; guarded by mu
	tokens int64 // whole tokens; guarded by mu
	frac   int64 // refill progress, in units of 1/Period token·ns·Rate; guarded by mu
}

func newMutexBucket(l Limit) (*mutexBucket, error) {
	if err := l.Validate(); err != nil {
		return nil, err
	}
	return &mutexBucket{lim: l, tokens: l.Burst}, nil
}

func (b *mutexBucket) TakeAt(now, n int64) (Result, error) {
	if n <= 0 {
		return Result{}, fmt.Errorf("take %d: %w", n, ErrInvalidN)
	}
	if n > b.lim.Burst {
		return Result{}, fmt.Errorf("take %d: %w", n, ErrExceedsBurst)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.refillLocked(now)
	if b.tokens < n {
		need := b.lim.DurationFor(n-b.tokens) - time.Duration(b.frac/b.lim.Rate)
		return Result{RetryAfter: max(need, 1), Remaining: b.tokens, ResetAfter: b.resetLocked()}, nil
	}
	b.tokens -= n
	return Result{Allowed: true, Remaining: b.tokens, ResetAfter: b.resetLocked()}, nil
}

func (b *mutexBucket) resetLocked() time.Duration {
	if b.tokens >= b.lim.Burst {
		return 0
	}
	return b.lim.DurationFor(b.lim.Burst-b.tokens) - time.Duration(b.frac/b.lim.Rate)
}

func (b *mutexBucket) refillLocked(now int64) {
	if now <= b.last {
		return
	}
	elapsed := now - b.last
	b.last = now
	if b.tokens >= b.lim.Burst {
		b.frac = 0
		return
	}
	// frac counts ns·Rate; one token is Period of it.
	add := b.lim.TokensIn(time.Duration(elapsed))
	rem := elapsed*b.lim.Rate - add*int64(b.lim.Period) // small limits only
	b.frac += rem
	if b.frac >= int64(b.lim.Period) {
		add++
		b.frac -= int64(b.lim.Period)
	}
	b.tokens += add
	if b.tokens >= b.lim.Burst {
		b.tokens, b.frac = b.lim.Burst, 0
	}
}
