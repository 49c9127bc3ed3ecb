package remote

import (
	"context"
	"fmt"
	"github.com/leasehold/leasehold/internal/errs"
	"github.com/leasehold/leasehold/internal/keys"
	"math"
	"sync"
	"time"
)

// Fleet is implemented by stores that can count the live limiters of a
// policy from their heartbeats: each limiter calls Heartbeat every interval
// and is counted until expiry passes without one. Time in which the store
// heard from no member for over half the expiry (a paused or unreachable
// store) counts only for half the expiry, so the heartbeats that land
// after it still count each other; an interval of at most half the expiry
// (the default is a third) keeps a live member counted. Both stores
// implement it.
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
	silenceShift(m, now, expiry.Microseconds())
	m[member] = now + expiry.Microseconds()
	for k, deadline := range m {
		if deadline <= now {
			delete(m, k)
		}
	}
	return len(m), nil
}

// silenceShift moves every deadline of m forward by the time no member
// was heard from, less half the expiry, as heartbeatLua does. A store
// that answered no heartbeat for a while (Redis paused, or cut off from
// the whole fleet) must not count that time against members that could
// not reach it: the heartbeats queued behind the silence land one by one,
// and the first would find every peer expired and count itself alone
// (a fleet of 4 read 1 for up to a heartbeat interval after each 300 ms
// pause, TestFleetCountSurvivesAStall). Half the expiry is longer than any
// gap while some member beats every interval of at most that, and a
// member gone for good still ages at least half the expiry per
// heartbeat, so it expires. A silence of twice the expiry is the Redis
// key's TTL: the set is gone, as there.
func silenceShift(m map[string]int64, now, expiry int64) {
	if len(m) == 0 {
		return
	}
	last := int64(math.MinInt64)
	for _, deadline := range m {
		last = max(last, deadline-expiry)
	}
	shift := now - last - expiry/2
	switch {
	case now-last >= 2*expiry:
		clear(m)
	case shift > 0:
		for k := range m {
			m[k] += shift
		}
	}
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
