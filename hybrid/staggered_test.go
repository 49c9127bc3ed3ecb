package hybrid

import (
	"context"
	"testing"
	"time"

	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"github.com/leasehold/leasehold/internal/testkit/storetest"
	"github.com/leasehold/leasehold/remote"
	"github.com/stretchr/testify/require"
)

// TestStaggeredRecovery: 4 limiters at twice the limit lose the store
// together; one gets it back 3 s later, the others 2 s after that. The
// early one draws the bucket while the others still spend their degraded
// shares; their debt is charged when they return. Over the whole run the
// fleet stays within +2% of the exact bound.
func TestStaggeredRecovery(t *testing.T) {
	if testing.Short() {
		t.Skip("12 s")
	}
	t.Parallel()
	srv := redistest.NewServer(t)
	lim := Limit{Rate: 1000, Period: time.Second, Burst: 100}
	stores := make([]*cuttable, 4)
	lims := make([]*Limiter, 4)
	for i := range lims {
		stores[i] = newCuttable(remote.NewRedis(srv.Client(t)))
		l, err := New(stores[i], Policy{Name: "staggered", Limit: lim}, quiet,
			WithHeartbeat(100*time.Millisecond, 300*time.Millisecond))
		require.NoError(t, err)
		lims[i] = l
		t.Cleanup(func() { _ = l.Close(context.Background()) })
	}
	eventually(t, "heartbeats to count 4", func() bool { return lims[3].FleetSize() == 4 })
	ctx, cancel := context.WithCancel(context.Background())
	tl := offer(ctx, lims, 500, "staggered")
	time.Sleep(2 * time.Second)
	for _, s := range stores {
		s.Down.Store(true)
	}
	time.Sleep(3 * time.Second)
	stores[0].Down.Store(false)
	time.Sleep(2 * time.Second)
	for _, s := range stores[1:] {
		s.Down.Store(false)
	}
	time.Sleep(5 * time.Second)
	cancel()
	total := time.Since(tl.start)
	all := tl.sumBetween(0, total+100*time.Millisecond)
	bound := lim.Burst + lim.TokensIn(total)
	var per []int64
	for i := 0; i < int(total/time.Second); i++ {
		per = append(per, tl.sumBetween(time.Duration(i)*time.Second, time.Duration(i+1)*time.Second))
	}
	t.Logf("staggered recovery: whole run %d admitted, exact bound %d (%+.1f%%); per second %v", all, bound, 100*float64(all-bound)/float64(bound), per)
	if all > bound+bound*2/100 {
		t.Fatalf("whole run admitted %d, more than 2%% over the exact bound %d", all, bound)
	}
}

// cuttable is a RedisStore (fleet and policies included) that one process
// can lose while the others keep it: a network partition.
type cuttable struct {
	storetest.Cut
	redis *remote.RedisStore
}

func newCuttable(s *remote.RedisStore) *cuttable {
	return &cuttable{Cut: storetest.Cut{Store: s}, redis: s}
}

func (c *cuttable) Heartbeat(ctx context.Context, prefix, policy, member string, expiry time.Duration) (int, error) {
	if c.Down.Load() {
		return 0, storetest.ErrCut
	}
	return c.redis.Heartbeat(ctx, prefix, policy, member, expiry)
}

func (c *cuttable) Leave(ctx context.Context, prefix, policy, member string) error {
	return c.redis.Leave(ctx, prefix, policy, member)
}

func (c *cuttable) GetPolicy(ctx context.Context, prefix, name string) (remote.PolicyRecord, bool, error) {
	if c.Down.Load() {
		return remote.PolicyRecord{}, false, storetest.ErrCut
	}
	return c.redis.GetPolicy(ctx, prefix, name)
}

func (c *cuttable) SetPolicy(ctx context.Context, prefix, name string, rec remote.PolicyRecord) (remote.PolicyRecord, bool, error) {
	return c.redis.SetPolicy(ctx, prefix, name, rec)
}

func (c *cuttable) WatchPolicy(ctx context.Context, prefix, name string, changed func()) (func(), error) {
	return c.redis.WatchPolicy(ctx, prefix, name, changed)
}
