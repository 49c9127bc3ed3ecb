package inflight_test

import (
	"context"
	"fmt"

	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/inflight"
	"github.com/leasehold/leasehold/remote"
)

// A per-tenant cap on requests in flight across the fleet: at most 2 of
// tenant-a's requests run at once, whichever process serves them. In
// production pass remote.NewRedis(client), shared by every process.
func Example() {
	ctx := context.Background()
	lim, err := inflight.New(remote.NewMemory(clock.Real()), "tenant-in-flight", 2)
	if err != nil {
		panic(err)
	}
	defer lim.Close(ctx)

	fmt.Println(lim.TryAcquire("tenant-a", 1)) // a first request starts
	fmt.Println(lim.TryAcquire("tenant-a", 1)) // a second
	fmt.Println(lim.TryAcquire("tenant-a", 1)) // a third must wait
	fmt.Println(lim.TryAcquire("tenant-b", 1)) // another tenant, its own cap
	lim.Release("tenant-a", 1)                 // the first one ends
	if err := lim.Acquire(ctx, "tenant-a", 1); err != nil {
		panic(err)
	}
	fmt.Println("the third runs")
	// Output:
	// true
	// true
	// false
	// true
	// the third runs
}

// Plans with their own caps, changed for the whole fleet while it runs:
// free tenants may have 1 request in flight, paid ones 3, and the paid
// cap is then raised to 4 by a new policy version.
func ExampleLimiter_SetPolicy() {
	ctx := context.Background()
	plan := map[string]string{"acme": "paid", "bob": "free"}
	lim, err := inflight.NewWithPolicy(remote.NewMemory(clock.Real()),
		inflight.Policy{Name: "plans-in-flight", Slots: 1, Tiers: map[string]int64{"free": 1, "paid": 3}},
		inflight.WithTier(func(tenant string) string { return plan[tenant] }))
	if err != nil {
		panic(err)
	}
	defer lim.Close(ctx)

	running := func(tenant string) (n int) {
		for lim.TryAcquire(tenant, 1) {
			n++
		}
		lim.Release(tenant, int64(n))
		return n
	}
	fmt.Println("bob:", running("bob"), "acme:", running("acme"))
	p := lim.Policy()
	p.Tiers["paid"], p.Version = 4, p.Version+1
	if err := lim.SetPolicy(ctx, p); err != nil {
		panic(err)
	}
	fmt.Println("acme after the change:", running("acme"))
	// Output:
	// bob: 1 acme: 3
	// acme after the change: 4
}
