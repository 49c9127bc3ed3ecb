package remote

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/leasehold/leasehold/internal/errs"
	"github.com/leasehold/leasehold/internal/keys"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/leasehold/leasehold/local"
	"github.com/redis/go-redis/v9"
)

// policyTTL is how long a policy record lives in Redis after it was last
// set.
const policyTTL = 30 * 24 * time.Hour

// PolicyRecord is a policy version as the store keeps it.
type PolicyRecord struct {
	Version uint64
	Limit   local.Limit
	// Window, Also and Tiers are the policy's shape (see Request): every
	// limiter that reads the record enforces the same limits for each
	// tier.
	Window bool
	Also   []local.Limit
	Tiers  map[string]TierRecord
}

// TierRecord is the limits of one named tier of a policy.
type TierRecord struct {
	Limit local.Limit
	Also  []local.Limit
}

// shapeJSON is the shape part of a policy record, after its four numbers.
type shapeJSON struct {
	Window bool                `json:"window,omitempty"`
	Also   [][3]int64          `json:"also,omitempty"`
	Tiers  map[string]tierJSON `json:"tiers,omitempty"`
}

type tierJSON struct {
	Limit [3]int64   `json:"limit"`
	Also  [][3]int64 `json:"also,omitempty"`
}

func limitJSON(l local.Limit) [3]int64 {
	return [3]int64{l.Rate, int64(l.Period / time.Microsecond), l.Burst}
}

func limitsJSON(ls []local.Limit) [][3]int64 {
	var out [][3]int64
	for _, l := range ls {
		out = append(out, limitJSON(l))
	}
	return out
}

func fromJSON(v [3]int64) (local.Limit, error) {
	if v[1] <= 0 || v[1] > int64(local.MaxTimeToFull/time.Microsecond) {
		return local.Limit{}, fmt.Errorf("%w: period %dµs", local.ErrInvalidLimit, v[1])
	}
	l := local.Limit{Rate: v[0], Period: time.Duration(v[1]) * time.Microsecond, Burst: v[2]}
	return l, l.Validate()
}

func fromJSONs(vs [][3]int64) ([]local.Limit, error) {
	var out []local.Limit
	for _, v := range vs {
		l, err := fromJSON(v)
		if err != nil {
			return nil, err
		}
		out = append(out, l)
	}
	return out, nil
}

// shape encodes the record's shape, "" when it has none.
func (rec PolicyRecord) shape() string {
	if !rec.Window && len(rec.Also) == 0 && len(rec.Tiers) == 0 {
		return ""
	}
	j := shapeJSON{Window: rec.Window, Also: limitsJSON(rec.Also)}
	for name, t := range rec.Tiers {
		if j.Tiers == nil {
			j.Tiers = map[string]tierJSON{}
		}
		j.Tiers[name] = tierJSON{Limit: limitJSON(t.Limit), Also: limitsJSON(t.Also)}
	}
	b, _ := json.Marshal(j) // maps of strings and numbers always marshal
	return string(b)
}

// withShape decodes a record's shape into rec.
func (rec *PolicyRecord) withShape(s string) error {
	var j shapeJSON
	dec := json.NewDecoder(strings.NewReader(s))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&j); err != nil {
		return err
	}
	var err error
	rec.Window = j.Window
	if rec.Also, err = fromJSONs(j.Also); err != nil {
		return err
	}
	for name, t := range j.Tiers {
		var tr TierRecord
		if tr.Limit, err = fromJSON(t.Limit); err != nil {
			return err
		}
		if tr.Also, err = fromJSONs(t.Also); err != nil {
			return err
		}
		if rec.Tiers == nil {
			rec.Tiers = map[string]TierRecord{}
		}
		rec.Tiers[name] = tr
	}
	return rec.validateShape()
}

