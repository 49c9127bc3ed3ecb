package remote

import (
	"context"
	"github.com/leasehold/leasehold/internal/errs"
	"github.com/leasehold/leasehold/internal/keys"
	"sync"
	"time"
)

// Weigh keeps region weights for tiers of stores (package remote/tiered),
// whose parent store both stores can be: each region reports its weight
// (its live limiters) every beat and learns the weight of the world, so
// that a region cut off from the parent knows its share.

func validateWeigh(prefix, policy, region string, weight int64, expiry time.Duration) error {
	if err := validateFleet(prefix, policy, region, expiry); err != nil {
		return err
	}
	if weight < 0 || weight > 1<<40 {
		return errs.Errorf("remote", "region weight %d out of range", weight)
	}
	return nil
}

// Weigh records region's weight until expiry and returns the sum of the
// weights of every region heard from within its expiry.
func (s *RedisStore) Weigh(ctx context.Context, prefix, policy, region string, weight int64, expiry time.Duration) (int64, error) {
	if err := validateWeigh(prefix, policy, region, weight, expiry); err != nil {
		return 0, err
	}
	key := keys.World(prefix, policy)
	n, err := weighScript.Run(ctx, s.c, []string{key}, region, weight, expiry.Milliseconds()).Int64()
	if err != nil {
		return 0, s.failed(key, err)
	}
	return n, nil
}

type memRegions struct {
	mu     sync.Mutex
	worlds map[string]map[string][2]int64 // world key -> region -> weight, deadline µs
}

// Weigh is RedisStore.Weigh in memory.
func (s *MemoryStore) Weigh(ctx context.Context, prefix, policy, region string, weight int64, expiry time.Duration) (int64, error) {
	if err := validateWeigh(prefix, policy, region, weight, expiry); err != nil {
		return 0, err
	}
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	now := s.clk.Now().UnixMicro()
	key := keys.World(prefix, policy)
	w := &s.regions
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.worlds == nil {
		w.worlds = map[string]map[string][2]int64{}
	}
	m := w.worlds[key]
	if m == nil {
		m = map[string][2]int64{}
		w.worlds[key] = m
	}
	m[region] = [2]int64{weight, now + expiry.Microseconds()}
	var sum int64
	for k, v := range m {
		if v[1] <= now {
			delete(m, k)
			continue
		}
		sum += v[0]
	}
	return sum, nil
}
