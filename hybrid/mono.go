package hybrid

import (
	"math"
	"sync/atomic"
	"time"

	"github.com/leasehold/leasehold/clock"
)

// mono is a time on the limiter's monotonic clock: nanoseconds since the
// limiter's epoch (its clock's reading in New). It is the only time a
// decision computes with. Store time (microseconds of Redis TIME) reaches
// hybrid only as time.Time in remote.Result and as storeMicros: a mono
// passed where store time is wanted, or the reverse, does not compile.
type mono int64

// noExpiry is the time a decision passes to spend when leases expire
// only when the sweep drains them (plain leases, on a region's store):
// the hot path then reads no clock.
const noExpiry = mono(math.MinInt64)

// spendAtNow is the time a decision that has read now spends leased
// tokens at: now for stock, whose record counts them only until its
// term, noExpiry otherwise.
func (c *config) spendAtNow(now mono) mono {
	if c.stock {
		return now
	}
	return noExpiry
}

// now is the process clock in nanoseconds since the limiter was created:
// monotonic with the real clock, and read once per decision.
func (c *config) now() mono { return mono(clock.Since(c.clk, c.epoch)) }

// add returns t moved by d.
func (t mono) add(d time.Duration) mono { return t + mono(d) }

// sub returns the duration t − u.
func (t mono) sub(u mono) time.Duration { return time.Duration(t - u) }

// storeMicros is a time on the store's clock, in microseconds since the
// Unix epoch, as the store's TIME reports it.
type storeMicros int64

// storeTime is t as a storeMicros.
func storeTime(t time.Time) storeMicros { return storeMicros(t.UnixMicro()) }

// time returns s as a time.Time.
func (s storeMicros) time() time.Time { return time.UnixMicro(int64(s)) }

// atomicMono is a mono updated atomically. Its zero value holds 0.
type atomicMono struct{ v atomic.Int64 }

func (a *atomicMono) Load() mono   { return mono(a.v.Load()) }
func (a *atomicMono) Store(t mono) { a.v.Store(int64(t)) }
func (a *atomicMono) CompareAndSwap(old, new mono) bool {
	return a.v.CompareAndSwap(int64(old), int64(new))
}

// atomicStoreMicros is a storeMicros updated atomically. Its zero value
// holds 0.
type atomicStoreMicros struct{ v atomic.Int64 }

func (a *atomicStoreMicros) Load() storeMicros   { return storeMicros(a.v.Load()) }
func (a *atomicStoreMicros) Store(t storeMicros) { a.v.Store(int64(t)) }
