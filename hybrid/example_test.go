package hybrid_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/hybrid"
	"github.com/leasehold/leasehold/remote"
	"github.com/redis/go-redis/v9"
)

// world is an in-memory Redis (miniredis) whose TIME follows a manual
// clock, so the examples are deterministic. In production, pass a real
// go-redis client and leave the clock alone.
type world struct {
	mr  *miniredis.Miniredis
	clk *clock.Manual
	rdb *redis.Client
}

func newWorld() *world {
	start := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	mr := miniredis.NewMiniRedis()
	if err := mr.Start(); err != nil {
		panic(err)
	}
	mr.SetTime(start)
	return &world{mr: mr, clk: clock.NewManual(start), rdb: redis.NewClient(&redis.Options{Addr: mr.Addr(), ContextTimeoutEnabled: true})}
}

func (w *world) advance(d time.Duration) {
	w.mr.SetTime(w.clk.Now().Add(d)) // Redis TIME first: it decides buckets
	w.clk.Advance(d)
}

func (w *world) close() { _ = w.rdb.Close(); w.mr.Close() }

func ExampleNew() {
	w := newWorld()
	defer w.close()
	ctx := context.Background()

	// Two requests at once, then one per second, for each customer, across
	// every process that shares this Redis.
	lim, err := hybrid.New(remote.NewRedis(w.rdb),
		hybrid.Policy{Name: "api", Limit: hybrid.Limit{Rate: 1, Period: time.Second, Burst: 2}},
		hybrid.WithClock(w.clk), hybrid.WithMaxReservation(0))
	if err != nil {
		panic(err)
	}
	defer lim.Close(ctx)

	for i := 0; i < 3; i++ {
		fmt.Println(lim.Allow(ctx, "customer-42"))
	}
	w.advance(time.Second)
	fmt.Println(lim.Allow(ctx, "customer-42"))
	// Output:
	// true
	// true
	// false
	// true
}

func ExampleLimiter_AllowN() {
	w := newWorld()
	defer w.close()
	ctx := context.Background()

	lim, err := hybrid.New(remote.NewRedis(w.rdb),
		hybrid.Policy{Name: "uploads", Limit: hybrid.Limit{Rate: 10, Period: time.Second, Burst: 10}},
		hybrid.WithClock(w.clk), hybrid.WithMaxReservation(0))
	if err != nil {
		panic(err)
	}
	defer lim.Close(ctx)

	// A request that costs 8 units, then one that costs 4: the second
	// must wait for 2 more tokens.
	for _, cost := range []int64{8, 4} {
		d, err := lim.AllowN(ctx, "tenant-a", cost)
		if err != nil {
			panic(err)
		}
		fmt.Printf("cost %d: allowed=%v retry-after=%v source=%v\n", cost, d.Allowed, d.RetryAfter, d.Source)
	}
	// Asking for more than Burst can never succeed, so it is an error.
	_, err = lim.AllowN(ctx, "tenant-a", 11)
	fmt.Println(err)
	// Output:
	// cost 8: allowed=true retry-after=0s source=remote
	// cost 4: allowed=false retry-after=200ms source=remote
	// hybrid: allow 11 on "tenant-a", burst 10: local: n exceeds burst
}

func ExampleLimiter_SetPolicy() {
	ctx := context.Background()
	clk := clock.NewManual(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	store := remote.NewMemory(clk) // in production: remote.NewRedis(client)
	v1 := hybrid.Policy{Name: "tenant-api", Limit: hybrid.PerSecond(100), Version: 1}
	a, _ := hybrid.New(store, v1, hybrid.WithClock(clk))
	b, _ := hybrid.New(store, v1, hybrid.WithClock(clk))
	defer a.Close(ctx)
	defer b.Close(ctx)

	// An incident: halve the limit for the whole fleet from one process.
	v2 := v1
	v2.Limit, v2.Version = hybrid.PerSecond(50), 2
	if err := a.SetPolicy(ctx, v2); err != nil {
		panic(err)
	}
	fmt.Println("b follows:", b.Policy().Version, b.Policy().Limit)

	// A late rollout of the old version is refused and told what is in force.
	err := b.SetPolicy(ctx, v1)
	var stale *hybrid.StalePolicyError
	fmt.Println(errors.Is(err, hybrid.ErrStalePolicy), errors.As(err, &stale) && stale.Current.Version == 2)
	// Output:
	// b follows: 2 50/1s burst 50
	// true true
}
