package hybrid

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/leasehold/leasehold/remote"
	"github.com/stretchr/testify/require"
)

// TestChargeSettle: what a settled charge does with the difference between
// its estimate and the actual cost, on a bucket of 100 at 10/s that no
// clock advance refills: a refund goes into the key's lease with no store
// call when the lease gave the estimate (else it lapses), an extra comes from the lease first, and the rest is debited, so
// that the bucket's next token waits for the debt to be paid.
func TestChargeSettle(t *testing.T) {
	t.Parallel()
	lim := Limit{Rate: 10, Period: time.Second, Burst: 100}
	for _, tc := range []struct {
		name             string
		estimate, actual int64
		leaseDelta       int64 // change of the key's lease at Settle
		storeCalls       int64 // made by Settle
		debited          int64
		nextTokenAtLeast time.Duration
		nextTokenAtMost  time.Duration
		prime            int64 // a charge refunded whole first: tokens in the lease
		expired          int64 // refunded tokens that lapse
		fromLease        bool  // decisions first, until the lease holds the estimate
	}{
		{name: "refund into the lease", prime: 10, estimate: 2, actual: 1, leaseDelta: 1, fromLease: true},
		{name: "exact", estimate: 50, actual: 50},
		{name: "refund of everything", prime: 10, estimate: 2, actual: 0, leaseDelta: 2, fromLease: true},
		// A store call handed the estimate out at once: no record counts
		// it, and its refund goes to the bucket (no clock advance here:
		// nothing refilled, nothing lapses).
		{name: "refund of a store call's charge", estimate: 50, actual: 20, storeCalls: 1},
		{name: "extra from the lease", prime: 10, estimate: 2, actual: 5, leaseDelta: -3},
		{name: "extra as debt", estimate: 100, actual: 150, storeCalls: 1, debited: 50,
			nextTokenAtLeast: 5 * time.Second},
		{name: "no extra, no debt", estimate: 100, actual: 100, nextTokenAtMost: 200 * time.Millisecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			w := newFakeWorld()
			l := w.limiter(t, Policy{Name: "settle", Limit: lim}, lenient)
			ctx := context.Background()
			if tc.prime > 0 {
				ch, err := l.ChargeN(ctx, "k", tc.prime)
				require.NoError(t, err)
				require.NoError(t, ch.Settle(0))
			}
			for i := 0; tc.fromLease && i < 20 && l.keys.load("k").lease.Tokens() < tc.estimate; i++ {
				require.True(t, l.Allow(ctx, "k"))
				quiesce(t, l)
			}
			ch, err := l.ChargeN(ctx, "k", tc.estimate)
			require.NoError(t, err)
			require.True(t, ch.Allowed, "%+v", ch.Decision)
			if tc.fromLease {
				require.Equal(t, SourceLease, ch.Source)
			}
			quiesce(t, l)
			e := l.keys.load("k")
			lease, calls, expired := e.lease.Tokens(), l.Stats().StoreCalls, l.Stats().TokensExpired
			require.NoError(t, ch.Settle(tc.actual))
			require.Equal(t, tc.expired, l.Stats().TokensExpired-expired, "refunded tokens lapsed")
			if tc.debited > 0 {
				eventually(t, "the debit", func() bool { return l.Stats().TokensDebited >= tc.debited })
			}
			require.Equal(t, tc.leaseDelta, e.lease.Tokens()-lease, "lease tokens after Settle")
			require.Equal(t, tc.storeCalls, l.Stats().StoreCalls-calls, "store calls made by Settle")
			require.Equal(t, tc.debited, l.Stats().TokensDebited)
			if tc.nextTokenAtLeast > 0 || tc.nextTokenAtMost > 0 {
				e.lease.Drain()
				req := l.policy.load().requestFor(l.cfg.prefix, "k", 0)
				req.N, req.Min, req.Need = 1, 1, 1
				res, err := w.store.Lease(ctx, req)
				require.NoError(t, err)
				require.Zero(t, res.Granted, "the bucket had a token: %+v", res)
				if tc.nextTokenAtLeast > 0 {
					require.GreaterOrEqual(t, res.RetryAfter, tc.nextTokenAtLeast, "next token after the debt")
				}
				if tc.nextTokenAtMost > 0 {
					require.LessOrEqual(t, res.RetryAfter, tc.nextTokenAtMost, "next token without debt")
				}
			}
		})
	}
}

