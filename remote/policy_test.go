package remote

import (
	"context"
	"errors"
	"github.com/leasehold/leasehold/internal/keys"
	"reflect"
	"testing"
	"time"

	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/local"
	"github.com/stretchr/testify/require"
)

func TestPolicyRecordsEverywhere(t *testing.T) {
	ctx := context.Background()
	v1 := PolicyRecord{Version: 1, Limit: local.PerSecond(100)}
	v2 := PolicyRecord{Version: 2, Limit: local.Limit{Rate: 50, Period: time.Minute, Burst: 5}}
	for _, be := range backends(t) {
		t.Run(be.name, func(t *testing.T) {
			ps := be.store.(Policies)
			name := "pol-" + be.name + time.Now().Format("150405.000000")
			if _, ok, err := ps.GetPolicy(ctx, "", name); err != nil || ok {
				t.Fatalf("GetPolicy on nothing = %v, %v", ok, err)
			}
			watch := make(chan struct{}, 1)
			stop, err := ps.WatchPolicy(ctx, "", name, func() {
				select {
				case watch <- struct{}{}:
				default:
				}
			})
			require.NoError(t, err)
			defer stop()
			time.Sleep(50 * time.Millisecond) // let a real SUBSCRIBE land before publishing
			cur, applied, err := ps.SetPolicy(ctx, "", name, v2)
			require.NoError(t, err)
			if !applied || !reflect.DeepEqual(cur, v2) {
				t.Fatalf("SetPolicy(v2) = %+v, %v", cur, applied)
			}
			select {
			case <-watch:
			case <-time.After(5 * time.Second):
				t.Fatal("no change notification")
			}
			cur, applied, err = ps.SetPolicy(ctx, "", name, v1)
			require.NoError(t, err)
			if applied || !reflect.DeepEqual(cur, v2) {
				t.Fatalf("SetPolicy(v1) over v2 = %+v, %v; want v2, not applied", cur, applied)
			}
			got, ok, err := ps.GetPolicy(ctx, "", name)
			if err != nil || !ok || !reflect.DeepEqual(got, v2) {
				t.Fatalf("GetPolicy = %+v, %v, %v", got, ok, err)
			}
			if be.client != nil {
				if ttl := be.ttl(keys.Policy("", name)); ttl < policyTTL-time.Minute || ttl > policyTTL {
					t.Fatalf("policy record TTL %v, want about %v", ttl, policyTTL)
				}
			}
			if _, _, err := ps.SetPolicy(ctx, "", name, PolicyRecord{Limit: v1.Limit}); !errors.Is(err, ErrInvalidPolicy) {
				t.Fatalf("SetPolicy(version 0) = %v, want ErrInvalidPolicy", err)
			}
			if _, _, err := ps.SetPolicy(ctx, "", "", v1); !errors.Is(err, ErrInvalidPolicy) {
				t.Fatalf("SetPolicy(empty name) = %v, want ErrInvalidPolicy", err)
			}
			if be.client != nil {
				require.NoError(t, be.client.Set(ctx, keys.Policy("", name), "garbage", 0).Err())
				if _, _, err := ps.GetPolicy(ctx, "", name); !errors.Is(err, ErrCorruptState) {
					t.Fatalf("GetPolicy on garbage = %v, want ErrCorruptState", err)
				}
				if _, _, err := ps.SetPolicy(ctx, "", name, v2); !errors.Is(err, ErrCorruptState) {
					t.Fatalf("SetPolicy over garbage = %v, want ErrCorruptState", err)
				}
			}
		})
	}
}

// fleetExpiry is the heartbeat expiry of the fleet tests.
const fleetExpiry = 200 * time.Millisecond

// everyFleet runs fn on every backend's Fleet under a fresh policy name,
// with beat, a heartbeat of member m at fleetExpiry returning the count.
func everyFleet(t *testing.T, prefix string, fn func(t *testing.T, be backend, f Fleet, name string, beat func(m string) int)) {
	for _, be := range backends(t) {
		t.Run(be.name, func(t *testing.T) {
			f := be.store.(Fleet)
			name := prefix + be.name + time.Now().Format("150405.000000")
			fn(t, be, f, name, func(m string) int {
				t.Helper()
				n, err := f.Heartbeat(context.Background(), "", name, m, fleetExpiry)
				require.NoError(t, err)
				return n
			})
		})
	}
}

func TestFleetHeartbeatsEverywhere(t *testing.T) {
	everyFleet(t, "fleet-", func(t *testing.T, be backend, f Fleet, name string, beat func(string) int) {
		for i, m := range []string{"a", "b", "c"} {
			if n := beat(m); n != i+1 {
				t.Fatalf("Heartbeat(%s) = %d, want %d", m, n, i+1)
			}
		}
		require.NoError(t, f.Leave(context.Background(), "", name, "c"))
		if n := beat("a"); n != 2 {
			t.Fatalf("after Leave(c): %d members, want 2", n)
		}
		for range 5 { // b falls silent while a beats every quarter expiry
			be.advance(fleetExpiry / 4)
			beat("a")
		}
		if n := beat("a"); n != 1 {
			t.Fatalf("after b's expiry: %d members, want 1", n)
		}
		if _, err := f.Heartbeat(context.Background(), "", name, "", fleetExpiry); !errors.Is(err, ErrInvalidKey) {
			t.Fatalf("Heartbeat(empty member) = %v, want ErrInvalidKey", err)
		}
	})
}

