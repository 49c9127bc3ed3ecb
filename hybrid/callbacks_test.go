package hybrid

import (
	"context"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leasehold/leasehold/breaker"
	"github.com/sony/gobreaker/v2"
	"github.com/stretchr/testify/require"
)

// callbackHandler is a slog handler that calls back into the limiter on
// every record, as a user's handler that adds the limiter's state might.
type callbackHandler struct {
	l     *atomic.Pointer[Limiter]
	calls *atomic.Int64
}

func (h callbackHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h callbackHandler) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h callbackHandler) WithGroup(string) slog.Handler            { return h }
func (h callbackHandler) Handle(context.Context, slog.Record) error {
	if l := h.l.Load(); l != nil {
		_ = l.Mode()
		_ = l.Stats()
		_ = l.Allow(context.Background(), "from-logger")
		h.calls.Add(1)
	}
	return nil
}

// TestCallbacksMayCallBack: the breaker's OnStateChange and the limiter's
// logger are user code; both run with no lock of ours or gobreaker's held,
// so callbacks that call back into the breaker and the limiter do not
// deadlock through an outage and its recovery.
func TestCallbacksMayCallBack(t *testing.T) {
	t.Parallel()
	w := newFakeWorld()
	st := &flaky{Store: w.store}
	var lp atomic.Pointer[Limiter]
	var bs *breaker.Store
	var changes, logs atomic.Int64
	bs = breaker.NewStore(st, breaker.Settings{Clock: w.clk, Breaker: gobreaker.Settings{
		OnStateChange: func(string, gobreaker.State, gobreaker.State) {
			_ = bs.State()
			if l := lp.Load(); l != nil {
				_ = l.Mode()
				_ = l.Allow(context.Background(), "from-breaker")
			}
			changes.Add(1)
		}}})
	l, err := New(bs, Policy{Name: "callbacks", Limit: PerSecond(100)}, WithClock(w.clk), WithFleetSize(2),
		WithLogger(slog.New(callbackHandler{l: &lp, calls: &logs})))
	require.NoError(t, err)
	lp.Store(l)
	t.Cleanup(func() { _ = l.Close(context.Background()) })

	done := make(chan struct{})
	go func() {
		defer close(done)
		ctx := context.Background()
		st.down.Store(true)
		for i := 0; i < 10; i++ {
			l.Allow(ctx, "k")
		}
		st.down.Store(false)
		for i := 0; i < 400 && l.Mode() != ModeHealthy; i++ {
			w.clk.Advance(10 * time.Millisecond)
			l.Allow(ctx, "k")
		}
	}()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("callbacks calling back into the breaker or limiter deadlocked")
	}
	if changes.Load() < 2 || logs.Load() < 2 {
		t.Fatalf("OnStateChange ran %d times and the logger %d; want both through outage and recovery", changes.Load(), logs.Load())
	}
	if got := l.Mode(); got != ModeHealthy {
		t.Fatalf("Mode() = %v after recovery, want healthy", got)
	}
}
