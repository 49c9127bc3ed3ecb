package remote

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/leasehold/leasehold/local"
	"github.com/redis/go-redis/v9"
)

// PolicyTTL is how long a policy record lives in Redis after it was last
// set.
const PolicyTTL = 30 * 24 * time.Hour

// PolicyRecord is a policy version as the store keeps it.
type PolicyRecord struct {
	Version uint64
	Limit   local.Limit
}

// Policies is implemented by stores that keep the current version of each
// policy, so that every limiter of a fleet converges on it. Both stores
// implement it.
type Policies interface {
	// SetPolicy stores rec if its version is above the stored one, atomically,
	// and tells watchers. It returns the record in force afterwards and
	// whether rec was stored.
	SetPolicy(ctx context.Context, prefix, name string, rec PolicyRecord) (PolicyRecord, bool, error)
	// GetPolicy returns the stored record; ok is false if there is none.
	GetPolicy(ctx context.Context, prefix, name string) (rec PolicyRecord, ok bool, err error)
	// WatchPolicy calls changed after every stored change (possibly
	// coalesced, never while holding a lock of the store) until stop is
	// called; stop waits for any goroutine the watch runs.
	WatchPolicy(ctx context.Context, prefix, name string, changed func()) (stop func(), err error)
}

var (
	_ Policies = (*RedisStore)(nil)
	_ Policies = (*MemoryStore)(nil)
)

func validatePolicyRecord(prefix, name string, rec PolicyRecord) error {
	if err := validateKey(prefix, name, "policy"); err != nil {
		return err
	}
	if rec.Version == 0 || rec.Version > MaxVersion {
		return fmt.Errorf("%w: version %d outside [1, %d]", ErrInvalidPolicy, rec.Version, MaxVersion)
	}
	return rec.Limit.Validate()
}

func decodePolicy(key, s string) (PolicyRecord, error) {
	f := strings.Fields(s)
	if len(f) != 4 {
		return PolicyRecord{}, fmt.Errorf("remote: policy %q: %w: record %q", key, ErrCorruptState, s)
	}
	var n [4]int64
	for i, x := range f {
		v, err := strconv.ParseInt(x, 10, 64)
		if err != nil || v <= 0 {
			return PolicyRecord{}, fmt.Errorf("remote: policy %q: %w: record %q", key, ErrCorruptState, s)
		}
		n[i] = v
	}
	if n[2] > int64(local.MaxTimeToFull/time.Microsecond) {
		return PolicyRecord{}, fmt.Errorf("remote: policy %q: %w: period in %q", key, ErrCorruptState, s)
	}
	rec := PolicyRecord{Version: uint64(n[0]), Limit: local.Limit{Rate: n[1], Period: time.Duration(n[2]) * time.Microsecond, Burst: n[3]}}
	if err := rec.Limit.Validate(); err != nil {
		return PolicyRecord{}, fmt.Errorf("remote: policy %q: %w: %w", key, ErrCorruptState, err)
	}
	return rec, nil
}

// SetPolicy implements Policies.
func (s *RedisStore) SetPolicy(ctx context.Context, prefix, name string, rec PolicyRecord) (PolicyRecord, bool, error) {
	if err := validatePolicyRecord(prefix, name, rec); err != nil {
		return PolicyRecord{}, false, err
	}
	key := PolicyKey(prefix, name)
	v, err := setPolicyScript.Run(ctx, s.c, []string{key}, rec.Version, rec.Limit.Rate, int64(rec.Limit.Period/time.Microsecond), rec.Limit.Burst, PolicyTTL.Milliseconds()).Slice()
	if err != nil {
		return PolicyRecord{}, false, classify(key, err)
	}
	return parsePolicyReply(key, v)
}

// parsePolicyReply reads setPolicyLua's reply with checked conversions.
func parsePolicyReply(key string, v []any) (PolicyRecord, bool, error) {
	if len(v) != 2 {
		return PolicyRecord{}, false, fmt.Errorf("remote: policy %q: %w: reply of %d fields", key, ErrCorruptState, len(v))
	}
	applied, ok := v[0].(int64)
	if !ok || (applied != 0 && applied != 1) {
		return PolicyRecord{}, false, fmt.Errorf("remote: policy %q: %w: applied flag %v", key, ErrCorruptState, v[0])
	}
	str, ok := v[1].(string)
	if !ok {
		return PolicyRecord{}, false, fmt.Errorf("remote: policy %q: %w: record %T", key, ErrCorruptState, v[1])
	}
	cur, err := decodePolicy(key, str)
	return cur, applied == 1, err
}

