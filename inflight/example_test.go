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
