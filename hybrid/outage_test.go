package hybrid

import (
	"context"
	"errors"
	"math/rand/v2"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leasehold/leasehold/remote"
	"github.com/stretchr/testify/require"
)

// flaky is a Store that fails with ErrUnavailable while down is set.
type flaky struct {
	remote.Store
	down    atomic.Bool
	debited atomic.Int64 // tokens charged through Debit or a debit Batch
}

func (f *flaky) err() error { return errors.Join(remote.ErrUnavailable, errors.New("flaky: down")) }

func (f *flaky) Lease(ctx context.Context, r remote.Request) (remote.Result, error) {
	if f.down.Load() {
		return remote.Result{}, f.err()
	}
	return f.Store.Lease(ctx, r)
}

func (f *flaky) Return(ctx context.Context, r remote.Request) (remote.Result, error) {
	if f.down.Load() {
		return remote.Result{}, f.err()
	}
	return f.Store.Return(ctx, r)
}

func (f *flaky) Debit(ctx context.Context, r remote.Request) (remote.Result, error) {
	if f.down.Load() {
		return remote.Result{}, f.err()
	}
	res, err := f.Store.Debit(ctx, r)
	if err == nil {
		f.debited.Add(r.N)
	}
	return res, err
}

func (f *flaky) Batch(ctx context.Context, op remote.Op, rs []remote.Request) []remote.Reply {
	if f.down.Load() {
		return remote.FailedReplies(len(rs), f.err())
	}
	out := f.Store.Batch(ctx, op, rs)
	for i, r := range out {
		if op == remote.OpDebit && r.Err == nil {
			f.debited.Add(rs[i].N)
		}
	}
	return out
}

// TestOutageModes runs each outage mode against a store that goes down and
// comes back: decisions never error, carry the mode's Source, and after
// recovery the degraded admissions are charged to the bucket.
func TestOutageModes(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		mode       OutageMode
		wantSource Source
	}{
		{OutageDegraded, SourceDegraded},
		{OutageFailOpen, SourceFailOpen},
		{OutageFailClosed, SourceFailClosed},
	} {
		t.Run(tc.mode.String(), func(t *testing.T) {
			t.Parallel()
			w := newFakeWorld()
			st := &flaky{Store: w.store}
			lim := Limit{Rate: 100, Period: time.Second, Burst: 100}
			p := Policy{Name: "outage-" + tc.mode.String(), Limit: lim}
			l, err := New(st, p, WithClock(w.clk), WithOutageMode(tc.mode), WithFleetSize(4), quiet)
			require.NoError(t, err)
			t.Cleanup(func() { _ = l.Close(context.Background()) })
			ctx := context.Background()

			st.down.Store(true)
			var admitted, rejected int64
			for i := 0; i < 100; i++ {
				d, err := l.AllowN(ctx, "k", 1)
				if err != nil {
					t.Fatalf("AllowN during outage: %v", err)
				}
				if i >= 3 && d.Source != tc.wantSource { // the breaker trips after 3 failures
					t.Fatalf("decision %d Source = %v, want %v", i, d.Source, tc.wantSource)
				}
				if d.Allowed {
					admitted++
				} else {
					rejected++
				}
			}
			if got := l.Mode(); got != ModeDegraded {
				t.Fatalf("Mode() = %v during outage, want degraded", got)
			}
			switch tc.mode {
			case OutageDegraded:
				// Share of one process in four: Burst 100/4 = 25.
				if admitted != 25 {
					t.Fatalf("degraded admitted %d of 100 at once, want the share's burst 25", admitted)
				}
			case OutageFailOpen:
				if admitted != 100 {
					t.Fatalf("fail-open admitted %d of 100", admitted)
				}
			case OutageFailClosed:
				if admitted != 0 {
					t.Fatalf("fail-closed admitted %d", admitted)
				}
			}
			st.down.Store(false)
			// gobreaker's open state lasts 200 ms of real time; the
			// reconciler's jitter and pacing run on the limiter's clock.
			eventually(t, "recovery to healthy", func() bool {
				l.Allow(ctx, "probe")
				w.clk.Advance(10 * time.Millisecond)
				s := l.Stats()
				return s.Mode == ModeHealthy && s.OutageDebt == 0 && s.ModeChanges >= 2
			})
			// The store was charged the outage's unpaid use: for degraded
			// mode what the share buckets had not refilled, for fail-open at
			// most one Burst per key (two keys here: "k" and "probe").
			got, outage := st.debited.Load(), l.Stats().Source(tc.wantSource).Admitted
			switch tc.mode {
			case OutageDegraded:
				if got <= 0 || got > outage || got > 2*25 {
					t.Fatalf("charged %d tokens; outage admitted %d, share burst 25 per key", got, outage)
				}
			case OutageFailOpen:
				if want := min(admitted, lim.Burst) + min(outage-admitted, lim.Burst); got != want {
					t.Fatalf("charged %d tokens, want %d (one Burst at most per key)", got, want)
				}
			case OutageFailClosed:
				if got != 0 {
					t.Fatalf("fail-closed charged %d tokens", got)
				}
			}
			if s := l.Stats(); s.Source(tc.wantSource).Admitted+s.Source(tc.wantSource).Rejected < 97 || s.ModeChanges < 2 {
				t.Fatalf("Stats = %+v", s)
			}
		})
	}
}