// TestChargeSettleBadUse: a negative actual and a second Settle are
// refused with their sentinels, a refused estimate settles to nothing, and
// a closed limiter charges nothing.
func TestChargeSettleBadUse(t *testing.T) {
	t.Parallel()
	w := newFakeWorld()
	l := w.limiter(t, Policy{Name: "settle-bad", Limit: Limit{Rate: 10, Period: time.Second, Burst: 10}})
	ctx := context.Background()
	ch, err := l.ChargeN(ctx, "k", 10)
	require.NoError(t, err)
	require.ErrorIs(t, ch.Settle(-1), ErrInvalidN)
	require.NoError(t, ch.Settle(3))
	require.ErrorIs(t, ch.Settle(3), ErrSettled)

	refused, err := l.ChargeN(ctx, "k", 10)
	require.NoError(t, err)
	require.False(t, refused.Allowed, "%+v", refused.Decision)
	held := l.keys.load("k").lease.Tokens()
	require.NoError(t, refused.Settle(0))
	require.Equal(t, held, l.keys.load("k").lease.Tokens(), "a refused charge gave tokens back")

	_, err = l.ChargeN(ctx, "k", 0)
	require.ErrorIs(t, err, ErrInvalidN)
	_, err = l.ChargeN(ctx, "k", 11)
	require.ErrorIs(t, err, ErrExceedsBurst)

	late, err := l.ChargeN(ctx, "other", 5)
	require.NoError(t, err)
	require.NoError(t, l.Close(ctx))
	require.True(t, errors.Is(late.Settle(9), ErrClosed))
}

// TestChargeSettleDuringOutage: a charge the degraded share admitted
// settles into the outage debt, which the recovery charges.
func TestChargeSettleDuringOutage(t *testing.T) {
	t.Parallel()
	w := newFakeWorld()
	st := &flaky{Store: w.store}
	l, err := New(st, Policy{Name: "settle-outage", Limit: Limit{Rate: 100, Period: time.Second, Burst: 100}},
		WithClock(w.clk), WithFleetSize(2), quiet)
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close(context.Background()) })
	ctx := context.Background()
	st.down.Store(true)
	for l.Mode() != ModeDegraded {
		l.Allow(ctx, "trip")
	}
	ch, err := l.ChargeN(ctx, "k", 10)
	require.NoError(t, err)
	require.True(t, ch.Allowed && ch.Source == SourceDegraded, "%+v", ch.Decision)
	debt := l.Stats().OutageDebt
	require.NoError(t, ch.Settle(25))
	require.Equal(t, debt+15, l.Stats().OutageDebt, "outage debt after an extra of 15")
	ch, err = l.ChargeN(ctx, "k", 10)
	require.NoError(t, err)
	require.NoError(t, ch.Settle(4))
	require.Equal(t, debt+15+4, l.Stats().OutageDebt, "outage debt after a refund of 6")
}

