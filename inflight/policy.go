package inflight

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"slices"
	"strconv"
	"strings"

	"github.com/leasehold/leasehold/internal/errs"
	"github.com/leasehold/leasehold/internal/keys"
	"github.com/leasehold/leasehold/remote"
)

// Policy is a concurrency limit that can change while the fleet runs. The
// store keeps the newest version; every limiter of the fleet reads it
// (WithPolicyPoll) and adopts it, and a key's slots in the store are
// decided by the newest version that touched them, so a process that has
// not read a change yet cannot hold more than the change allows.
type Policy struct {
	Name string
	// Slots is the most requests of a key in flight across the fleet at
	// once, 1 to 2^31-1.
	Slots int64
	// Version orders changes: SetPolicy takes only a higher one. New
	// starts at version 1.
	Version uint64
	// Tiers are named limits for plans ("free": 5, "paid": 50): WithTier
	// says which tier a key is under; a key under no tier or one the
	// policy does not name is under Slots. Each tier has slots of its own
	// in the store.
	Tiers map[string]int64
}

// ErrStalePolicy reports a SetPolicy whose version is not above the
// policy in force, or lost to a newer one set meanwhile.
var ErrStalePolicy = errs.New("inflight", "stale policy")

// maxVersion keeps versions exact in Lua's numbers.
const maxVersion = 1<<53 - 1

// Equal reports whether p and q are the same policy, tiers included.
func (p Policy) Equal(q Policy) bool {
	return p.Name == q.Name && p.Slots == q.Slots && p.Version == q.Version && maps.Equal(p.Tiers, q.Tiers)
}

// Validate reports a policy New or SetPolicy cannot enforce, as
// ErrInvalidOption.
func (p Policy) Validate() error {
	if err := keys.ValidateNames("", p.Name); err != nil {
		return errs.Errorf("inflight", "%w: %w", ErrInvalidOption, err)
	}
	if p.Version > maxVersion {
		return errs.Errorf("inflight", "%w: policy %q: version %d over 2^53-1", ErrInvalidOption, p.Name, p.Version)
	}
	if err := validSlots(p.Slots); err != nil {
		return errs.Errorf("inflight", "policy %q: %w", p.Name, err)
	}
	for name, n := range p.Tiers {
		if err := keys.ValidateTier(name); err != nil || name == "" {
			return errs.Errorf("inflight", "%w: policy %q: tier %q: %v", ErrInvalidOption, p.Name, name, err)
		}
		if err := validSlots(n); err != nil {
			return errs.Errorf("inflight", "policy %q, tier %q: %w", p.Name, name, err)
		}
	}
	return nil
}

func validSlots(n int64) error {
	if n < 1 || n > math.MaxInt32 {
		return fmt.Errorf("%w: slots %d must be in 1..2^31-1", ErrInvalidOption, n)
	}
	return nil
}

// slotsOf is the limit of a key under tier.
func (p *Policy) slotsOf(tier string) int64 {
	if n, ok := p.Tiers[tier]; ok {
		return n
	}
	return p.Slots
}

// record is p as the store keeps it: "version slots tier=slots...", tiers
// in order.
func (p Policy) record() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%d %d", p.Version, p.Slots)
	for _, name := range slices.Sorted(maps.Keys(p.Tiers)) {
		fmt.Fprintf(&b, " %s=%d", name, p.Tiers[name])
	}
	return b.String()
}

// policyFrom reads a record of the policy named name.
func policyFrom(name, rec string) (Policy, error) {
	bad := func() (Policy, error) {
		return Policy{}, errs.Errorf("inflight", "policy %q: %w: record %.80q", name, remote.ErrCorruptState, rec)
	}
	f := strings.Fields(rec)
	if len(f) < 2 {
		return bad()
	}
	p := Policy{Name: name}
	var err error
	if p.Version, err = strconv.ParseUint(f[0], 10, 64); err != nil {
		return bad()
	}
	if p.Slots, err = strconv.ParseInt(f[1], 10, 64); err != nil {
		return bad()
	}
	for _, t := range f[2:] {
		tier, n, ok := strings.Cut(t, "=")
		slots, err := strconv.ParseInt(n, 10, 64)
		if !ok || err != nil {
			return bad()
		}
		if p.Tiers == nil {
			p.Tiers = map[string]int64{}
		}
		p.Tiers[tier] = slots
	}
	if p.Validate() != nil {
		return bad()
	}
	return p, nil
}

// Policy returns the policy in force.
func (l *Limiter) Policy() Policy {
	p := *l.policy.Load()
	p.Tiers = maps.Clone(p.Tiers)
	return p
}

// SetPolicy replaces the policy for the whole fleet: the store keeps it if
// its version is above the stored one, and every limiter adopts it within
// a poll (WithPolicyPoll); a key's slots follow it from the first call
// under it. A version not above the one in force is ErrStalePolicy
// (unless p is that very policy). Requests in flight when a limit is
// lowered finish; no acquire passes until the fleet is under the new
// limit.
func (l *Limiter) SetPolicy(ctx context.Context, p Policy) error {
	if err := p.Validate(); err != nil {
		return err
	}
	if p.Name != l.name {
		return errs.Errorf("inflight", "%w: SetPolicy %q on the limiter of %q", ErrInvalidOption, p.Name, l.name)
	}
	cur := l.policy.Load()
	if p.Version <= cur.Version {
		if p.Equal(*cur) {
			return nil
		}
		return errs.Errorf("inflight", "SetPolicy %q v%d: v%d in force: %w", p.Name, p.Version, cur.Version, ErrStalePolicy)
	}
	rec, err := l.store.policy(ctx, keys.SlotsPolicy(l.cfg.prefix, l.name), p.record(), p.Version)
	if err != nil {
		return errs.Errorf("inflight", "SetPolicy %q: %w", p.Name, err)
	}
	stored, err := policyFrom(l.name, rec)
	if err != nil {
		return err
	}
	l.adopt(stored, false)
	if !stored.Equal(p) {
		return errs.Errorf("inflight", "SetPolicy %q v%d: the store holds v%d: %w", p.Name, p.Version, stored.Version, ErrStalePolicy)
	}
	return nil
}

