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
// TakeDecaying enforces it, for an owner whose leases must end exactly.
//
// A Cell is safe for concurrent use; its zero value is an empty, open
// lease.
type Cell struct {
	tokens atomic.Int64
	expiry atomic.Int64 // under AddDecaying, when the line reaches zero
	// step is the nanoseconds per token the line falls, as float32 bits
	// rounded up (a line no higher than asked); 0: no decay. It and low
	// fill what would be padding: the hybrid limiter keeps a Cell on
	// every tracked key.
	step atomic.Uint32
	low  atomic.Int32 // the owner's low-water mark
}

// LowWater returns the low-water mark set by SetLowWater: the owner
// refills the lease when fewer tokens are left.
func (c *Cell) LowWater() int64 { return int64(c.low.Load()) }

// SetLowWater sets the low-water mark, clamped to what the cell keeps.
func (c *Cell) SetLowWater(n int64) { c.low.Store(int32(min(max(n, 0), math.MaxInt32))) }

// stepBits is step as the cell keeps it: float32 bits, rounded up.
func stepBits(step int64) uint32 {
	f := float32(step)
	if float64(f) < float64(step) {
		f = math.Nextafter32(f, math.MaxFloat32)
	}
	return math.Float32bits(f)
}

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

// A decaying lease (AddDecaying) holds at most (end − now)/step tokens at
// now: its line falls by a token per step and reaches zero at end, as the
// bucket its tokens came from refills behind it. A lease added with Add
// (step 0) keeps every token until its expiry instead.

// TakeDecaying spends n tokens if at least n are spendable at now
// (nanoseconds on the owner's clock), and returns the count left and the
// tokens that had decayed, which it drops. The tokens are read before the
// line, and writers (AddDecaying) store the line before the tokens, so
// tokens read here are never judged by a line longer than theirs.
func (c *Cell) TakeDecaying(n, now int64) (ok bool, left, decayed int64) {
	for {
		cur := c.tokens.Load()
		if cur < n {
			return false, max(cur, 0), 0
		}
		avail := c.cap(cur, now)
		if avail < n {
			return false, avail, 0
		}
		if c.tokens.CompareAndSwap(cur, avail-n) {
			return true, avail - n, cur - avail
		}
	}
}

// Spendable returns the tokens that can be spent at now: none once the
// lease has expired, and at most its line under AddDecaying.
func (c *Cell) Spendable(now int64) int64 {
	cur := c.tokens.Load()
	if cur <= 0 {
		return 0
	}
	return c.cap(cur, now)
}

// cap is min(cur, the line at now): cur when the line is above it, which
// one multiplication tells without a division.
func (c *Cell) cap(cur, now int64) int64 {
	bits := c.step.Load()
	end := c.expiry.Load()
	if now >= end {
		return 0
	}
	if bits == 0 {
		return cur
	}
	step, d := float64(math.Float32frombits(bits)), float64(end-now)
	if float64(cur)*step <= d {
		return cur
	}
	h := int64(d / step)
	if float64(h)*step > d { // the division rounded up
		h--
	}
	return h
}

// AddDecaying puts n granted tokens into the lease at now under a line
// that reaches zero at end, falling a token per step, and returns the
// tokens it dropped and whether the new tokens are the only ones the
// cell holds (it held none spendable, or dropped them); it returns false,
// adding nothing, if the lease is closed. Writers must be serialized by the owner; TakeDecaying may run
// concurrently.
//
// One line must hold the tokens still spendable and the new ones without
// letting the cell hold more than the two lines would apart. With eff old
// tokens under a line of height a and the n new under one of height b, a
// line of height min(a + n, b) does, counting the old tokens spent first:
// it is b while the old line is above what the old tokens need, and a + n,
// the old line only lifted by the new tokens, otherwise; counting the new
// spent first, min(b + eff, a) does too. The cell takes the higher.
// (Carrying old tokens under the new line alone would let them outlive
// the refill that bounds them: bucket plus held tokens could then exceed
// the bucket's size.) When the old tokens alone under the old line, or
// the new alone under theirs, are worth more to an owner spending use
// tokens per token the line falls (see worth), the others are dropped
// instead; on a tie both are kept.
func (c *Cell) AddDecaying(n, end, now, step int64, use float64) (ok bool, dropped int64, alone bool) {
	for {
		cur := c.tokens.Load()
		if cur < 0 {
			return false, dropped, false
		}
		eff, line, add := c.cap(cur, now), end, n
		if c.step.Load() != stepBits(step) {
			eff = 0 // a line of another slope: not worth a second one
		}
		if eff > 0 {
			old := c.expiry.Load()
			// Either segment may be the one spent first: the line is
			// the other's lifted by its tokens, at most the first's.
			lifted := max(min(old+min(n, math.MaxInt64/4/step)*step, end), min(end+min(eff, math.MaxInt64/4/step)*step, old))
			both, alone, kept := worth(eff+n, lifted, now, step, use), worth(n, end, now, step, use), worth(eff, old, now, step, use)
			switch {
			case both >= alone && both >= kept: // ties keep both
				line = lifted
			case kept > alone: // the new line is far below the old
				line, add = old, 0
			default:
				eff = 0
			}
		}
		if !c.tokens.CompareAndSwap(cur, eff) {
			continue // spent meanwhile
		}
		dropped += cur - eff + n - add
		if eff == 0 {
			c.step.Store(stepBits(step)) // no tokens: no reader judges any by these
		}
		c.expiry.Store(line)
		for add > 0 {
			cur := c.tokens.Load()
			if cur < 0 {
				return false, dropped, false
			}
			if c.tokens.CompareAndSwap(cur, cur+add) {
				break
			}
		}
		return true, dropped, eff == 0
	}
}

// worth is how many of t tokens under a line ending at end the owner can
// expect to spend from now, spending use tokens per token the line falls
// (its demand over the bucket's rate, at most 1): all t if the line
// stays above what is left, else the line's height at now times use.
func worth(t, end, now, step int64, use float64) float64 {
	h := float64(max(end-now, 0)) / float64(step)
	return min(float64(t), h*min(max(use, 0), 1))
}
