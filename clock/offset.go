package clock

import (
	"sync"
	"time"
)

// Offset estimates how far the store's clock is ahead of this process's
// clock, from request/reply pairs: each reply's server time is compared
// with the midpoint of the round trip that carried it. Samples whose round
// trip is much longer than the best seen recently are dropped (their
// midpoint is uncertain by half the round trip), the rest are smoothed.
//
// An Offset is safe for concurrent use; its zero value has no estimate.
type Offset struct {
	mu struct {
		sync.Mutex
		n      int
		est    float64 // ns
		minRTT time.Duration
		seen   int // samples since minRTT was last refreshed
	}
}

const (
	offsetAlpha    = 0.2
	minRTTLifetime = 1000 // samples before the best RTT is forgotten
)

// Observe records one round trip: sent and received on this process's
// clock, server the store's time in the reply. It reports whether the
// sample was used.
func (o *Offset) Observe(sent, received, server time.Time) bool {
	rtt := received.Sub(sent)
	if rtt < 0 || server.IsZero() {
		return false
	}
	mid := sent.Add(rtt / 2)
	sample := float64(server.Sub(mid))
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.mu.n == 0 || rtt < o.mu.minRTT || o.mu.seen >= minRTTLifetime {
		o.mu.minRTT, o.mu.seen = rtt, 0
	}
	o.mu.seen++
	// Outlier: a round trip over twice the best (plus 1 ms of slack).
	if o.mu.n > 0 && rtt > 2*o.mu.minRTT+time.Millisecond {
		return false
	}
	if o.mu.n == 0 {
		o.mu.est = sample
	} else {
		o.mu.est += offsetAlpha * (sample - o.mu.est)
	}
	o.mu.n++
	return true
}

// Get returns the estimate and whether there is one.
func (o *Offset) Get() (time.Duration, bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return time.Duration(o.mu.est), o.mu.n > 0
}

// Shifted returns a Clock that reads c plus d, for tests and simulations of
// a process whose clock is wrong. Timers are unaffected.
func Shifted(c Clock, d time.Duration) Clock { return shifted{c, d} }

type shifted struct {
	Clock
	d time.Duration
}

func (s shifted) Now() time.Time { return s.Clock.Now().Add(s.d) }

// Realtime reports whether c runs at the system clock's pace: Real, or
// Real shifted by Shifted. Its durations and timers are real time, and
// work timed by it may run on goroutines of its own.
func Realtime(c Clock) bool {
	if s, ok := c.(shifted); ok {
		return Realtime(s.Clock)
	}
	return c == Real()
}