// refresh reads the store's record and adopts it if newer; a record older
// than the policy in force, or none, is replaced by it, so that the
// others find the version their slots calls are told of. The first read
// logs a record that differs from the policy New was given: the record
// wins.
func (l *Limiter) refresh(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, l.cfg.timeout)
	defer cancel()
	cur := l.policy.Load()
	key := keys.SlotsPolicy(l.cfg.prefix, l.name)
	rec, err := l.store.policy(ctx, key, "", 0)
	if err != nil {
		return err
	}
	stored, err := policyFrom(l.name, rec)
	if rec == "" || err == nil && stored.Version < cur.Version {
		if rec, err = l.store.policy(ctx, key, cur.record(), cur.Version); err != nil {
			return err
		}
		stored, err = policyFrom(l.name, rec)
	}
	if err != nil {
		return err
	}
	if !l.synced.Load() {
		// The first read compares the record with the policy in code;
		// a second reader waits for its outcome.
		l.syncMu.Lock()
		defer l.syncMu.Unlock()
		if !l.synced.Load() {
			code := *l.policy.Load()
			code.Version = stored.Version
			if !stored.Equal(code) {
				l.cfg.logger.LogAttrs(ctx, slog.LevelWarn, "leasehold: the in-flight policy in code differs from the store's record; the record wins",
					slog.String("policy", l.name), slog.String("code", cur.record()), slog.String("store", rec))
			}
			l.adopt(stored, true)
			l.synced.Store(true)
			return nil
		}
	}
	l.adopt(stored, false)
	return nil
}

// adopt switches to p if it is newer than the policy in force (or, the
// first time the store's record is read, if it differs), and has every
// key whose limit went down tell the store at once: the answer says
// whether the fleet holds more than the new limit (see slotKey.over); a
// key whose limit went up forgets its last refusal.
func (l *Limiter) adopt(p Policy, first bool) {
	next := &p
	var prev *Policy
	for {
		prev = l.policy.Load()
		if p.Version < prev.Version || p.Version == prev.Version && (!first || p.Equal(*prev)) {
			return
		}
		if l.policy.CompareAndSwap(prev, next) {
			break
		}
	}
	l.cfg.logger.LogAttrs(context.Background(), slog.LevelInfo, "leasehold: in-flight policy change",
		slog.String("policy", p.Name), slog.String("record", p.record()))
	for _, k := range l.keys.all() {
		tier := k.tierName()
		if p.slotsOf(tier) > prev.slotsOf(tier) {
			k.refusedAt.Store(0) // a refusal under the old limit says nothing now
		}
		if p.slotsOf(tier) < prev.slotsOf(tier) {
			k.renew.Store(true)
			l.queue(k)
		}
	}
}

// ReadPolicy returns the record of the in-flight limit name that the
// fleet's limiters keep in store under prefix ("" for
// remote.DefaultPrefix), for operators' tools; ok is false when no
// limiter has published one (or it expired).
func ReadPolicy(ctx context.Context, store remote.Store, prefix, name string) (p Policy, ok bool, err error) {
	b, key, err := policyBackend(store, prefix, name)
	if err != nil {
		return Policy{}, false, err
	}
	rec, err := b.policy(ctx, key, "", 0)
	if err != nil || rec == "" {
		return Policy{}, false, err
	}
	p, err = policyFrom(name, rec)
	return p, err == nil, err
}

// PublishPolicy stores p as the fleet's policy, as SetPolicy does, without
// a limiter: every limiter of p.Name adopts it within a poll. It returns
// the policy in force after the call: p, or, with ErrStalePolicy, the
// record whose version is not below p's.
func PublishPolicy(ctx context.Context, store remote.Store, prefix string, p Policy) (Policy, error) {
	if err := p.Validate(); err != nil {
		return Policy{}, err
	}
	b, key, err := policyBackend(store, prefix, p.Name)
	if err != nil {
		return Policy{}, err
	}
	rec, err := b.policy(ctx, key, p.record(), p.Version)
	if err != nil {
		return Policy{}, errs.Errorf("inflight", "PublishPolicy %q: %w", p.Name, err)
	}
	stored, err := policyFrom(p.Name, rec)
	if err != nil {
		return Policy{}, err
	}
	if !stored.Equal(p) {
		return stored, errs.Errorf("inflight", "PublishPolicy %q v%d: the store holds v%d: %w", p.Name, p.Version, stored.Version, ErrStalePolicy)
	}
	return stored, nil
}

func policyBackend(store remote.Store, prefix, name string) (backend, string, error) {
	if prefix == "" {
		prefix = remote.DefaultPrefix
	}
	if err := keys.ValidateNames(prefix, name); err != nil {
		return nil, "", errs.Errorf("inflight", "%w: %w", ErrInvalidOption, err)
	}
	b, err := backendOf(store)
	return b, keys.SlotsPolicy(prefix, name), err
}