// TestFleetCountSurvivesAStall: when no member was heard from for longer
// than the expiry (the store paused or cut off from the whole fleet), the
// heartbeats that land after it still count every member, in whatever
// order they land; a member that stays silent afterwards still expires,
// as does one silent before the stall. Every backend.
func TestFleetCountSurvivesAStall(t *testing.T) {
	everyFleet(t, "stall-", func(t *testing.T, be backend, _ Fleet, _ string, beat func(string) int) {
		for _, m := range []string{"gone", "a", "b", "c"} {
			beat(m)
		}
		be.advance(fleetExpiry / 4) // "gone" stops beating
		for _, m := range []string{"a", "b", "c"} {
			beat(m)
		}
		be.advance(3 * fleetExpiry / 2) // nobody is heard from: a stall
		for i, m := range []string{"c", "a", "b"} {
			if n := beat(m); n != 4 {
				t.Fatalf("heartbeat %d after the stall (%s) counted %d, want 4 (a, b, c and gone, not yet expired)", i+1, m, n)
			}
		}
		for range 4 { // b falls silent; a and c beat every quarter expiry
			be.advance(fleetExpiry / 4)
			beat("a")
			beat("c")
		}
		if n := beat("a"); n != 2 {
			t.Fatalf("after b's and gone's expiry: %d members, want 2", n)
		}
	})
}

// TestShapedPolicyRecord stores a policy with windows, a second limit and
// tiers, on every backend, and reads the same shape back; a newer plain
// record then replaces it.
func TestShapedPolicyRecord(t *testing.T) {
	ctx := context.Background()
	shaped := PolicyRecord{Version: 3, Limit: local.PerSecond(10), Window: true,
		Also: []local.Limit{local.PerHour(1000)},
		Tiers: map[string]TierRecord{
			"free": {Limit: local.PerSecond(1)},
			"paid": {Limit: local.PerSecond(100), Also: []local.Limit{local.PerMinute(3000)}},
		}}
	plain := PolicyRecord{Version: 4, Limit: local.PerSecond(7)}
	for _, be := range backends(t) {
		t.Run(be.name, func(t *testing.T) {
			ps := be.store.(Policies)
			name := "shaped-" + be.name + time.Now().Format("150405.000000")
			cur, applied, err := ps.SetPolicy(ctx, "", name, shaped)
			require.NoError(t, err)
			require.True(t, applied)
			require.Equal(t, shaped, cur)
			got, ok, err := ps.GetPolicy(ctx, "", name)
			require.NoError(t, err)
			require.True(t, ok)
			require.Equal(t, shaped, got)
			_, applied, err = ps.SetPolicy(ctx, "", name, plain)
			require.NoError(t, err)
			require.True(t, applied)
			got, _, err = ps.GetPolicy(ctx, "", name)
			require.NoError(t, err)
			require.Equal(t, plain, got)
		})
	}
	bad := []PolicyRecord{
		{Version: 1, Limit: local.Limit{Rate: 10, Period: time.Second, Burst: 20}, Window: true},
		{Version: 1, Limit: local.PerSecond(1), Tiers: map[string]TierRecord{"a b": {Limit: local.PerSecond(1)}}},
		{Version: 1, Limit: local.PerSecond(1), Also: []local.Limit{{Rate: 1}}},
	}
	for i, rec := range bad {
		_, _, err := NewMemory(nil).SetPolicy(ctx, "", "p", rec)
		if !errors.Is(err, ErrInvalidPolicy) && !errors.Is(err, local.ErrInvalidLimit) {
			t.Errorf("bad record %d: error %v, want ErrInvalidPolicy or ErrInvalidLimit", i, err)
		}
	}
}

// TestMemoryWatchersToldInOrder: the memory store tells a policy's
// watchers in the order they subscribed, each once, and a stopped one no
// more. Told in map order, the simulator's fleet armed its policy polls
// in a different order each run, and a policy change (limit-halved) was
// not deterministic.
func TestMemoryWatchersToldInOrder(t *testing.T) {
	ctx := context.Background()
	m := NewMemory(clock.NewManual(time.Unix(0, 0)))
	var told []int
	stops := make([]func(), 8)
	for i := range stops {
		stop, err := m.WatchPolicy(ctx, "", "p", func() { told = append(told, i) })
		require.NoError(t, err)
		stops[i] = stop
	}
	stops[3]()
	stops[3]() // twice is harmless
	for v := uint64(1); v <= 20; v++ {
		told = told[:0]
		_, applied, err := m.SetPolicy(ctx, "", "p", PolicyRecord{Version: v, Limit: local.PerSecond(int64(v))})
		require.NoError(t, err)
		require.True(t, applied)
		require.Equal(t, []int{0, 1, 2, 4, 5, 6, 7}, told, "version %d", v)
	}
}
