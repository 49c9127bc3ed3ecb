package hybrid_test

import (
	"context"
	"errors"
	"fmt"
	"runtime"
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
	// hybrid: allow 11 on "tenant-a", burst 10: n exceeds burst
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

// ExampleLimiter_ReserveN books tokens ahead: a batch job reserves what it
// needs and sleeps exactly until the bucket has produced it, or gives the
// tokens back if it changes its mind.
func ExampleLimiter_ReserveN() {
	w := newWorld()
	defer w.close()
	ctx := context.Background()
	lim, err := hybrid.New(remote.NewRedis(w.rdb), hybrid.Policy{Name: "export", Limit: hybrid.PerSecond(10)},
		hybrid.WithClock(w.clk))
	if err != nil {
		panic(err)
	}
	defer lim.Close(ctx)

	for _, n := range []int64{10, 5} {
		r, err := lim.ReserveN(ctx, "tenant-7", n)
		if err != nil {
			panic(err)
		}
		fmt.Printf("reserve %d: ok=%v act in %v\n", n, r.OK(), r.Delay())
		if r.Delay() > 0 {
			r.Cancel() // not worth the wait: the 5 tokens go back
		}
	}
	r, _ := lim.ReserveN(ctx, "tenant-7", 5)
	fmt.Printf("reserve 5 again: ok=%v act in %v\n", r.OK(), r.Delay())
	// Output:
	// reserve 10: ok=true act in 0s
	// reserve 5: ok=true act in 500ms
	// reserve 5 again: ok=true act in 500ms
}

// ExampleLimiter_Wait blocks until the request may proceed, on the
// limiter's clock (here a manual one, moved by another goroutine).
func ExampleLimiter_Wait() {
	w := newWorld()
	defer w.close()
	ctx := context.Background()
	lim, err := hybrid.New(remote.NewRedis(w.rdb), hybrid.Policy{Name: "jobs", Limit: hybrid.Limit{Rate: 1, Period: time.Second, Burst: 1}},
		hybrid.WithClock(w.clk), hybrid.WithMaxReservation(0))
	if err != nil {
		panic(err)
	}
	defer lim.Close(ctx)
	fmt.Println(lim.Wait(ctx, "worker")) // the burst token: at once
	done := make(chan error)
	go func() { done <- lim.Wait(ctx, "worker") }()
	for {
		select {
		case err := <-done:
			fmt.Println(err)
			return
		default:
			w.advance(100 * time.Millisecond) // time passes until the next token
			runtime.Gosched()                 // let the waiter look again
		}
	}
	// Output:
	// <nil>
	// <nil>
}

// ExampleNew_cluster runs the limiter on Redis Cluster: keys carry hash
// tags, so every operation on a key stays in one slot. Build the client
// with ContextTimeoutEnabled so deadlines reach in-flight calls.
func ExampleNew_cluster() {
	rdb := redis.NewClusterClient(&redis.ClusterOptions{
		Addrs:                 []string{"redis-0:6379", "redis-1:6379", "redis-2:6379"},
		ContextTimeoutEnabled: true,
	})
	defer rdb.Close()
	lim, err := hybrid.New(remote.NewRedis(rdb), hybrid.Policy{Name: "api", Limit: hybrid.PerSecond(1000)})
	if err != nil {
		panic(err)
	}
	defer lim.Close(context.Background())
	_ = lim.Allow(context.Background(), "customer-42")
}

// A contract of 3 requests per minute, audited per window: after 3, the
// fourth waits until the first has left the minute, not for a refill.
func ExampleSlidingWindow() {
	w := newWorld()
	defer w.close()
	ctx := context.Background()
	lim, err := hybrid.New(remote.NewRedis(w.rdb),
		hybrid.Policy{Name: "export", Limit: hybrid.PerMinute(3), Algorithm: hybrid.SlidingWindow},
		hybrid.WithClock(w.clk))
	if err != nil {
		panic(err)
	}
	defer lim.Close(ctx)

	for i := 0; i < 4; i++ {
		d, _ := lim.AllowN(ctx, "customer-42", 1)
		fmt.Println(d.Allowed, d.RetryAfter.Round(time.Second))
		w.advance(10 * time.Second)
	}
	// Output:
	// true 0s
	// true 0s
	// true 0s
	// false 31s
}

// Two limits on one key: 2 per second and 3 per minute. The refusal names
// the limit that refused.
func ExamplePolicy_also() {
	w := newWorld()
	defer w.close()
	ctx := context.Background()
	lim, err := hybrid.New(remote.NewRedis(w.rdb),
		hybrid.Policy{Name: "b2b", Limit: hybrid.PerSecond(2), Also: []hybrid.Limit{hybrid.PerMinute(3)}},
		hybrid.WithClock(w.clk))
	if err != nil {
		panic(err)
	}
	defer lim.Close(ctx)

	for i := 0; i < 4; i++ {
		d, _ := lim.AllowN(ctx, "customer-42", 1)
		fmt.Println(d.Allowed, d.Limit)
		w.advance(time.Second)
	}
	// Output:
	// true 2/1s burst 2
	// true 2/1s burst 2
	// true 2/1s burst 2
	// false 3/1m0s burst 3
}

// Plans: a key's tier comes from WithTier; each tier's limit is in the
// policy, versioned, so every process agrees on it.
func ExampleWithTier() {
	w := newWorld()
	defer w.close()
	ctx := context.Background()
	plans := map[string]string{"acme": "paid"}
	lim, err := hybrid.New(remote.NewRedis(w.rdb),
		hybrid.Policy{Name: "api", Limit: hybrid.PerSecond(1), Tiers: map[string]hybrid.Tier{
			"free": {Limit: hybrid.PerSecond(1)},
			"paid": {Limit: hybrid.PerSecond(3)},
		}},
		hybrid.WithClock(w.clk), hybrid.WithTier(func(key string) string { return plans[key] }))
	if err != nil {
		panic(err)
	}
	defer lim.Close(ctx)

	for _, key := range []string{"acme", "bob"} {
		n := 0
		for i := 0; i < 5; i++ {
			if lim.Allow(ctx, key) {
				n++
			}
		}
		fmt.Println(key, n)
	}
	// Output:
	// acme 3
	// bob 1
}

// An LLM gateway's budget of tokens per minute per tenant: the tokens a
// request uses are known only when its response ends, so the gateway
// charges an estimate up front and settles the real count afterwards. What
// the estimate did not use goes back; what it lacked is charged, as debt
// that the next refills pay before the tenant is admitted again.
func ExampleCharge_Settle() {
	w := newWorld()
	defer w.close()
	ctx := context.Background()
	lim, err := hybrid.New(remote.NewRedis(w.rdb),
		hybrid.Policy{Name: "llm-tokens", Limit: hybrid.Limit{Rate: 10_000, Period: time.Minute, Burst: 10_000}},
		hybrid.WithClock(w.clk))
	if err != nil {
		panic(err)
	}
	defer lim.Close(ctx)

	call := func(estimate, used int64) {
		ch, err := lim.ChargeN(ctx, "tenant-a", estimate)
		if err != nil {
			panic(err)
		}
		if !ch.Allowed {
			fmt.Printf("estimate %d: refused, retry after %v\n", estimate, ch.RetryAfter.Round(time.Second))
			return
		}
		// ... the model answers; its usage says how many tokens it took ...
		if err := ch.Settle(used); err != nil {
			panic(err)
		}
		fmt.Printf("estimate %d, used %d\n", estimate, used)
	}
	call(4000, 1500)           // 2 500 come back
	call(4000, 9000)           // 5 000 more are charged: the budget is 500 short
	call(1000, 0)              // refused until refills pay the debt
	w.advance(9 * time.Second) // 1 500 refilled: the debt paid, 1 000 left
	call(1000, 1000)
	// Output:
	// estimate 4000, used 1500
	// estimate 4000, used 9000
	// estimate 1000: refused, retry after 9s
	// estimate 1000, used 1000
}

// No window of time admits more than Burst + Rate·w: the tokens a
// process leases are stock, which the store counts as held until their
// term, so the bucket never refills behind them.
func Example_everyWindow() {
	w := newWorld()
	defer w.close()
	ctx := context.Background()

	lim, err := hybrid.New(remote.NewRedis(w.rdb),
		hybrid.Policy{Name: "partner-api", Limit: hybrid.Limit{Rate: 100, Period: time.Second, Burst: 100}},
		hybrid.WithClock(w.clk))
	if err != nil {
		panic(err)
	}
	defer lim.Close(ctx)

	burst := 0
	for range 60 {
		if lim.Allow(ctx, "acme") {
			burst++
		}
	}
	w.advance(700 * time.Millisecond) // idle: the bucket refills behind the lease
	next := 0
	for range 200 {
		if lim.Allow(ctx, "acme") {
			next++
		}
	}
	fmt.Printf("burst %d, 700 ms later %d (at most Burst)\n", burst, next)
	// Output:
	// burst 60, 700 ms later 97 (at most Burst)
}
