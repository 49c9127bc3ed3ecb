package hybrid

import (
	"errors"
	"fmt"
	"github.com/leasehold/leasehold/internal/errs"
	"github.com/leasehold/leasehold/internal/keys"
	"log/slog"
	"time"

	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/remote"
)

// Option configures a Limiter.
type Option interface{ apply(*config) }

type optionFunc func(*config)

func (f optionFunc) apply(c *config) { f(c) }

type config struct {
	prefix   string
	leaseTTL time.Duration
	// stock: leases of token buckets are counted under this process's
	// record at the store until their term (remote.Stock); set by New
	// when the store keeps records (one that is not a region's).
	stock bool
	// realtime: the clock is the real one (set by New); on another a run
	// must be deterministic (the simulator's).
	realtime    bool
	horizon     time.Duration
	maxFraction float64
	// maxFractionSet: WithMaxLeaseFraction was given, and caps stock
	// leases too (else they may take an even part of Burst).
	maxFractionSet bool
	storeTimeout   time.Duration
	refillTimeout  time.Duration
	maxKeys        int
	clk            clock.Clock
	outage         OutageMode
	fleetSize      int
	maxDelay       time.Duration
	maxDelaySet    bool
	logger         *slog.Logger
	sweepInterval  time.Duration
	tierOf         func(key string) string
	hbInterval     time.Duration
	hbExpiry       time.Duration
	policyPoll     time.Duration
	seed           uint64
	seeded         bool
	precedence     PolicyPrecedence
	recoveryHold   time.Duration
	grantTerm      time.Duration
	grantTermSet   bool      // WithCapacityLeases was given
	epoch          time.Time // process clock origin of every mono value; set by New
}

func buildConfig(opts []Option) (config, error) {
	c := config{
		prefix:       remote.DefaultPrefix,
		leaseTTL:     time.Second,
		horizon:      100 * time.Millisecond,
		maxFraction:  0.1,
		storeTimeout: 50 * time.Millisecond,
		maxKeys:      100_000,
		clk:          clock.Real(),
		outage:       OutageDegraded,
		logger:       slog.Default(),
		hbInterval:   time.Second,
		policyPoll:   time.Second,
		recoveryHold: 5 * time.Second,
	}
	for _, o := range opts {
		o.apply(&c)
	}
	if !c.grantTermSet {
		c.grantTerm = defaultGrantTerm
	}
	if c.hbExpiry == 0 {
		c.hbExpiry = 3 * c.hbInterval
	}
	if !c.maxDelaySet {
		c.maxDelay = c.leaseTTL / 2
	}
	if err := c.validate(); err != nil {
		return c, errs.Errorf("hybrid", "%w: %w", ErrInvalidOption, err)
	}
	c.sweepInterval = min(c.leaseTTL/4, 250*time.Millisecond)
	// Background refills are on no request's path: they may wait longer
	// than a decision would, up to the breaker's default latency threshold,
	// so that a briefly slow store costs no leased tokens.
	c.refillTimeout = max(c.storeTimeout, 500*time.Millisecond)
	return c, nil
}

// validate reports the first setting that cannot work.
func (c *config) validate() error {
	checks := []struct {
		bad bool
		msg string
	}{
		{c.leaseTTL <= 0, fmt.Sprintf("lease TTL %v must be positive", c.leaseTTL)},
		{c.horizon <= 0, fmt.Sprintf("refill horizon %v must be positive", c.horizon)},
		{!(c.maxFraction > 0 && c.maxFraction <= 1), fmt.Sprintf("max lease fraction %v must be in (0, 1]", c.maxFraction)},
		{c.storeTimeout <= 0, fmt.Sprintf("store timeout %v must be positive", c.storeTimeout)},
		{c.maxKeys <= 0, fmt.Sprintf("max keys %d must be positive", c.maxKeys)},
		{c.clk == nil, "nil clock"},
		{c.outage < OutageDegraded || c.outage > OutageFailClosed, fmt.Sprintf("unknown outage mode %d", c.outage)},
		{c.fleetSize < 0, fmt.Sprintf("fleet size %d must not be negative", c.fleetSize)},
		{c.logger == nil, "nil logger"},
		{c.policyPoll <= 0, fmt.Sprintf("policy poll interval %v must be positive", c.policyPoll)},
		{c.hbInterval <= 0, fmt.Sprintf("heartbeat interval %v must be positive", c.hbInterval)},
		{c.hbExpiry < c.hbInterval, fmt.Sprintf("heartbeat expiry %v below interval %v", c.hbExpiry, c.hbInterval)},
		{c.recoveryHold < 0, fmt.Sprintf("recovery hold %v must not be negative", c.recoveryHold)},
		{c.grantTerm != 0 && (c.grantTerm < 100*time.Millisecond || c.grantTerm > time.Hour), fmt.Sprintf("capacity lease term %v must be 0 or 100ms to 1h", c.grantTerm)},
		{c.maxDelay < 0 || c.maxDelay >= c.leaseTTL, fmt.Sprintf("max reservation %v must be in [0, lease TTL %v)", c.maxDelay, c.leaseTTL)},
	}
	for _, ch := range checks {
		if ch.bad {
			return errors.New(ch.msg)
		}
	}
	return keys.Validate(c.prefix, "p", "k")
}

