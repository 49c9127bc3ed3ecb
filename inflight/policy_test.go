package inflight

import (
	"context"
	"errors"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"github.com/leasehold/leasehold/remote"
)

func newPolicyLimiter(t *testing.T, store remote.Store, p Policy, opts ...Option) *Limiter {
	t.Helper()
	l, err := NewWithPolicy(store, p, opts...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close(context.Background()) })
	return l
}

// TestSetPolicy: a lowered limit holds at once in the limiter that set it
// (requests in flight finish, no acquire passes until under the new
// limit), reaches another limiter's key at its next store call and the
// limiter itself within a poll; a version not above the one in force is
// ErrStalePolicy unless it is that very policy.
func TestSetPolicy(t *testing.T) {
	clk := clock.NewManual(t0)
	store := remote.NewMemory(clk)
	p := Policy{Name: "set-policy", Slots: 4, Version: 1}
	a := newPolicyLimiter(t, store, p, WithClock(clk), WithFleetSize(2))
	b := newPolicyLimiter(t, store, p, WithClock(clk), WithFleetSize(2))
	for range 4 {
		require.True(t, a.TryAcquire("k", 1))
	}
	ctx := context.Background()
	require.NoError(t, a.SetPolicy(ctx, Policy{Name: p.Name, Slots: 2, Version: 2}))
	require.False(t, a.TryAcquire("k", 1), "an acquire above the lowered limit")
	a.Release("k", 2)
	require.False(t, a.TryAcquire("k", 1), "2 in flight under a limit of 2")
	a.Release("k", 1)
	require.True(t, a.TryAcquire("k", 1), "1 in flight under a limit of 2")
	require.False(t, b.TryAcquire("k", 1), "b, still on v1, got a slot the v2 limit does not have")
	// b learns v2 by its next poll.
	clk.Advance(time.Second)
	require.Equal(t, uint64(2), b.Policy().Version)
	require.Equal(t, int64(2), b.Policy().Slots)

	require.ErrorIs(t, a.SetPolicy(ctx, Policy{Name: p.Name, Slots: 9, Version: 2}), ErrStalePolicy)
	require.ErrorIs(t, b.SetPolicy(ctx, Policy{Name: p.Name, Slots: 9, Version: 1}), ErrStalePolicy)
	require.NoError(t, a.SetPolicy(ctx, Policy{Name: p.Name, Slots: 2, Version: 2}), "the policy in force again")
	require.ErrorIs(t, a.SetPolicy(ctx, Policy{Name: "other", Slots: 2, Version: 3}), ErrInvalidOption)
	require.ErrorIs(t, a.SetPolicy(ctx, Policy{Name: p.Name, Slots: 0, Version: 3}), ErrInvalidOption)
}

// TestPolicyFromStore: a limiter started with an older version, or the
// same version with other slots, takes the store's record before its
// first store call; one started with a newer version publishes it.
func TestPolicyFromStore(t *testing.T) {
	store := remote.NewMemory(clock.Real())
	ctx := context.Background()
	first := newPolicyLimiter(t, store, Policy{Name: "from-store", Slots: 3, Version: 4})
	require.True(t, first.TryAcquire("k", 1))
	for _, tc := range []struct {
		name string
		p    Policy
		want Policy
	}{
		{"older", Policy{Name: "from-store", Slots: 10, Version: 2}, Policy{Name: "from-store", Slots: 3, Version: 4}},
		{"same version, other slots", Policy{Name: "from-store", Slots: 10, Version: 4}, Policy{Name: "from-store", Slots: 3, Version: 4}},
		{"newer", Policy{Name: "from-store", Slots: 5, Version: 6, Tiers: map[string]int64{"paid": 9}},
			Policy{Name: "from-store", Slots: 5, Version: 6, Tiers: map[string]int64{"paid": 9}}},
	} {
		l := newPolicyLimiter(t, store, tc.p)
		l.TryAcquire("other", 1)
		require.True(t, l.Policy().Equal(tc.want), "%s: %+v, want %+v", tc.name, l.Policy(), tc.want)
		require.NoError(t, l.Close(ctx))
	}
	require.NoError(t, first.refresh(ctx))
	require.Equal(t, uint64(6), first.Policy().Version, "the newer version was not published")
}

