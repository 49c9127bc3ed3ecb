package hybrid

import (
	"context"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/leasehold/leasehold/remote"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// TestSlidingWindowInVirtualTime runs 8 limiters of a sliding window of
// 1 000 per 10 s at 3× demand for 40 s of virtual time on MemoryStore, and
// 22 s on the Lua script (miniredis, its TIME moved with the clock, which
// is slower): every 10 s
// window, at 100 ms steps, admits at most 1 000 and, once a whole window
// has passed, at least 90% of it.
func TestSlidingWindowInVirtualTime(t *testing.T) {
	for _, script := range []bool{false, true} {
		name := map[bool]string{false: "memory", true: "lua"}[script]
		t.Run(name, func(t *testing.T) {
			w := newFakeWorld()
			var store remote.Store = w.store
			sync := func() {}
			if script {
				mr := miniredis.RunT(t)
				mr.SetTime(w.clk.Now())
				c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
				t.Cleanup(func() { _ = c.Close() })
				store = remote.NewRedis(c)
				sync = func() { mr.SetTime(w.clk.Now()) }
			}
			p := Policy{Name: "sw", Limit: Limit{Rate: 1000, Period: 10 * time.Second}, Algorithm: SlidingWindow}
			var lims []*Limiter
			for range 8 {
				l, err := New(store, p, WithClock(w.clk), quiet)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = l.Close(context.Background()) })
				lims = append(lims, l)
			}
			var adm []time.Duration
			ctx := context.Background()
			run := 40 * time.Second
			if script {
				run = 22 * time.Second
			}
			for ms, i := 0, 0; ms < int(run/time.Millisecond); ms++ {
				// 300/s, one decision every 10/3 ms, round robin.
				for ; i*10 < ms*3; i++ {
					if lims[i%8].Allow(ctx, "k") {
						adm = append(adm, time.Duration(ms)*time.Millisecond)
					}
				}
				w.clk.Advance(time.Millisecond)
				sync()
			}
			lo, hi := 1<<30, 0
			for end := 100 * time.Millisecond; end <= run; end += 100 * time.Millisecond {
				n := 0
				for _, a := range adm {
					if a > end-10*time.Second && a <= end {
						n++
					}
				}
				hi = max(hi, n)
				if end >= 10*time.Second {
					lo = min(lo, n)
				}
			}
			s := fleetStats(lims)
			t.Logf("%s: admitted %d in %v, per 10 s window at most %d and at least %d, %d store calls", name, len(adm), run, hi, lo, s.StoreCalls)
			if hi > 1000 {
				t.Fatalf("a window admitted %d, over 1 000", hi)
			}
			if lo < 900 {
				t.Fatalf("a window admitted %d, under 90%% of 1 000", lo)
			}
		})
	}
}

// TestSlidingWindowOutage: while the store is down a window policy admits
// this process's share and no more (a window of 100 per 10 s among 4 is 25
// per 10 s at most: a bucket of 12 refilled by 12.5 per 10 s), and after
// recovery the window is charged everything the share admitted, so the
// fleet's window counts it.
func TestSlidingWindowOutage(t *testing.T) {
	w := newFakeWorld()
	st := &flaky{Store: w.store}
	p := Policy{Name: "window-outage", Limit: Limit{Rate: 100, Period: 10 * time.Second}, Algorithm: SlidingWindow}
	l, err := New(st, p, WithClock(w.clk), WithFleetSize(4), quiet)
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close(context.Background()) })
	ctx := context.Background()

	st.down.Store(true)
	var admitted int64
	for range 10 * 100 { // 10 s at 100 decisions a second
		if d, err := l.AllowN(ctx, "k", 1); err != nil {
			t.Fatal(err)
		} else if d.Allowed {
			admitted++
		}
		w.clk.Advance(10 * time.Millisecond)
	}
	if degraded := l.Stats().Source(SourceDegraded).Admitted; admitted > 25 || degraded != admitted || admitted < 12 {
		t.Fatalf("10 s of outage admitted %d (%d by the degraded share), want the share: 12 to 25", admitted, degraded)
	}

	st.down.Store(false)
	eventually(t, "recovery to healthy", func() bool {
		l.Allow(ctx, "probe")
		w.clk.Advance(10 * time.Millisecond)
		s := l.Stats()
		return s.Mode == ModeHealthy && s.OutageDebt == 0
	})
	if st.debited.Load() < admitted {
		t.Fatalf("charged %d tokens for %d admitted on the window's key", st.debited.Load(), admitted)
	}
	// The window now counts the outage's admissions: with this limiter's
	// lease given back, the rest of the window is all that can be leased.
	require.NoError(t, l.Close(ctx))
	res, err := w.store.Lease(ctx, remote.Request{Policy: p.Name, Key: "k", Limit: Limit{Rate: 100, Period: 10 * time.Second, Burst: 100},
		Version: 1, Window: true, N: 100, Need: 1})
	require.NoError(t, err)
	if res.Granted > 100-admitted {
		t.Fatalf("after an outage that admitted %d, the window granted %d", admitted, res.Granted)
	}
}

// TestReserveOnWindowCancels: a reservation on a sliding window is granted
// now or not at all (windows are not future-dated), and Cancel gives its
// tokens back to the sub-window that counted them.
func TestReserveOnWindowCancels(t *testing.T) {
	w := newFakeWorld()
	p := Policy{Name: "window-reserve", Limit: Limit{Rate: 4, Period: time.Second}, Algorithm: SlidingWindow}
	l := w.limiter(t, p, WithMaxLeaseFraction(0.25))
	ctx := context.Background()
	r, err := l.ReserveN(ctx, "k", 4)
	require.NoError(t, err)
	require.True(t, r.OK())
	require.Zero(t, r.DelayFrom(w.clk.Now()))
	r2, err := l.ReserveN(ctx, "k", 1)
	require.NoError(t, err)
	require.False(t, r2.OK(), "the window is full")
	r.Cancel()
	eventually(t, "the cancelled tokens back in the window", func() bool {
		res, err := w.store.Lease(ctx, remote.Request{Policy: p.Name, Key: "k", Limit: Limit{Rate: 4, Period: time.Second, Burst: 4},
			Version: 1, Window: true, N: 1})
		return err == nil && res.Granted == 1
	})
}
