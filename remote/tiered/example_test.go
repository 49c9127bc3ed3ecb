package tiered_test

import (
	"context"
	"fmt"
	"time"

	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/hybrid"
	"github.com/leasehold/leasehold/remote"
	"github.com/leasehold/leasehold/remote/tiered"
)

// Two regions, each with its own store, share one global limit kept in the
// world's store: a region answers its processes from its pool and refills
// the pool from the world in the background, so every admission in every
// region was granted by the world's one bucket of 10 per second.
func ExampleNew() {
	clk := clock.NewManual(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	world := remote.NewMemory(clk) // in production: remote.NewRedis on the world's Redis
	// Refills run inline here, so that the example replays exactly; by
	// default each runs on its own goroutine, off every decision's path.
	inline := tiered.WithSpawn(func(run func()) { run() })
	ctx := context.Background()
	policy := hybrid.Policy{Name: "api", Limit: hybrid.PerSecond(10)}
	admitted := map[string]int{}
	var lims []*hybrid.Limiter
	for _, region := range []string{"eu", "us"} {
		// In production: remote.NewRedis on the region's own Redis.
		store, err := tiered.New(region, remote.NewMemory(clk), world, tiered.WithClock(clk), inline)
		if err != nil {
			panic(err)
		}
		defer store.Close()
		lim, err := hybrid.New(store, policy, hybrid.WithClock(clk), hybrid.WithFleetSize(2))
		if err != nil {
			panic(err)
		}
		defer lim.Close(ctx)
		lims = append(lims, lim)
	}
	for step := 0; step < 10; step++ { // 2 s, 40 requests a second in each region
		for i := 0; i < 8; i++ {
			for r, region := range []string{"eu", "us"} {
				if lims[r].Allow(ctx, "customer-42") {
					admitted[region]++
				}
			}
		}
		clk.Advance(200 * time.Millisecond)
	}
	// The rest of the bound is in the regions' pools, unspent.
	fmt.Println("eu + us admitted:", admitted["eu"]+admitted["us"], "of at most", 10+10*2)
	// Output:
	// eu + us admitted: 26 of at most 30
}