// validateShape checks what a shape adds to a record: valid limits, at
// most maxLimits per tier, tier names keys.ValidateTier accepts, and sliding
// windows whose burst is their rate.
func (rec PolicyRecord) validateShape() error {
	check := func(tier string, lim local.Limit, also []local.Limit) error {
		if len(also)+1 > maxLimits {
			return fmt.Errorf("%w: tier %q has %d limits, at most %d", ErrInvalidPolicy, tier, len(also)+1, maxLimits)
		}
		for _, l := range append([]local.Limit{lim}, also...) {
			if err := l.Validate(); err != nil {
				return errs.Errorf("remote", "tier %q: %w", tier, err)
			}
			if rec.Window && l.Burst != l.Rate {
				return errs.Errorf("remote", "tier %q: %w: a sliding window's burst is its rate", tier, local.ErrInvalidLimit)
			}
		}
		return nil
	}
	if err := check("", rec.Limit, rec.Also); err != nil {
		return err
	}
	for name, t := range rec.Tiers {
		if name == "" {
			return fmt.Errorf("%w: empty tier name", ErrInvalidPolicy)
		}
		if err := keys.ValidateTier(name); err != nil {
			return err
		}
		if err := check(name, t.Limit, t.Also); err != nil {
			return err
		}
	}
	return nil
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
	if err := keys.ValidateNames(prefix, name); err != nil {
		return err
	}
	return rec.Validate()
}

// Validate reports whether rec can be stored: a version in [1,
// MaxVersion], valid limits, at most maxLimits per tier, tier names
// keys.ValidateTier accepts, and sliding windows whose Burst is their Rate.
func (rec PolicyRecord) Validate() error {
	if rec.Version == 0 || rec.Version > MaxVersion {
		return fmt.Errorf("%w: version %d outside [1, %d]", ErrInvalidPolicy, rec.Version, MaxVersion)
	}
	if err := rec.Limit.Validate(); err != nil {
		return err
	}
	return rec.validateShape()
}

// decodePolicy reads a policy record: "version rate period_us burst", then
// optionally a space and the shape as JSON.
func decodePolicy(key, s string) (PolicyRecord, error) {
	f := strings.SplitN(s, " ", 5)
	shape := ""
	if len(f) == 5 {
		shape, f = f[4], f[:4]
	}
	if len(f) != 4 {
		return PolicyRecord{}, errs.Errorf("remote", "policy %q: %w: record %q", key, ErrCorruptState, s)
	}
	var n [4]int64
	for i, x := range f {
		v, err := strconv.ParseInt(x, 10, 64)
		if err != nil || v <= 0 {
			return PolicyRecord{}, errs.Errorf("remote", "policy %q: %w: record %q", key, ErrCorruptState, s)
		}
		n[i] = v
	}
	if n[2] > int64(local.MaxTimeToFull/time.Microsecond) {
		return PolicyRecord{}, errs.Errorf("remote", "policy %q: %w: period in %q", key, ErrCorruptState, s)
	}
	rec := PolicyRecord{Version: uint64(n[0]), Limit: local.Limit{Rate: n[1], Period: time.Duration(n[2]) * time.Microsecond, Burst: n[3]}}
	if err := rec.Limit.Validate(); err != nil {
		return PolicyRecord{}, errs.Errorf("remote", "policy %q: %w: %w", key, ErrCorruptState, err)
	}
	if shape != "" {
		if err := rec.withShape(shape); err != nil {
			return PolicyRecord{}, errs.Errorf("remote", "policy %q: %w: shape: %w", key, ErrCorruptState, err)
		}
	}
	return rec, nil
}

// SetPolicy implements Policies.
func (s *RedisStore) SetPolicy(ctx context.Context, prefix, name string, rec PolicyRecord) (PolicyRecord, bool, error) {
	if err := validatePolicyRecord(prefix, name, rec); err != nil {
		return PolicyRecord{}, false, err
	}
	key := keys.Policy(prefix, name)
	v, err := setPolicyScript.Run(ctx, s.c, []string{key}, rec.Version, rec.Limit.Rate, int64(rec.Limit.Period/time.Microsecond), rec.Limit.Burst, policyTTL.Milliseconds(), rec.shape()).Slice()
	if err != nil {
		return PolicyRecord{}, false, classify(key, err)
	}
	return parsePolicyReply(key, v)
}

