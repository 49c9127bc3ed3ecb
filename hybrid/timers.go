package hybrid

import (
	"sync"
	"time"

	"github.com/leasehold/leasehold/clock"
)

// Background work runs in callbacks of the limiter's clock, never in
// goroutines of its own: with the real clock each callback gets a
// goroutine from the runtime, and with clock.Manual every callback runs
// inside Advance, so a simulation (or a test) that drives the clock
// decides exactly when background work happens, deterministically.

// after runs f after d on the limiter's clock. Close waits for the callback
// or stops it. It returns nil, scheduling nothing, once Close has begun.
// With a manual clock and d ≤ 0, f runs before after returns.
func (l *Limiter) after(d time.Duration, f func()) clock.Timer {
	if !l.enterBackground() {
		return nil
	}
	t := l.cfg.clk.AfterFunc(d, func() {
		defer l.life.wg.Done()
		f()
	})
	return bgTimer{Timer: t, l: l}
}

// bgTimer releases Close's wait when a callback is stopped before it ran.
type bgTimer struct {
	clock.Timer
	l *Limiter
}

func (t bgTimer) Stop() bool {
	if t.Timer.Stop() {
		t.l.life.wg.Done()
		return true
	}
	return false
}

// ticker runs f every interval on the limiter's clock until stopped.
type ticker struct {
	l     *Limiter
	every time.Duration
	f     func()
	mu    sync.Mutex
	t     clock.Timer // guarded by mu
	done  bool        // guarded by mu
}

// tick starts f, first after `first` (at least 1 ns, so it never runs
// inside New), then every interval.
func (l *Limiter) tick(first, every time.Duration, f func()) *ticker {
	tk := &ticker{l: l, every: every, f: f}
	tk.mu.Lock()
	tk.scheduleLocked(max(first, time.Nanosecond))
	tk.mu.Unlock()
	l.tickers = append(l.tickers, tk)
	return tk
}

func (tk *ticker) scheduleLocked(d time.Duration) {
	if tk.done {
		return
	}
	tk.t = tk.l.after(d, tk.fire)
}

func (tk *ticker) fire() {
	tk.f()
	tk.mu.Lock()
	tk.scheduleLocked(tk.every)
	tk.mu.Unlock()
}

func (tk *ticker) stop() {
	tk.mu.Lock()
	tk.done = true
	t := tk.t
	tk.mu.Unlock()
	if t != nil {
		t.Stop()
	}
}
