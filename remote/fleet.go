package remote

import (
	"context"
	"fmt"
	"github.com/leasehold/leasehold/internal/errs"
	"github.com/leasehold/leasehold/internal/keys"
	"sync"
	"time"
)

// Fleet is implemented by stores that can count the live limiters of a
// policy from their heartbeats: each limiter calls Heartbeat every interval
// and is counted until expiry passes without one. Both stores implement it.
type Fleet interface {
	// Heartbeat records member as alive and returns how many members of
	// the policy are.
	Heartbeat(ctx context.Context, prefix, policy, member string, expiry time.Duration) (int, error)
	// Leave removes member at once.
	Leave(ctx context.Context, prefix, policy, member string) error
}

var (
	_ Fleet = (*RedisStore)(nil)
	_ Fleet = (*MemoryStore)(nil)
)

// Heartbeat implements Fleet.
func (s *RedisStore) Heartbeat(ctx context.Context, prefix, policy, member string, expiry time.Duration) (int, error) {
	if err := validateFleet(prefix, policy, member, expiry); err != nil {
		return 0, err
	}
	key := keys.Fleet(prefix, policy)
	n, err := heartbeatScript.Run(ctx, s.c, []string{key}, member, expiry.Milliseconds()).Int()
	if err != nil {
		return 0, s.failed(key, err)
	}
	return n, nil
}

// Leave implements Fleet.
func (s *RedisStore) Leave(ctx context.Context, prefix, policy, member string) error {
	if err := validateFleet(prefix, policy, member, time.Millisecond); err != nil {
		return err
	}
	key := keys.Fleet(prefix, policy)
	if err := s.c.ZRem(ctx, key, member).Err(); err != nil {
		return classify(key, err)
	}
	return nil
}

func validateFleet(prefix, policy, member string, expiry time.Duration) error {
	if err := keys.ValidateNames(prefix, policy); err != nil {
		return err
	}
	if member == "" || len(member) > MaxKeyLen {
		return fmt.Errorf("%w: fleet member %.40q", ErrInvalidKey, member)
	}
	if expiry < time.Millisecond {
		return errs.Errorf("remote", "fleet expiry %v below 1ms", expiry)
	}
	return nil
}

type memFleet struct {
	mu      sync.Mutex
	members map[string]map[string]int64 // fleet key -> member -> deadline µs
}

// Heartbeat implements Fleet.
func (s *MemoryStore) Heartbeat(ctx context.Context, prefix, policy, member string, expiry time.Duration) (int, error) {
	if err := validateFleet(prefix, policy, member, expiry); err != nil {
		return 0, err
	}
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	now := s.clk.Now().UnixMicro()
	key := keys.Fleet(prefix, policy)
	f := &s.fleet
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.members == nil {
		f.members = map[string]map[string]int64{}
	}
	m := f.members[key]
	if m == nil {
		m = map[string]int64{}
		f.members[key] = m
	}
	m[member] = now + expiry.Microseconds()
	for k, deadline := range m {
		if deadline <= now {
			delete(m, k)
		}
	}
	return len(m), nil
}

// Leave implements Fleet.
func (s *MemoryStore) Leave(ctx context.Context, prefix, policy, member string) error {
	if err := validateFleet(prefix, policy, member, time.Millisecond); err != nil {
		return err
	}
	s.fleet.mu.Lock()
	defer s.fleet.mu.Unlock()
	delete(s.fleet.members[keys.Fleet(prefix, policy)], member)
	return nil
}
