package hybrid

import (
	"context"
	"fmt"
	"time"

	"github.com/leasehold/leasehold/remote"
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

// SetPolicy changes the limit of the whole fleet: it stores p in the
// store's policy record if p.Version is above the stored one (atomically),
// switches this limiter at once, and every other limiter of the policy
// follows (pushed by pub/sub, polled, or told by the bucket itself when it
// refuses their older version). A version not above the one in force
// returns a *StalePolicyError (errors.Is ErrStalePolicy) naming it; calling
// again with exactly the policy in force is a no-op. p.Name must be the
// limiter's policy name; Version 0 is ErrInvalidPolicy.
func (l *Limiter) SetPolicy(ctx context.Context, p Policy) error {
	cur := l.pol.Load()
	if p.Version == 0 {
		return fmt.Errorf("hybrid: SetPolicy %q: %w: version 0", p.Name, ErrInvalidPolicy)
	}
	if p.Name != cur.Name {
		return fmt.Errorf("hybrid: SetPolicy %q on a limiter of %q: %w", p.Name, cur.Name, ErrInvalidPolicy)
	}
	if err := validatePolicy(p); err != nil {
		return err
	}
	if l.closing.Load() {
		return ErrClosed
	}
	if p.Version <= cur.Version {
		if p == cur.Policy {
			return nil
		}
		return &StalePolicyError{Current: cur.Policy}
	}
	if !l.store.KeepsPolicies() {
		l.adopt(p)
		return nil
	}
	rec, applied, err := l.store.SetPolicy(ctx, l.cfg.prefix, p.Name, remote.PolicyRecord{Version: p.Version, Limit: p.Limit})
	if err != nil {
		return fmt.Errorf("hybrid: SetPolicy %q: %w", p.Name, err)
	}
	stored := Policy{Name: p.Name, Limit: rec.Limit, Version: rec.Version}
	l.adopt(stored)
	if !applied && stored != p {
		return &StalePolicyError{Current: l.pol.Load().Policy}
	}
	return nil
}

// adopt switches to p if it is newer than the policy in force. Leases are
// cut to the new maximum lease (the excess goes back to the store),
// cached "empty until" answers are dropped (the bucket is rescaled), and
// degraded-mode shares follow the new limit.
func (l *Limiter) adopt(p Policy) bool {
	next := newPolicyState(p, l.cfg.maxFraction)
	for {
		cur := l.pol.Load()
		if p.Version <= cur.Version {
			return false
		}
		if l.pol.CompareAndSwap(cur, next) {
			break
		}
	}
	l.stats.policyChanges.Add(1)
	l.cfg.logger.Info("leasehold: policy change", "policy", p.Name, "version", p.Version, "limit", p.Limit.String())
	l.entries.Range(func(_, v any) bool {
		e := v.(*entry)
		e.emptyUntil.Store(0)
		if n := e.lease.Cut(next.maxLease); n > 0 {
			e.drained.Add(n)
			l.queue(l.returnItem(e.key, n))
		}
		return true
	})
	l.after(0, l.flushQueued) // give the excess back now, not at the next sweep
	return true
}

// refreshPolicy reads the stored policy record and adopts it if newer.
func (l *Limiter) refreshPolicy(ctx context.Context) error {
	if !l.store.KeepsPolicies() {
		return nil
	}
	cur := l.pol.Load()
	ctx, cancel := context.WithTimeout(ctx, l.cfg.refillTimeout)
	defer cancel()
	rec, ok, err := l.store.GetPolicy(ctx, l.cfg.prefix, cur.Name)
	if err != nil {
		return err
	}
	if !ok || rec.Version < cur.Version {
		// This limiter holds a newer version than the record (it was
		// started with it): publish it, or the others, told by buckets
		// that a newer version exists, would find no record of it.
		rec, _, err = l.store.SetPolicy(ctx, l.cfg.prefix, cur.Name, remote.PolicyRecord{Version: cur.Version, Limit: cur.Limit})
		if err != nil {
			return err
		}
	}
	l.adopt(Policy{Name: cur.Name, Limit: rec.Limit, Version: rec.Version, Algorithm: cur.Algorithm})
	return nil
}

// syncPolicyOnce makes sure the limiter has compared its policy with the
// store's before its first lease, so a limiter started with an old version
// never creates or rescales a bucket under it.
func (l *Limiter) syncPolicyOnce() {
	if l.polSynced.Load() {
		return
	}
	_, _, _ = l.flights.Do("\x00policy", func() (any, error) {
		if l.polSynced.Load() {
			return nil, nil
		}
		if err := l.refreshPolicy(l.ctx); err == nil {
			l.polSynced.Store(true)
		}
		return nil, nil
	})
}

// watchPolicy subscribes to pushed policy changes: each one is read and
// adopted at once, in a callback of the limiter's clock.
func (l *Limiter) watchPolicy() {
	stop, err := l.store.WatchPolicy(l.ctx, l.cfg.prefix, l.pol.Load().Name, func() {
		l.after(0, l.pollPolicy)
	})
	if err == nil {
		l.unwatch = stop
	}
}

// pollPolicy reads the policy record (every policy poll interval, and on
// every push) and adopts it if newer.
func (l *Limiter) pollPolicy() {
	if err := l.refreshPolicy(l.ctx); err == nil {
		l.polSynced.Store(true)
	}
}

// learnVersion handles a bucket that refused this limiter's version as
// stale: fetch the newer policy now, in the background, once per version.
func (l *Limiter) learnVersion(v uint64) {
	for {
		cur := l.newest.Load()
		if v <= cur {
			return
		}
		if l.newest.CompareAndSwap(cur, v) {
			break
		}
	}
	l.after(0, func() {
		_, _, _ = l.flights.Do("\x00policy", func() (any, error) {
			return nil, l.refreshPolicy(l.ctx)
		})
	})
}

// staleRetry is how soon a decision refused for a stale version may ask
// again: the newer policy is on its way.
const staleRetry = time.Millisecond
