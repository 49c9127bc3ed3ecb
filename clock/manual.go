package clock

import (
	"sync"
	"time"
)

// Manual is a Clock that moves only when told to. Advance fires every timer
// whose deadline it passes, in deadline order, before it returns: AfterFunc
// callbacks run synchronously in the caller's goroutine, so a test that
// advances the clock observes their effects at once. The zero value is not
// usable; call NewManual. Manual is safe for concurrent use.
type Manual struct {
	mu struct {
		sync.Mutex
		now    time.Time
		timers []*manualTimer // pending, unordered
		seq    uint64
	}
}

var _ Clock = (*Manual)(nil)

// NewManual returns a Manual clock reading start.
func NewManual(start time.Time) *Manual {
	m := &Manual{}
	m.mu.now = start
	return m
}

// Now returns the clock's current reading.
func (m *Manual) Now() time.Time {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.mu.now
}

// Advance moves the clock forward by d and fires the timers that come due.
func (m *Manual) Advance(d time.Duration) {
	if d < 0 {
		d = 0
	}
	m.mu.Lock()
	target := m.mu.now.Add(d)
	m.mu.Unlock()
	m.AdvanceTo(target)
}

// AdvanceTo moves the clock forward to t (never backwards) and fires the
// timers that come due, each at its own deadline.
func (m *Manual) AdvanceTo(t time.Time) {
	for {
		m.mu.Lock()
		due := m.nextDueLocked(t)
		if due == nil {
			if t.After(m.mu.now) {
				m.mu.now = t
			}
			m.mu.Unlock()
			return
		}
		if due.when.After(m.mu.now) {
			m.mu.now = due.when
		}
		now := m.mu.now
		m.removeLocked(due)
		m.mu.Unlock()
		// Fire outside the lock: callbacks may read the clock or add timers.
		if due.f != nil {
			due.f()
		} else {
			select {
			case due.c <- now:
			default:
			}
		}
	}
}

// Backwards moves the clock back by d, as a wall clock stepped by NTP would.
// Pending timers keep their deadlines.
func (m *Manual) Backwards(d time.Duration) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.mu.now = m.mu.now.Add(-d)
}

// Pending returns how many timers are waiting to fire.
func (m *Manual) Pending() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.mu.timers)
}

// NextDeadline returns the earliest pending timer deadline, if any.
func (m *Manual) NextDeadline() (time.Time, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.mu.timers) == 0 {
		return time.Time{}, false
	}
	next := m.mu.timers[0]
	for _, t := range m.mu.timers[1:] {
		if t.before(next) {
			next = t
		}
	}
	return next.when, true
}

// AfterFunc implements Clock. f runs synchronously inside Advance.
func (m *Manual) AfterFunc(d time.Duration, f func()) Timer {
	return m.add(d, f, nil)
}

// NewTimer implements Clock.
func (m *Manual) NewTimer(d time.Duration) Timer {
	return m.add(d, nil, make(chan time.Time, 1))
}

func (m *Manual) add(d time.Duration, f func(), c chan time.Time) *manualTimer {
	t := &manualTimer{m: m, f: f, c: c}
	m.mu.Lock()
	m.scheduleLocked(t, d)
	m.mu.Unlock()
	if d <= 0 {
		m.AdvanceTo(m.Now())
	}
	return t
}

func (m *Manual) scheduleLocked(t *manualTimer, d time.Duration) {
	m.mu.seq++
	t.when = m.mu.now.Add(d)
	t.seq = m.mu.seq
	m.mu.timers = append(m.mu.timers, t)
}

func (m *Manual) nextDueLocked(limit time.Time) *manualTimer {
	var next *manualTimer
	for _, t := range m.mu.timers {
		if t.when.After(limit) {
			continue
		}
		if next == nil || t.before(next) {
			next = t
		}
	}
	return next
}

func (m *Manual) removeLocked(t *manualTimer) bool {
	for i, x := range m.mu.timers {
		if x == t {
			m.mu.timers = append(m.mu.timers[:i], m.mu.timers[i+1:]...)
			return true
		}
	}
	return false
}

type manualTimer struct {
	m    *Manual
	f    func()
	c    chan time.Time
	when time.Time // guarded by m.mu
	seq  uint64    // guarded by m.mu; orders equal deadlines by creation
}

func (t *manualTimer) before(o *manualTimer) bool {
	if t.when.Equal(o.when) {
		return t.seq < o.seq
	}
	return t.when.Before(o.when)
}

func (t *manualTimer) C() <-chan time.Time { return t.c }

func (t *manualTimer) Stop() bool {
	t.m.mu.Lock()
	defer t.m.mu.Unlock()
	return t.m.removeLocked(t)
}

func (t *manualTimer) Reset(d time.Duration) bool {
	t.m.mu.Lock()
	active := t.m.removeLocked(t)
	t.m.scheduleLocked(t, d)
	t.m.mu.Unlock()
	if d <= 0 {
		t.m.AdvanceTo(t.m.Now())
	}
	return active
}