// WithPrefix namespaces every Redis key of the limiter. The default is
// "leasehold:". A prefix must not contain braces (they would move the hash
// tag).
func WithPrefix(p string) Option { return optionFunc(func(c *config) { c.prefix = p }) }

// WithTier sets the function that says which of the policy's Tiers a key
// is under; it is called on every decision, so it should be cheap (a map
// read, a prefix test). A key under "" or a tier the policy does not name
// is under the policy's own Limit and Also. When the function starts
// naming another tier for a key, the key's next decision starts under
// that tier's limit (its tokens under the old tier go back). Without
// this option every key is under the policy's own limits.
func WithTier(tierOf func(key string) string) Option {
	return optionFunc(func(c *config) { c.tierOf = tierOf })
}

// WithLeaseTTL sets how long leased tokens may sit unspent before they are
// given back. Shorter returns tokens sooner; longer saves store calls on
// bursty keys. The default is 1 s. A token bucket's lease is stock: the
// store counts its tokens under this process's record, and refills the
// bucket only up to Burst less what every holder holds, until the TTL
// and 1 s more (docs/how-it-works.md).
func WithLeaseTTL(d time.Duration) Option { return optionFunc(func(c *config) { c.leaseTTL = d }) }

// regional reports whether s, or a store it wraps (through Unwrap, as
// breaker.Store does), answers for one region from pools of a parent's
// buckets: a tiered.Store, known by its Region method. A pool holds the
// parent's tokens until it spends them or its TTL ends: a process's
// leases there are plain (given back at their TTL), as the pools bound
// what the region spends.
func regional(s remote.Store) bool {
	for range 16 { // a wrapper that unwraps to itself ends too
		if _, ok := s.(interface{ Region() string }); ok {
			return true
		}
		u, ok := s.(interface{ Unwrap() remote.Store })
		if !ok {
			return false
		}
		s = u.Unwrap()
	}
	return false
}

// WithRefillHorizon sets how far ahead a lease should last at the key's
// recent demand: the batch size is demand × horizon. The default is 100 ms.
func WithRefillHorizon(d time.Duration) Option {
	return optionFunc(func(c *config) { c.horizon = d })
}

// WithMaxLeaseFraction caps a lease at this fraction of Burst (at least one
// token), so that no process hoards the bucket. The default is 0.1, and
// on a key at its limit a lease may take up to Burst/(2N) in a fleet of
// N unless this option is given.
func WithMaxLeaseFraction(f float64) Option {
	return optionFunc(func(c *config) { c.maxFraction, c.maxFractionSet = f, true })
}

// WithStoreTimeout bounds how long a decision waits for the store; Allow
// never waits on the store longer than this, and decides by the outage mode
// when the store has not answered. Background refills may wait up to
// max(this, 500 ms), and 10 ms more. The default is 50 ms.
func WithStoreTimeout(d time.Duration) Option {
	return optionFunc(func(c *config) { c.storeTimeout = d })
}

// WithMaxKeys bounds how many keys the limiter tracks locally; beyond it,
// keys are evicted and their leased tokens returned. The default is 100 000.
func WithMaxKeys(n int) Option { return optionFunc(func(c *config) { c.maxKeys = n }) }

// WithClock sets the clock for lease age, timeouts and degraded mode. The
// default is the system clock. The store's clock still decides buckets.
func WithClock(clk clock.Clock) Option { return optionFunc(func(c *config) { c.clk = clk }) }

// WithOutageMode chooses what decides while the store is unavailable. The
// default is OutageDegraded.
func WithOutageMode(m OutageMode) Option { return optionFunc(func(c *config) { c.outage = m }) }

