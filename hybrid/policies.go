package hybrid

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leasehold/leasehold/breaker"
	"github.com/leasehold/leasehold/internal/errs"
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
	return fmt.Sprintf("hybrid: policy %q: version %d in force: %s", e.Current.Name, e.Current.Version, errs.Bare(ErrStalePolicy))
}

// Is makes errors.Is(err, ErrStalePolicy) hold.
func (e *StalePolicyError) Is(target error) bool { return target == ErrStalePolicy }

// policyState is a Policy with everything derived from it, swapped
// atomically as a whole.
type policyState struct {
	Policy
	maxLease int64 // the policy's own tier's
	// tiers[0] is the policy's own limits, then the named tiers in name
	// order; an entry holds its index.
	tiers     []tierState
	tierIndex map[string]uint16
	shaped    bool // sliding windows or several limits: the shape script
	// hold is, for sliding windows, how long after a grant its tokens
	// may be spent (the store counts them until then); life is how long
	// a lease lives here, the rest being slack for a late drain timer.
	hold, life time.Duration
}

// tierState is one tier's limits and what is derived from them.
type tierState struct {
	name     string
	limits   []Limit // Limit, then Also
	maxLease int64   // of the tightest limit
	// equiv is one token bucket that admits no more than any of the
	// limits in any window (a sliding window of R per P as a bucket of
	// ceil(R/2) refilled by the rest per P): degraded shares follow it.
	equiv Limit
	// est refills Remaining estimates at equiv's rate, capped at the
	// tightest limit's size.
	est Limit
}

func newPolicyState(p Policy, cfg *config) *policyState {
	if p.Version == 0 {
		p.Version = 1
	}
	ps := &policyState{Policy: p, shaped: p.Algorithm == SlidingWindow || len(p.Also) > 0}
	ps.tiers = append(ps.tiers, newTierState("", p.Limit, p.Also, p.Algorithm, cfg.maxFraction))
	names := slices.Sorted(maps.Keys(p.Tiers))
	ps.tierIndex = make(map[string]uint16, len(names))
	for _, name := range names {
		t := p.Tiers[name]
		ps.tierIndex[name] = uint16(len(ps.tiers))
		ps.tiers = append(ps.tiers, newTierState(name, t.Limit, t.Also, p.Algorithm, cfg.maxFraction))
		ps.shaped = ps.shaped || len(t.Also) > 0
	}
	ps.maxLease = ps.tiers[0].maxLease
	if p.Algorithm == SlidingWindow {
		shortest := p.Limit.Period
		for _, t := range ps.tiers {
			for _, l := range t.limits {
				shortest = min(shortest, l.Period)
			}
		}
		ps.hold = min(shortest/remote.WindowSlots, cfg.leaseTTL).Truncate(time.Microsecond)
		ps.life = ps.hold / 2
	}
	return ps
}

func newTierState(name string, lim Limit, also []Limit, alg Algorithm, frac float64) tierState {
	t := tierState{name: name, limits: append([]Limit{lim}, also...)}
	capN := int64(math.MaxInt64)
	for i, l := range t.limits {
		b := l
		if alg == SlidingWindow {
			b = windowAsBucket(l)
		}
		capN = min(capN, l.Burst)
		if i == 0 || b.Burst < t.equiv.Burst {
			t.equiv.Burst = b.Burst
		}
		if i == 0 || float64(b.Rate)/float64(b.Period) < float64(t.equiv.Rate)/float64(t.equiv.Period) {
			t.equiv.Rate, t.equiv.Period = b.Rate, b.Period
		}
	}
	t.maxLease = max(1, int64(frac*float64(capN)))
	t.est = Limit{Rate: t.equiv.Rate, Period: t.equiv.Period, Burst: capN}
	return t
}

// windowAsBucket is a token bucket that never admits more than a sliding
// window of l.Rate per l.Period does: a burst of half the rate, refilled
// by the other half each period (one per two periods for a rate of 1).
func windowAsBucket(l Limit) Limit {
	b := (l.Rate + 1) / 2
	if r := l.Rate - b; r > 0 {
		return Limit{Rate: r, Period: l.Period, Burst: b}
	}
	return Limit{Rate: 1, Period: 2 * l.Period, Burst: 1}
}

// tier returns e's tier.
func (p *policyState) tier(e *account) *tierState { return p.tierAt(e.tier) }

// tierAt returns the tier of index i, the policy's own for an index the
// policy does not have.
func (p *policyState) tierAt(i uint16) *tierState {
	if int(i) < len(p.tiers) {
		return &p.tiers[i]
	}
	return &p.tiers[0]
}

// tierOf returns the index of the tier named name; unknown names are the
// policy's own limits.
func (p *policyState) tierOf(name string) uint16 {
	if name == "" {
		return 0
	}
	return p.tierIndex[name] // 0 when unknown
}

// request is the part of a store request that names e's bucket under p.
func (p *policyState) request(prefix string, e *account) remote.Request {
	return p.requestFor(prefix, e.key, e.tier)
}

// requestFor is request for key under the tier of index tier.
func (p *policyState) requestFor(prefix, key string, tier uint16) remote.Request {
	t := p.tierAt(tier)
	r := remote.Request{Prefix: prefix, Policy: p.Name, Tier: t.name, Key: key, Limit: t.limits[0], Version: p.Version,
		Window: p.Algorithm == SlidingWindow, Hold: p.hold}
	if len(t.limits) > 1 {
		r.Also = t.limits[1:]
	}
	return r
}

