// Package clock owns time for leasehold: the Clock interface every other
// package reads time through, the real clock, a Manual clock for tests and
// the simulator, and an Offset estimator that relates this process's clock
// to the store's (Redis TIME) clock.
//
// Process clocks only measure durations here: lease age, timeouts, degraded
// mode GCRA. The store's clock alone decides bucket state.
package clock

import "time"

// Clock is a source of time and timers. Implementations are safe for
// concurrent use. Now must be monotonic for the real clock (time.Now carries
// a monotonic reading); Manual may move backwards when a test asks it to.
type Clock interface {
	// Now returns the current time.
	Now() time.Time
	// AfterFunc calls f in its own goroutine once d has elapsed, unless the
	// returned Timer is stopped first.
	AfterFunc(d time.Duration, f func()) Timer
	// NewTimer returns a Timer that sends the time on its channel once d
	// has elapsed.
	NewTimer(d time.Duration) Timer
}

// Timer is a stoppable, resettable timer, as returned by Clock.
type Timer interface {
	// C returns the channel the timer fires on; nil for AfterFunc timers.
	C() <-chan time.Time
	// Stop prevents the timer from firing. It reports whether it stopped
	// the timer before it fired.
	Stop() bool
	// Reset changes the timer to fire after d. It reports whether the
	// timer had been active.
	Reset(d time.Duration) bool
}

// Real returns the system clock. It is the default everywhere.
func Real() Clock { return realClock{} }

type realClock struct{}

func (realClock) Now() time.Time { return time.Now() }

func (realClock) AfterFunc(d time.Duration, f func()) Timer {
	return realTimer{t: time.AfterFunc(d, f)}
}

func (realClock) NewTimer(d time.Duration) Timer { return realTimer{t: time.NewTimer(d)} }

type realTimer struct{ t *time.Timer }

func (r realTimer) C() <-chan time.Time        { return r.t.C }
func (r realTimer) Stop() bool                 { return r.t.Stop() }
func (r realTimer) Reset(d time.Duration) bool { return r.t.Reset(d) }

// Since returns the time elapsed on c since t. On the real clock it reads
// only the monotonic clock (time.Since), about half the cost of Now on the
// machines measured (BenchmarkSince): a decision on a leased key reads the
// clock once, and that read is most of its cost.
func Since(c Clock, t time.Time) time.Duration {
	if _, ok := c.(realClock); ok {
		return time.Since(t)
	}
	return c.Now().Sub(t)
}