// TestTiers: keys under a tier get its slots, keys under none or an
// unknown tier the policy's; a key moved to another tier moves once none
// of its requests is in flight, and its old tier's slots go back.
func TestTiers(t *testing.T) {
	store := remote.NewMemory(clock.Real())
	var mu sync.Mutex
	tierOf := map[string]string{"f": "free", "p": "paid", "u": "unknown"}
	l := newPolicyLimiter(t, store, Policy{Name: "tiers", Slots: 2, Tiers: map[string]int64{"free": 1, "paid": 3}},
		WithFleetSize(1), WithTier(func(key string) string {
			mu.Lock()
			defer mu.Unlock()
			return tierOf[key]
		}))
	for key, want := range map[string]int{"f": 1, "p": 3, "u": 2, "none": 2} {
		got := 0
		for l.TryAcquire(key, 1) {
			got++
		}
		require.Equal(t, want, got, "key %q", key)
	}
	require.ErrorIs(t, l.Acquire(context.Background(), "f", 2), ErrInvalidN, "2 at once under a tier of 1")
	mu.Lock()
	tierOf["f"] = "paid"
	mu.Unlock()
	require.False(t, l.TryAcquire("f", 1), "moved while its request is in flight")
	l.Release("f", 1)
	for range 3 {
		require.True(t, l.TryAcquire("f", 1), "under paid after its request ended")
	}
	require.False(t, l.TryAcquire("f", 1))
}

// TestPolicyLoweredUnderLoad: 3 limiters with their own clients on one
// real Redis, 6 workers each, on keys of two tiers; every request's time
// in flight is recorded. Midway one limiter lowers the paid tier from 12
// to 4. Never more than 12 in flight at once; from a poll after the
// change plus the longest request on, never more than 4 paid requests,
// and the free tier (3) never over its limit; both tiers stay busy.
func TestPolicyLoweredUnderLoad(t *testing.T) {
	if testing.Short() {
		t.Skip("3 s of load")
	}
	srv := redistest.Standalone(t)
	name := "lowered-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	p := Policy{Name: name, Slots: 1, Tiers: map[string]int64{"free": 3, "paid": 12}}
	tierOf := func(key string) string { tier, _, _ := strings.Cut(key, ":"); return tier }
	lims := make([]*Limiter, 3)
	for i := range lims {
		lims[i] = newPolicyLimiter(t, remote.NewRedis(srv.Client(t)), p, WithFleetSize(3), WithTier(tierOf),
			WithPolicyPoll(200*time.Millisecond))
	}
	var mu sync.Mutex
	flights := map[string][]flight{}
	var wg sync.WaitGroup
	start := time.Now()
	var changed time.Time
	const hold = 5 * time.Millisecond
	for i, l := range lims {
		for w := range 6 {
			key := []string{"free:t", "paid:t"}[w%2]
			wg.Add(1)
			go func() {
				defer wg.Done()
				for time.Since(start) < 3*time.Second {
					ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
					err := l.Acquire(ctx, key, 1)
					cancel()
					if errors.Is(err, context.DeadlineExceeded) {
						continue
					}
					if err != nil {
						t.Error(err)
						return
					}
					from := time.Now().UnixNano()
					time.Sleep(hold + time.Duration(rand.IntN(int(hold)))) // the request's work
					to := time.Now().UnixNano()
					l.Release(key, 1)
					mu.Lock()
					flights[key] = append(flights[key], flight{from, to})
					mu.Unlock()
				}
			}()
		}
		if i == 0 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				time.Sleep(1500 * time.Millisecond) // midway through the load
				mu.Lock()
				changed = time.Now()
				mu.Unlock()
				if err := l.SetPolicy(context.Background(), Policy{Name: name, Slots: 1, Version: 2,
					Tiers: map[string]int64{"free": 3, "paid": 4}}); err != nil {
					t.Error(err)
				}
			}()
		}
	}
	wg.Wait()
	settled := changed.Add(200*time.Millisecond + 2*hold).UnixNano()
	var before, after []flight
	for _, f := range flights["paid:t"] {
		if f.From < changed.UnixNano() {
			before = append(before, f)
		}
		if f.From >= settled {
			after = append(after, f)
		}
	}
	t.Logf("free: %d requests, most at once %d; paid: most at once %d before the change (%d requests), %d after it settled (%d requests)",
		len(flights["free:t"]), mostAtOnce(flights["free:t"]), mostAtOnce(before), len(before), mostAtOnce(after), len(after))
	if got := mostAtOnce(flights["free:t"]); got > 3 || got < 2 {
		t.Errorf("free tier: %d at once, want 2..3", got)
	}
	if got := mostAtOnce(flights["paid:t"]); got > 12 {
		t.Errorf("paid tier: %d at once over the old limit of 12", got)
	}
	if got := mostAtOnce(before); got < 9 {
		t.Errorf("paid tier before the change: at most %d at once, want the limit of 12 used", got)
	}
	if got := mostAtOnce(after); got > 4 || got < 3 {
		t.Errorf("paid tier after the change settled: %d at once, want 3..4", got)
	}
	for _, l := range lims {
		require.Equal(t, int64(4), l.Policy().Tiers["paid"])
	}
}
