// Package lease holds the lease cell: tokens granted by the store, spent
// by the hybrid limiter with atomic operations only.
package lease

import (
	"math"
	"sync/atomic"
)

// closed marks a Cell that takes no more tokens. It is far below any count,
// so a plain "tokens >= n" test rejects it without a separate flag.
const closed = math.MinInt64 / 2

// Cell is a cell of tokens granted by the store, spent locally with atomic
// operations only. Every token added is either taken once or handed back by
// Drain or Close once, never both: the single atomic counter is the
// linearization point, which is what keeps the global bound exact.
//
// The expiry is advisory for Take: the owner (the hybrid limiter) sweeps
// expired leases with DrainExpired, so Take needs no clock read.
// TakeLive enforces it, for an owner whose leases must end exactly.
//
// A Cell is safe for concurrent use; its zero value is an empty, open
// lease.
type Cell struct {
	tokens atomic.Int64
	expiry atomic.Int64
	low    atomic.Int32 // the owner's low-water mark
}

// LowWater returns the low-water mark set by SetLowWater: the owner
// refills the lease when fewer tokens are left.
func (c *Cell) LowWater() int64 { return int64(c.low.Load()) }

// SetLowWater sets the low-water mark, clamped to what the cell keeps.
func (c *Cell) SetLowWater(n int64) { c.low.Store(int32(min(max(n, 0), math.MaxInt32))) }

// Take spends n tokens if at least n are left, and returns the count left.
func (c *Cell) Take(n int64) (ok bool, left int64) {
	for {
		cur := c.tokens.Load()
		if cur < n {
			return false, max(cur, 0)
		}
		if c.tokens.CompareAndSwap(cur, cur-n) {
			return true, cur - n
		}
	}
}

// Add puts n granted tokens into the lease and moves its expiry to
// expiresAt (nanoseconds on the owner's clock). It returns false, adding
// nothing, if the lease is closed: the caller still owns the n tokens.
func (c *Cell) Add(n, expiresAt int64) bool {
	// Expiry first: a sweep that sees the old expiry may drain the new
	// tokens too, which wastes them but never double-spends.
	c.expiry.Store(expiresAt)
	for {
		cur := c.tokens.Load()
		if cur < 0 {
			return false
		}
		if c.tokens.CompareAndSwap(cur, cur+n) {
			return true
		}
	}
}

// Cut removes tokens above keep and returns how many it removed.
func (c *Cell) Cut(keep int64) int64 {
	for {
		cur := c.tokens.Load()
		if cur <= keep {
			return 0
		}
		if c.tokens.CompareAndSwap(cur, keep) {
			return cur - keep
		}
	}
}

// Drain empties the lease and returns the unspent tokens.
func (c *Cell) Drain() int64 { return c.Cut(0) }

// DrainExpired drains the lease if it expired at or before now.
func (c *Cell) DrainExpired(now int64) int64 {
	if c.expiry.Load() > now {
		return 0
	}
	return c.Drain()
}

// Close empties the lease for good and returns the unspent tokens. Later
// Adds fail and Takes find nothing.
func (c *Cell) Close() int64 {
	old := c.tokens.Swap(closed)
	return max(old, 0)
}

// Closed reports whether Close has run.
func (c *Cell) Closed() bool { return c.tokens.Load() < 0 }

// Tokens returns the tokens left, 0 once closed.
func (c *Cell) Tokens() int64 { return max(c.tokens.Load(), 0) }

// AddBefore is Add for tokens that must be spent by expiresAt: while the
// lease still holds tokens its expiry only moves earlier, so tokens
// already there keep their own deadline.
func (c *Cell) AddBefore(n, expiresAt int64) bool {
	if c.tokens.Load() > 0 {
		expiresAt = min(expiresAt, c.expiry.Load())
	}
	return c.Add(n, expiresAt)
}

// Expiry returns the lease's expiry (nanoseconds on the owner's clock).
func (c *Cell) Expiry() int64 { return c.expiry.Load() }

// TakeLive spends n tokens if at least n are left and the lease has not
// expired at now (nanoseconds on the owner's clock), and returns the count
// left: an owner whose tokens the store counts only until the lease's
// expiry (a stock record's term) must not spend one past it. Expired
// tokens stay until the owner drains them (DrainExpired).
func (c *Cell) TakeLive(n, now int64) (ok bool, left int64) {
	for {
		cur := c.tokens.Load()
		if now >= c.expiry.Load() {
			return false, 0
		}
		if cur < n {
			return false, max(cur, 0)
		}
		if c.tokens.CompareAndSwap(cur, cur-n) {
			return true, cur - n
		}
	}
}

// Spendable returns the tokens that can be spent at now: none once the
// lease has expired.
func (c *Cell) Spendable(now int64) int64 {
	cur := c.tokens.Load()
	if cur <= 0 || now >= c.expiry.Load() {
		return 0
	}
	return cur
}
