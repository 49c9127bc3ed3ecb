package hybrid

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/leasehold/leasehold/breaker"
	"github.com/leasehold/leasehold/remote"
	"golang.org/x/sync/singleflight"
)

// StalePolicyError is the error of SetPolicy when the version is not above
// the one in force. It matches ErrStalePolicy with errors.Is, and carries
// the policy in force.
type StalePolicyError struct {
	Current Policy
}

func (e *StalePolicyError) Error() string {
	return fmt.Sprintf("hybrid: policy %q: version %d in force: %v", e.Current.Name, e.Current.Version, ErrStalePolicy)
}

// Is makes errors.Is(err, ErrStalePolicy) hold.
func (e *StalePolicyError) Is(target error) bool { return target == ErrStalePolicy }

// policyState is a Policy with everything derived from it, swapped
// atomically as a whole.
type policyState struct {
	Policy
	maxLease int64
}

func newPolicyState(p Policy, frac float64) *policyState {
	if p.Version == 0 {
		p.Version = 1
	}
	return &policyState{Policy: p, maxLease: max(1, int64(frac*float64(p.Limit.Burst)))}
}

// staleRetry is how soon a decision refused for a stale version may ask
// again: the newer policy is on its way.
const staleRetry = time.Millisecond

// policyTracker owns the policy in force and its convergence with the
// store's record: reading it before the first lease, polling, pushes, and
// versions learned from buckets. Its flights are its own, so no user key
// can join or block them.
type policyTracker struct {
	cfg     *config
	store   *breaker.Store
	records remote.Policies // nil when the store keeps no policy records
	cur     atomic.Pointer[policyState]
	newest  atomic.Uint64 // newest policy version a store reply named
	synced  atomic.Bool   // the store's record has been read (or found unreadable)
	// corruptLogged is set once an unreadable record has been logged.
	corruptLogged atomic.Bool
	flights       singleflight.Group
	// adopted is called after each switch to a newer policy (never under
	// a lock of the tracker).
	adopted func(next *policyState)
	unwatch func() // stops pushes; set once by watch
}

func newPolicyTracker(cfg *config, store *breaker.Store, p Policy) *policyTracker {
	t := &policyTracker{cfg: cfg, store: store}
	if _, ok := store.Unwrap().(remote.Policies); ok {
		t.records = store // through the breaker
	} else {
		t.synced.Store(true)
	}
	t.cur.Store(newPolicyState(p, cfg.maxFraction))
	return t
}

func (t *policyTracker) load() *policyState { return t.cur.Load() }

// set stores p in the policy record if newer (see Limiter.SetPolicy) and
// switches to what the store holds afterwards.
func (t *policyTracker) set(ctx context.Context, p Policy) error {
	cur := t.load()
	if p.Version <= cur.Version {
		if p == cur.Policy {
			return nil
		}
		return &StalePolicyError{Current: cur.Policy}
	}
	if t.records == nil {
		t.adopt(p)
		return nil
	}
	rec, applied, err := t.records.SetPolicy(ctx, t.cfg.prefix, p.Name, remote.PolicyRecord{Version: p.Version, Limit: p.Limit})
	if err != nil {
		return fmt.Errorf("hybrid: SetPolicy %q: %w", p.Name, err)
	}
	stored := Policy{Name: p.Name, Limit: rec.Limit, Version: rec.Version, Algorithm: p.Algorithm}
	t.adopt(stored)
	if !applied && stored != p {
		return &StalePolicyError{Current: t.load().Policy}
	}
	return nil
}

// adopt switches to p if it is newer than the policy in force.
func (t *policyTracker) adopt(p Policy) bool {
	next := newPolicyState(p, t.cfg.maxFraction)
	for {
		cur := t.cur.Load()
		if p.Version <= cur.Version {
			return false
		}
		if t.cur.CompareAndSwap(cur, next) {
			break
		}
	}
	t.cfg.logger.LogAttrs(context.Background(), slog.LevelInfo, "leasehold: policy change", slog.String("policy", p.Name),
		slog.Uint64("version", p.Version), slog.String("limit", p.Limit.String()))
	if t.adopted != nil {
		t.adopted(next)
	}
	return true
}

// refresh reads the stored record and adopts it if newer.
func (t *policyTracker) refresh(ctx context.Context) error {
	if t.records == nil {
		return nil
	}
	cur := t.load()
	ctx, cancel := context.WithTimeout(ctx, t.cfg.refillTimeout)
	defer cancel()
	rec, ok, err := t.records.GetPolicy(ctx, t.cfg.prefix, cur.Name)
	if err != nil {
		return err
	}
	if !ok || rec.Version < cur.Version {
		// This limiter holds a newer version than the record (it was
		// started with it): publish it, or the others, told by buckets
		// that a newer version exists, would find no record of it.
		rec, _, err = t.records.SetPolicy(ctx, t.cfg.prefix, cur.Name, remote.PolicyRecord{Version: cur.Version, Limit: cur.Limit})
		if err != nil {
			return err
		}
	}
	t.adopt(Policy{Name: cur.Name, Limit: rec.Limit, Version: rec.Version, Algorithm: cur.Algorithm})
	return nil
}

// syncOnce makes sure the limiter has compared its policy with the
// store's before its first lease, so a limiter started with an old version
// never creates or rescales a bucket under it.
func (t *policyTracker) syncOnce(ctx context.Context) {
	if t.synced.Load() {
		return
	}
	t.refreshShared(ctx)
}

// poll reads the policy record (every policy poll interval, and on every
// push) and adopts it if newer. A record someone else overwrote cannot be
// read: it is logged once and ignored, and decisions follow the buckets
// (which still refuse older versions), rather than asking the store for
// the record again before every lease.
func (t *policyTracker) poll(ctx context.Context) {
	err := t.refresh(ctx)
	if errors.Is(err, remote.ErrCorruptState) && t.corruptLogged.CompareAndSwap(false, true) {
		t.cfg.logger.LogAttrs(context.Background(), slog.LevelError, "leasehold: unreadable policy record; deciding by the buckets",
			slog.String("policy", t.load().Name), slog.String("error", err.Error()))
	}
	if err == nil || errors.Is(err, remote.ErrCorruptState) {
		t.synced.Store(true)
	}
}

// watch subscribes to pushed policy changes; each one calls changed.
func (t *policyTracker) watch(ctx context.Context, changed func()) {
	if t.records == nil {
		return
	}
	if stop, err := t.records.WatchPolicy(ctx, t.cfg.prefix, t.load().Name, changed); err == nil {
		t.unwatch = stop
	}
}

// stopWatch ends the subscription, if any.
func (t *policyTracker) stopWatch() {
	if t.unwatch != nil {
		t.unwatch()
	}
}

// learn records that a bucket refused this limiter's version as stale and
// reports whether v is news (the caller then refreshes, once per version).
func (t *policyTracker) learn(v uint64) bool {
	for {
		cur := t.newest.Load()
		if v <= cur {
			return false
		}
		if t.newest.CompareAndSwap(cur, v) {
			return true
		}
	}
}

// refreshShared polls in the tracker's own flight: concurrent callers
// share one read of the record.
func (t *policyTracker) refreshShared(ctx context.Context) {
	_, _, _ = t.flights.Do("refresh", func() (any, error) {
		t.poll(ctx)
		return nil, nil
	})
}