// sameTiers reports whether p and q name the same tiers in the same order,
// so that entries' tier indices mean the same under both.
func (p *policyState) sameTiers(q *policyState) bool {
	if len(p.tiers) != len(q.tiers) {
		return false
	}
	for i := range p.tiers {
		if p.tiers[i].name != q.tiers[i].name {
			return false
		}
	}
	return true
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
	// follower follows each switch to a newer policy (called under no
	// lock of the tracker).
	follower policyFollower
	unwatch  func() // stops pushes; set once by watch
	// code is the policy New was given; compared once with the record
	// (compared marks it done, compareMu makes a second reader wait for
	// the first one's outcome).
	code      Policy
	compared  atomic.Bool
	compareMu sync.Mutex
}

// policyFollower is told of every switch to a newer policy.
type policyFollower interface {
	adopted(prev, next *policyState)
}

func newPolicyTracker(cfg *config, store *breaker.Store, p Policy, f policyFollower) *policyTracker {
	t := &policyTracker{cfg: cfg, store: store, follower: f, code: p}
	t.code.Version = max(p.Version, 1)
	if _, ok := store.Unwrap().(remote.Policies); ok {
		t.records = store // through the breaker
	} else {
		t.synced.Store(true)
	}
	t.cur.Store(newPolicyState(p, cfg))
	return t
}

func (t *policyTracker) load() *policyState { return t.cur.Load() }

// set stores p in the policy record if newer (see Limiter.SetPolicy) and
// switches to what the store holds afterwards.
func (t *policyTracker) set(ctx context.Context, p Policy) error {
	cur := t.load()
	if p.Version <= cur.Version {
		if p.Equal(cur.Policy) {
			return nil
		}
		return &StalePolicyError{Current: cur.Policy}
	}
	if t.records == nil {
		t.adopt(p)
		return nil
	}
	rec, applied, err := t.records.SetPolicy(ctx, t.cfg.prefix, p.Name, p.record())
	if err != nil {
		return errs.Errorf("hybrid", "SetPolicy %q: %w", p.Name, err)
	}
	stored := policyFrom(p.Name, rec)
	t.adopt(stored)
	if !applied && !stored.Equal(p) {
		return &StalePolicyError{Current: t.load().Policy}
	}
	return nil
}

// adopt switches to p if it is newer than the policy in force.
func (t *policyTracker) adopt(p Policy) bool {
	next := newPolicyState(p, t.cfg)
	var prev *policyState
	for {
		prev = t.cur.Load()
		if p.Version <= prev.Version {
			return false
		}
		if t.cur.CompareAndSwap(prev, next) {
			break
		}
	}
	t.cfg.logger.LogAttrs(context.Background(), slog.LevelInfo, "leasehold: policy change", slog.String("policy", p.Name),
		slog.Uint64("version", p.Version), slog.String("limit", p.Limit.String()))
	if t.follower != nil {
		t.follower.adopted(prev, next)
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
		rec, _, err = t.records.SetPolicy(ctx, t.cfg.prefix, cur.Name, cur.record())
		if err != nil {
			return err
		}
	}
	if rec, err = t.compareWithCode(ctx, rec); err != nil {
		return err
	}
	t.adopt(policyFrom(cur.Name, rec))
	return nil
}

// compareWithCode, on the first record read, compares the record with the
// policy New was given and settles a difference by the precedence option:
// it returns the record to adopt.
func (t *policyTracker) compareWithCode(ctx context.Context, rec remote.PolicyRecord) (remote.PolicyRecord, error) {
	if t.compared.Load() {
		return rec, nil
	}
	// The first poll and the first lease may read the record at the same
	// time: the second waits, so it never decides under the record the
	// first one is replacing (adopt ignores its older version).
	t.compareMu.Lock()
	defer t.compareMu.Unlock()
	if t.compared.Load() {
		return rec, nil
	}
	stored, code := policyFrom(t.code.Name, rec), t.code
	code.Version = stored.Version
	if stored.Equal(code) {
		t.compared.Store(true)
		return rec, nil
	}
	if t.cfg.precedence == PolicyFromCode {
		code.Version = stored.Version + 1
		next, _, err := t.records.SetPolicy(ctx, t.cfg.prefix, code.Name, newPolicyState(code, t.cfg).record())
		if err != nil {
			return rec, err // the next read compares again
		}
		// Logged before anyone can see the new version: a caller that
		// finds it adopted finds the warning written too.
		t.cfg.logger.LogAttrs(context.Background(), slog.LevelWarn,
			"leasehold: the policy in code differs from the store's record; publishing the code's as a new version (WithPolicyPrecedence)",
			slog.String("policy", code.Name), slog.String("code", describePolicy(t.code)), slog.String("store", describePolicy(stored)),
			slog.Uint64("version", next.Version))
		t.compared.Store(true)
		t.adopt(policyFrom(code.Name, next))
		return next, nil
	}
	t.cfg.logger.LogAttrs(context.Background(), slog.LevelWarn,
		"leasehold: the policy in code differs from the store's record; the record wins (WithPolicyPrecedence)",
		slog.String("policy", code.Name), slog.String("code", describePolicy(t.code)), slog.String("store", describePolicy(stored)))
	t.compared.Store(true)
	return rec, nil
}

// describePolicy is p's limits for a log line: version, algorithm, limits
// and tiers.
func describePolicy(p Policy) string {
	var b strings.Builder
	fmt.Fprintf(&b, "v%d %s", p.Version, p.Limit)
	for _, l := range p.Also {
		fmt.Fprintf(&b, " + %s", l)
	}
	if p.Algorithm == SlidingWindow {
		b.WriteString(" sliding window")
	}
	for _, name := range slices.Sorted(maps.Keys(p.Tiers)) {
		fmt.Fprintf(&b, "; tier %s %s", name, p.Tiers[name].Limit)
	}
	return b.String()
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
