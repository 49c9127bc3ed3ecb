package hybrid

import (
	"context"
	"github.com/leasehold/leasehold/internal/testkit/poll"
	"log/slog"
	"testing"
	"time"

	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/remote"
	"github.com/stretchr/testify/require"
)

var t0 = time.Unix(1_700_000_000, 0)

// quiet drops mode-change logs in tests.
var quiet = WithLogger(slog.New(slog.DiscardHandler))

// lenient pins stock leases without flow, for tests of what stock alone
// does (sizing by demand, tokens given back whole, charges refunded into
// the lease); WithCapacityLeases given after it turns flow back on.
var lenient = optionFunc(func(c *config) { c.grantTerm, c.grantTermSet = 0, true })

// fakeWorld is a MemoryStore and every limiter on one manual clock.
type fakeWorld struct {
	clk   *clock.Manual
	store *remote.MemoryStore
}

func newFakeWorld() *fakeWorld {
	clk := clock.NewManual(t0)
	return &fakeWorld{clk: clk, store: remote.NewMemory(clk)}
}

func (w *fakeWorld) limiter(t *testing.T, p Policy, opts ...Option) *Limiter {
	t.Helper()
	l, err := New(w.store, p, append([]Option{WithClock(w.clk), quiet}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close(context.Background()) })
	return l
}

// eventually polls cond until it holds or a real-time deadline passes:
// background refills run in real goroutines even under a manual clock.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	poll.Until(t, what, 10*time.Second, cond)
}

// quiesce waits until no refill of l is in flight.
func quiesce(t *testing.T, l *Limiter) {
	t.Helper()
	eventually(t, "refills to finish", func() bool {
		return !l.keys.any(func(e *account) bool { return e.refilling.Load() })
	})
}

// grantAll is a Store that grants every lease in full and keeps no state:
// for measuring the limiter's own memory.
type grantAll struct{ clk *clock.Manual }

func (g grantAll) Lease(_ context.Context, r remote.Request) (remote.Result, error) {
	return remote.Result{Granted: r.N, Remaining: r.Limit.Burst - r.N, Now: g.clk.Now(), Version: r.Version}, nil
}
func (g grantAll) Return(_ context.Context, r remote.Request) (remote.Result, error) {
	return remote.Result{Now: g.clk.Now(), Version: r.Version}, nil
}
func (g grantAll) Debit(_ context.Context, r remote.Request) (remote.Result, error) {
	return remote.Result{Now: g.clk.Now(), Version: r.Version}, nil
}
func (g grantAll) Batch(ctx context.Context, op remote.Op, rs []remote.Request) []remote.Reply {
	out := make([]remote.Reply, len(rs))
	for i := range rs {
		out[i].Result, _ = g.Return(ctx, rs[i])
	}
	return out
}

// measureStalls starts a goroutine that wakes every millisecond and
// returns a func that stops it and reports the longest it woke late: how
// long this process left a runnable goroutine waiting (the scheduler, the
// garbage collector, or other processes on the same cores). A decision
// slower than the limiter allows by no more than that is the machine's.
func measureStalls() func() time.Duration {
	var worst time.Duration
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		tk := time.NewTicker(time.Millisecond)
		defer tk.Stop()
		last := time.Now()
		for {
			select {
			case <-stop:
				return
			case now := <-tk.C:
				// A tick is stamped when it was due; the wake-up is when
				// this goroutine runs.
				woke := time.Now()
				worst = max(worst, woke.Sub(now), woke.Sub(last)-time.Millisecond)
				last = woke
			}
		}
	}()
	return func() time.Duration {
		close(stop)
		<-done
		return worst
	}
}