// TestChargeSettleShapesAndTiers: a sliding window, and a key under
// several limits, get no refund back (the tokens count in their window
// until it passes) and are debited an extra on every limit; a key under a
// tier settles into its tier's bucket.
func TestChargeSettleShapesAndTiers(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	t.Run("sliding window", func(t *testing.T) {
		w := newFakeWorld()
		l := w.limiter(t, Policy{Name: "settle-window", Algorithm: SlidingWindow, Limit: Limit{Rate: 100, Period: time.Minute, Burst: 100}})
		ch, err := l.ChargeN(ctx, "k", 50)
		require.NoError(t, err)
		require.True(t, ch.Allowed)
		quiesce(t, l)
		e := l.keys.load("k")
		lease, calls := e.lease.Tokens(), l.Stats().StoreCalls
		require.NoError(t, ch.Settle(10))
		require.Equal(t, lease, e.lease.Tokens(), "a window's refund went into the lease")
		require.Equal(t, calls, l.Stats().StoreCalls, "a window's refund made a store call")
		ch, err = l.ChargeN(ctx, "k", 20)
		require.NoError(t, err)
		require.True(t, ch.Allowed)
		quiesce(t, l)
		require.Zero(t, e.lease.Tokens(), "charges above a lease lease exactly what they need")
		require.NoError(t, ch.Settle(45))
		eventually(t, "the debit", func() bool { return l.Stats().TokensDebited == 25 })
		// 50 + 20 charged and 25 debited: the window holds 5 more.
		requireLast(t, l, "k", 5)
	})
	t.Run("several limits", func(t *testing.T) {
		// 100 a minute and 90 an hour: a refund is not given back, an
		// extra is debited to both, and the hour's, the tighter after
		// it, decides.
		w := newFakeWorld()
		l := w.limiter(t, Policy{Name: "settle-also", Limit: Limit{Rate: 100, Period: time.Minute, Burst: 100},
			Also: []Limit{{Rate: 90, Period: time.Hour, Burst: 90}}})
		ch, err := l.ChargeN(ctx, "k", 50)
		require.NoError(t, err)
		require.True(t, ch.Allowed)
		quiesce(t, l)
		calls := l.Stats().StoreCalls
		require.NoError(t, ch.Settle(40))
		require.Equal(t, calls, l.Stats().StoreCalls, "a refund under several limits made a store call")
		ch, err = l.ChargeN(ctx, "k", 20)
		require.NoError(t, err)
		require.True(t, ch.Allowed)
		quiesce(t, l)
		e := l.keys.load("k")
		lease := e.lease.Tokens()
		require.NoError(t, ch.Settle(30))
		// The extra comes from the lease, the rest is debited.
		eventually(t, "the debit", func() bool { return l.Stats().TokensDebited == max(10-lease, 0) })
		// 50 + 20 charged and 10 more settled: the hour holds 10 more
		// (leased or in the bucket), the minute 20.
		requireLast(t, l, "k", 10)
	})
	t.Run("tiers", func(t *testing.T) {
		w := newFakeWorld()
		p := Policy{Name: "settle-tiers", Limit: Limit{Rate: 1, Period: time.Hour, Burst: 10}, Version: 1,
			Tiers: map[string]Tier{"paid": {Limit: Limit{Rate: 1, Period: time.Hour, Burst: 100}}}}
		l := w.limiter(t, p, WithTier(func(string) string { return "paid" }))
		ch, err := l.ChargeN(ctx, "acme", 10)
		require.NoError(t, err)
		require.True(t, ch.Allowed)
		require.NoError(t, ch.Settle(70))
		require.NoError(t, l.Close(ctx))
		res, err := w.store.Lease(ctx, remote.Request{Prefix: remote.DefaultPrefix, Policy: p.Name, Tier: "paid", Key: "acme",
			Limit: p.Tiers["paid"].Limit, Version: 1, N: 100, Min: 1, Need: 1})
		require.NoError(t, err)
		require.Equal(t, int64(30), res.Granted, "the paid tier's bucket after a settled cost of 70")
	})
}

// requireLast checks that key has exactly last tokens left: last+1 at once
// is refused, last is admitted.
func requireLast(t *testing.T, l *Limiter, key string, last int64) {
	t.Helper()
	ctx := context.Background()
	d, err := l.AllowN(ctx, key, last+1)
	require.NoError(t, err)
	require.False(t, d.Allowed, "%d admitted with %d left: %+v", last+1, last, d)
	d, err = l.AllowN(ctx, key, last)
	require.NoError(t, err)
	require.True(t, d.Allowed, "the last %d refused: %+v", last, d)
}

// TestStockRefundComesBack: under stock records a charge settled at 0
// gives its tokens back into the lease while the record that counts them
// is the lease's (issue: a refused request charges none of its
// descriptors), so 20 such charges on a key of 5/s all pass; settled at
// the estimate, only the burst does.
func TestStockRefundComesBack(t *testing.T) {
	ctx := context.Background()
	for _, actual := range []int64{0, 1} {
		w := newFakeWorld()
		l := w.limiter(t, Policy{Name: "stock-refund-" + strconv.FormatInt(actual, 10), Limit: PerSecond(5)}, lenient)
		admitted := 0
		for range 20 {
			ch, err := l.ChargeN(ctx, "k", 1)
			require.NoError(t, err)
			if ch.Allowed {
				admitted++
				require.NoError(t, ch.Settle(actual))
			}
		}
		want := 20
		if actual == 1 {
			want = 5
		}
		require.Equal(t, want, admitted, "settled at %d", actual)
	}
}