// TestSecondOutageStartsEmpty: a key in use when the store goes away
// starts its share with at most this process's part of what the bucket held
// at its last answer, in the second outage as in the first. (The share
// bucket of the first outage used to be kept, and had refilled to a full
// share burst by the second: the demo showed twice the limit in the
// second outage's first second.)
func TestSecondOutageStartsEmpty(t *testing.T) {
	t.Parallel()
	w := newFakeWorld()
	st := &flaky{Store: w.store}
	l, err := New(st, Policy{Name: "second-outage", Limit: Limit{Rate: 100, Period: time.Second, Burst: 100}},
		WithClock(w.clk), WithFleetSize(4), quiet)
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close(context.Background()) })
	ctx := context.Background()
	burst := func() (admitted int) {
		for range 100 {
			if d, err := l.AllowN(ctx, "k", 1); err != nil {
				t.Fatalf("AllowN: %v", err)
			} else if d.Allowed && d.Source == SourceDegraded {
				admitted++
			}
		}
		return admitted
	}
	for outage := 1; outage <= 2; outage++ {
		for range 80 { // the key is in use, its bucket drawn down
			l.Allow(ctx, "k")
		}
		level := l.keys.load("k").answer.level.Load()
		t.Logf("outage %d: bucket level %d at the last answer", outage, level)
		st.down.Store(true)
		// A share kept from the first outage would hold its whole burst, 25.
		if got, want := burst(), int(max(level, 0)/4); got > want {
			t.Fatalf("outage %d: the share admitted %d at once on a key whose bucket held %d, want ≤ %d (a quarter)", outage, got, level, want)
		}
		st.down.Store(false)
		eventually(t, "recovery to healthy", func() bool {
			l.Allow(ctx, "probe")
			w.clk.Advance(10 * time.Millisecond)
			return l.Mode() == ModeHealthy
		})
		// 10 s of light use: the key stays tracked, and a share bucket
		// kept from this outage would refill to its whole burst.
		for range 40 {
			w.clk.Advance(250 * time.Millisecond)
			l.Allow(ctx, "k")
		}
	}
}

// laggy is a Store whose bucket calls take delay each: longer than the
// store timeout, shorter than the breaker's latency threshold.
type laggy struct {
	remote.Store
	delay time.Duration
}

func (s *laggy) wait(ctx context.Context) error {
	t := time.NewTimer(s.delay) // the store's own latency, not a test waiting for a condition
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return errors.Join(remote.ErrUnavailable, ctx.Err())
	}
}

func (s *laggy) Lease(ctx context.Context, r remote.Request) (remote.Result, error) {
	if err := s.wait(ctx); err != nil {
		return remote.Result{}, err
	}
	return s.Store.Lease(ctx, r)
}

// TestSlowStoreAtLimitKeepsBound: one of two limiters gets every answer
// 120 ms late (past the 50 ms store timeout, under the breaker's 500 ms
// threshold) while the other's store answers at once, both at several
// times the limit. The slow one's decisions are not made by its degraded
// share on top of the bucket its peer drains: the fleet stays within
// Burst + Rate·t.
func TestSlowStoreAtLimitKeepsBound(t *testing.T) {
	if testing.Short() {
		t.Skip("2 s of load")
	}
	store := remote.NewMemory(nil)
	p := Policy{Name: "slow-at-limit", Limit: Limit{Rate: 1000, Period: time.Second, Burst: 100}}
	fast, err := New(store, p, quiet, WithFleetSize(2))
	require.NoError(t, err)
	slow, err := New(&laggy{Store: store, delay: 120 * time.Millisecond}, p, quiet, WithFleetSize(2))
	require.NoError(t, err)
	lims := []*Limiter{fast, slow}
	admitted, offered, elapsed := hammer(lims, 4, 2*time.Second, func(*rand.Rand) string { return "k" })
	for _, l := range lims {
		require.NoError(t, l.Close(context.Background()))
	}
	bound := p.Limit.Burst + p.Limit.TokensIn(elapsed)
	t.Logf("offered %d, admitted %d, bound %d (%.2f%%); slow limiter: %d mode changes, %d by the degraded share, %d refused by the store's last answer",
		offered["k"], admitted["k"], bound, 100*float64(admitted["k"])/float64(bound),
		slow.Stats().ModeChanges, slow.Stats().Source(SourceDegraded).Admitted, slow.Stats().Source(SourceRemote).Rejected)
	if offered["k"] < 3*bound {
		t.Fatalf("offered %d < 3× bound %d: the key was not at its limit", offered["k"], bound)
	}
	if admitted["k"] > bound {
		t.Fatalf("admitted %d > Burst + Rate·t = %d", admitted["k"], bound)
	}
}
