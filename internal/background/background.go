package background

import (
	"context"
	"sync"
	"time"

	"github.com/leasehold/leasehold/clock"
)

// Package background runs a limiter's background work in callbacks of its
// clock, never in goroutines of its own: with the real clock each callback gets a
// goroutine from the runtime, and with clock.Manual every callback runs
// inside Advance, so a simulation (or a test) that drives the clock
// decides exactly when background work happens, deterministically.

// Group owns a limiter's lifetime: every callback and store flight enters
// it, and Close stops new ones and waits for the running ones.
type Group struct {
	clk clock.Clock
	// Ctx ends when Close begins; background store calls run under it.
	Ctx    context.Context
	cancel context.CancelFunc
	// Done is closed when Close begins.
	Done chan struct{}
	wg   sync.WaitGroup
	mu   struct {
		sync.Mutex
		closed  bool
		tickers []*ticker
	}
}

// New returns a Group whose callbacks run on clk.
func New(clk clock.Clock) *Group {
	b := &Group{clk: clk, Done: make(chan struct{})}
	b.Ctx, b.cancel = context.WithCancel(context.Background())
	return b
}

// Enter registers one unit of background work; it reports false, and
// registers nothing, once Close has begun. Each true must be matched by
// Exit.
func (b *Group) Enter() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.mu.closed {
		return false
	}
	b.wg.Add(1)
	return true
}

func (b *Group) Exit() { b.wg.Done() }

// After runs f after d on the limiter's clock. Close waits for the callback
// or stops it. It returns nil, scheduling nothing, once Close has begun.
// With a manual clock and d ≤ 0, f runs before after returns.
func (b *Group) After(d time.Duration, f func()) clock.Timer {
	if !b.Enter() {
		return nil
	}
	t := b.clk.AfterFunc(d, func() {
		defer b.Exit()
		f()
	})
	return bgTimer{Timer: t, b: b}
}

// bgTimer releases Close's wait when a callback is stopped before it ran.
type bgTimer struct {
	clock.Timer
	b *Group
}

func (t bgTimer) Stop() bool {
	if t.Timer.Stop() {
		t.b.Exit()
		return true
	}
	return false
}

// Tick runs f first after `first` (at least 1 ns, so it never runs inside
// New), then every interval, until Close.
func (b *Group) Tick(first, every time.Duration, f func()) {
	tk := &ticker{b: b, every: every, f: f}
	tk.mu.Lock()
	tk.scheduleLocked(max(first, time.Nanosecond))
	tk.mu.Unlock()
	b.mu.Lock()
	b.mu.tickers = append(b.mu.tickers, tk)
	b.mu.Unlock()
}

// Close stops new work, ends ctx and stops the tickers; it reports false
// if it was already closed. Running work is not waited for (see Wait).
func (b *Group) Close() bool {
	b.mu.Lock()
	if b.mu.closed {
		b.mu.Unlock()
		return false
	}
	b.mu.closed = true
	tickers := b.mu.tickers
	b.mu.Unlock()
	close(b.Done)
	b.cancel()
	for _, tk := range tickers {
		tk.halt()
	}
	return true
}

// Wait blocks until every callback and flight has exited.
func (b *Group) Wait() { b.wg.Wait() }

// ticker runs f every interval on the limiter's clock until halted.
type ticker struct {
	b     *Group
	every time.Duration
	f     func()
	mu    sync.Mutex
	t     clock.Timer // guarded by mu
	done  bool        // guarded by mu
}

func (tk *ticker) scheduleLocked(d time.Duration) {
	if tk.done {
		return
	}
	tk.t = tk.b.After(d, tk.fire)
}

func (tk *ticker) fire() {
	tk.f()
	tk.mu.Lock()
	tk.scheduleLocked(tk.every)
	tk.mu.Unlock()
}

func (tk *ticker) halt() {
	tk.mu.Lock()
	tk.done = true
	t := tk.t
	tk.mu.Unlock()
	if t != nil {
		t.Stop()
	}
}