// WithFleetSize fixes the number of processes sharing the limit, used for
// degraded-mode shares, and turns heartbeats off. The default, 0, counts the
// fleet by heartbeats (see WithHeartbeat); before the first count, N is 1.
func WithFleetSize(n int) Option { return optionFunc(func(c *config) { c.fleetSize = n }) }

// WithMaxReservation sets how far ahead the store may future-date a lease
// on a contended key (a GCRA reservation: tokens granted now, spendable
// later). 0 disables reservations: a contended key then retries when a
// batch is due. The default is half the lease TTL.
func WithMaxReservation(d time.Duration) Option {
	return optionFunc(func(c *config) { c.maxDelay, c.maxDelaySet = d, true })
}

// WithLogger sets the logger for mode changes. The default is
// slog.Default().
func WithLogger(l *slog.Logger) Option { return optionFunc(func(c *config) { c.logger = l }) }

// WithHeartbeat sets how often the limiter announces itself in the store's
// fleet set for its policy, and how long an announcement lasts; the count of
// live members is N for degraded-mode shares, and the last count before an
// outage is kept through it. The defaults are 1 s and 3 s (expiry 0 means 3
// intervals).
func WithHeartbeat(interval, expiry time.Duration) Option {
	return optionFunc(func(c *config) { c.hbInterval, c.hbExpiry = interval, expiry })
}

// WithPolicyPoll sets how often the limiter reads its policy's record from
// the store, in case a pushed change (pub/sub) was missed. The default is
// 1 s.
func WithPolicyPoll(d time.Duration) Option {
	return optionFunc(func(c *config) { c.policyPoll = d })
}

// WithSeed makes the limiter's randomness (its fleet member name and the
// reconciler's jitter) repeatable, for simulations and tests. By default it
// is random.
func WithSeed(seed uint64) Option {
	return optionFunc(func(c *config) { c.seed, c.seeded = seed, true })
}

// WithCapacityLeases sets the term of capacity grants (flow): a share of
// the rate, divided among holders by demand, spent locally with no store
// call and renewed every quarter of the term. A holder cut off from the
// store keeps admitting by its grant until the term ends, so a partition
// shorter than the term admits nothing over the limit; a crashed holder's
// share stays counted until its term ends (Close gives it back at once).
// The default is 15 s, which rides out a Redis failover with renewals to
// spare; 0 turns grants off. Sliding windows and several limits take no
// grants.
func WithCapacityLeases(term time.Duration) Option {
	return optionFunc(func(c *config) { c.grantTerm, c.grantTermSet = term, true })
}

// defaultGrantTerm is the grants' term unless WithCapacityLeases sets it:
// a Redis failover takes a few seconds, and 15 s rides one out with two
// renewals to spare.
const defaultGrantTerm = 15 * time.Second

// WithRecoveryHold bounds how long a process whose store came back keeps
// deciding by its degraded share while processes that heartbeats counted
// before the outage have not come back. Those may be cut off from the store
// and still spending their shares: drawing the whole bucket meanwhile would
// let the fleet admit the limit plus their shares. A peer that died during
// the outage costs this process at most this long at its share. 0 turns
// the hold off. It needs heartbeats (no WithFleetSize). The default is 5 s.
func WithRecoveryHold(d time.Duration) Option {
	return optionFunc(func(c *config) { c.recoveryHold = d })
}

// PolicyPrecedence says which policy wins when the one New is given
// differs from the record in force in the store (set by SetPolicy, the
// CLI, or another process started with other limits).
type PolicyPrecedence int

const (
	// PolicyFromStore adopts the store's record: every process of the
	// fleet converges on it, and the policy given to New is only the
	// first one's. A difference is logged at WARN, naming both.
	PolicyFromStore PolicyPrecedence = iota
	// PolicyFromCode publishes the policy given to New as the next
	// version of the record (the record's version + 1), so a deploy with
	// new limits in code changes the fleet's limit. A difference is logged
	// at WARN, naming both. Two deploys with different limits started
	// together then take turns: use it where one codebase owns the limit.
	PolicyFromCode
)

// WithPolicyPrecedence chooses who wins when the policy given to New
// differs from the record in force in the store (its limits, algorithm or
// tiers; the version is not compared). The default is PolicyFromStore.
func WithPolicyPrecedence(p PolicyPrecedence) Option {
	return optionFunc(func(c *config) { c.precedence = p })
}