// parsePolicyReply reads setPolicyLua's reply with checked conversions.
func parsePolicyReply(key string, v []any) (PolicyRecord, bool, error) {
	if len(v) != 2 {
		return PolicyRecord{}, false, errs.Errorf("remote", "policy %q: %w: reply of %d fields", key, ErrCorruptState, len(v))
	}
	applied, ok := v[0].(int64)
	if !ok || (applied != 0 && applied != 1) {
		return PolicyRecord{}, false, errs.Errorf("remote", "policy %q: %w: applied flag %v", key, ErrCorruptState, v[0])
	}
	str, ok := v[1].(string)
	if !ok {
		return PolicyRecord{}, false, errs.Errorf("remote", "policy %q: %w: record %T", key, ErrCorruptState, v[1])
	}
	cur, err := decodePolicy(key, str)
	return cur, applied == 1, err
}

// GetPolicy implements Policies.
func (s *RedisStore) GetPolicy(ctx context.Context, prefix, name string) (PolicyRecord, bool, error) {
	if err := keys.ValidateNames(prefix, name); err != nil {
		return PolicyRecord{}, false, err
	}
	key := keys.Policy(prefix, name)
	str, err := s.c.Get(ctx, key).Result()
	if errors.Is(err, redis.Nil) {
		return PolicyRecord{}, false, nil
	}
	if err != nil {
		if redis.HasErrorPrefix(err, "WRONGTYPE") {
			return PolicyRecord{}, false, errs.Errorf("remote", "policy %q: %w: %w", key, ErrCorruptState, err)
		}
		return PolicyRecord{}, false, classify(key, err)
	}
	rec, err := decodePolicy(key, str)
	return rec, err == nil, err
}

// WatchPolicy implements Policies with Redis pub/sub on the policy key's
// name (Cluster broadcasts it to every node).
func (s *RedisStore) WatchPolicy(ctx context.Context, prefix, name string, changed func()) (func(), error) {
	if err := keys.ValidateNames(prefix, name); err != nil {
		return nil, err
	}
	ps := s.c.Subscribe(ctx, keys.Policy(prefix, name))
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
	mu      sync.Mutex
	records map[string]PolicyRecord
	// watchers are each policy's, in the order they subscribed: told
	// in that order, so that a run on a manual clock is deterministic
	// (told in map order, the simulator's fleet armed its polls in a
	// different order each run).
	watchers map[string][]*func()
}

// SetPolicy implements Policies.
func (s *MemoryStore) SetPolicy(ctx context.Context, prefix, name string, rec PolicyRecord) (PolicyRecord, bool, error) {
	if err := validatePolicyRecord(prefix, name, rec); err != nil {
		return PolicyRecord{}, false, err
	}
	if err := ctx.Err(); err != nil {
		return PolicyRecord{}, false, err
	}
	key := keys.Policy(prefix, name)
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
	for _, f := range p.watchers[key] {
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
	if err := keys.ValidateNames(prefix, name); err != nil {
		return PolicyRecord{}, false, err
	}
	if err := ctx.Err(); err != nil {
		return PolicyRecord{}, false, err
	}
	s.policies.mu.Lock()
	defer s.policies.mu.Unlock()
	rec, ok := s.policies.records[keys.Policy(prefix, name)]
	return rec, ok, nil
}

// WatchPolicy implements Policies; SetPolicy calls changed synchronously,
// so no goroutine is involved.
func (s *MemoryStore) WatchPolicy(_ context.Context, prefix, name string, changed func()) (func(), error) {
	if err := keys.ValidateNames(prefix, name); err != nil {
		return nil, err
	}
	key := keys.Policy(prefix, name)
	f := &changed
	p := &s.policies
	p.mu.Lock()
	if p.watchers == nil {
		p.watchers = map[string][]*func(){}
	}
	p.watchers[key] = append(p.watchers[key], f)
	p.mu.Unlock()
	return func() {
		p.mu.Lock()
		defer p.mu.Unlock()
		p.watchers[key] = slices.DeleteFunc(p.watchers[key], func(g *func()) bool { return g == f })
		if len(p.watchers[key]) == 0 {
			delete(p.watchers, key)
		}
	}, nil
}