// GetPolicy implements Policies.
func (s *RedisStore) GetPolicy(ctx context.Context, prefix, name string) (PolicyRecord, bool, error) {
	if err := validateKey(prefix, name, "policy"); err != nil {
		return PolicyRecord{}, false, err
	}
	key := PolicyKey(prefix, name)
	str, err := s.c.Get(ctx, key).Result()
	if errors.Is(err, redis.Nil) {
		return PolicyRecord{}, false, nil
	}
	if err != nil {
		if redis.HasErrorPrefix(err, "WRONGTYPE") {
			return PolicyRecord{}, false, fmt.Errorf("remote: policy %q: %w: %w", key, ErrCorruptState, err)
		}
		return PolicyRecord{}, false, classify(key, err)
	}
	rec, err := decodePolicy(key, str)
	return rec, err == nil, err
}

// WatchPolicy implements Policies with Redis pub/sub on the policy key's
// name (Cluster broadcasts it to every node).
func (s *RedisStore) WatchPolicy(ctx context.Context, prefix, name string, changed func()) (func(), error) {
	if err := validateKey(prefix, name, "policy"); err != nil {
		return nil, err
	}
	ps := s.c.Subscribe(ctx, PolicyKey(prefix, name))
	done := make(chan struct{})
	go func() {
		defer close(done)
		for range ps.Channel() {
			changed()
		}
	}()
	var once sync.Once
	return func() {
		once.Do(func() {
			_ = ps.Close()
			<-done
		})
	}, nil
}

type memPolicies struct {
	mu       sync.Mutex
	records  map[string]PolicyRecord
	watchers map[string]map[*func()]struct{}
}

// SetPolicy implements Policies.
func (s *MemoryStore) SetPolicy(ctx context.Context, prefix, name string, rec PolicyRecord) (PolicyRecord, bool, error) {
	if err := validatePolicyRecord(prefix, name, rec); err != nil {
		return PolicyRecord{}, false, err
	}
	if err := ctx.Err(); err != nil {
		return PolicyRecord{}, false, err
	}
	key := PolicyKey(prefix, name)
	p := &s.policies
	p.mu.Lock()
	if cur, ok := p.records[key]; ok && cur.Version >= rec.Version {
		p.mu.Unlock()
		return cur, false, nil
	}
	if p.records == nil {
		p.records = map[string]PolicyRecord{}
	}
	p.records[key] = rec
	var notify []func()
	for f := range p.watchers[key] {
		notify = append(notify, *f)
	}
	p.mu.Unlock()
	// Synchronously, outside the lock: on a manual clock the whole fleet
	// hears of the change before SetPolicy returns, deterministically.
	for _, f := range notify {
		f()
	}
	return rec, true, nil
}

// GetPolicy implements Policies.
func (s *MemoryStore) GetPolicy(ctx context.Context, prefix, name string) (PolicyRecord, bool, error) {
	if err := validateKey(prefix, name, "policy"); err != nil {
		return PolicyRecord{}, false, err
	}
	if err := ctx.Err(); err != nil {
		return PolicyRecord{}, false, err
	}
	s.policies.mu.Lock()
	defer s.policies.mu.Unlock()
	rec, ok := s.policies.records[PolicyKey(prefix, name)]
	return rec, ok, nil
}

// WatchPolicy implements Policies; SetPolicy calls changed synchronously,
// so no goroutine is involved.
func (s *MemoryStore) WatchPolicy(_ context.Context, prefix, name string, changed func()) (func(), error) {
	if err := validateKey(prefix, name, "policy"); err != nil {
		return nil, err
	}
	key := PolicyKey(prefix, name)
	f := &changed
	p := &s.policies
	p.mu.Lock()
	if p.watchers == nil {
		p.watchers = map[string]map[*func()]struct{}{}
	}
	if p.watchers[key] == nil {
		p.watchers[key] = map[*func()]struct{}{}
	}
	p.watchers[key][f] = struct{}{}
	p.mu.Unlock()
	return func() {
		p.mu.Lock()
		defer p.mu.Unlock()
		delete(p.watchers[key], f)
	}, nil
}
