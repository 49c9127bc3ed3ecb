package inflight

import (
	"log/slog"
	"time"

	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/internal/errs"
	"github.com/leasehold/leasehold/remote"
)

// Option configures New.
type Option interface{ apply(*config) }

type optionFunc func(*config)

func (f optionFunc) apply(c *config) { f(c) }

type config struct {
	term      time.Duration
	retry     time.Duration
	timeout   time.Duration
	prefix    string
	fleetSize int
	clk       clock.Clock
	tierOf    func(key string) string
	poll      time.Duration
	logger    *slog.Logger
}

func newConfig(opts []Option) (config, error) {
	c := config{term: 10 * time.Second, retry: 20 * time.Millisecond, timeout: 500 * time.Millisecond,
		prefix: remote.DefaultPrefix, clk: clock.Real(), poll: time.Second, logger: slog.Default()}
	for _, o := range opts {
		o.apply(&c)
	}
	switch {
	case c.term < 100*time.Millisecond || c.term > time.Hour:
		return c, errs.Errorf("inflight", "%w: term %v must be 100ms to 1h", ErrInvalidOption, c.term)
	case c.retry <= 0 || c.timeout <= 0 || c.poll <= 0:
		return c, errs.Errorf("inflight", "%w: retry %v, store timeout %v and policy poll %v must be positive", ErrInvalidOption, c.retry, c.timeout, c.poll)
	case c.logger == nil:
		return c, errs.Errorf("inflight", "%w: nil logger", ErrInvalidOption)
	case c.fleetSize < 0 || c.clk == nil:
		return c, errs.Errorf("inflight", "%w: fleet size %d, clock %v", ErrInvalidOption, c.fleetSize, c.clk)
	}
	return c, nil
}

// WithTerm sets how long the store keeps a process's slots without a
// renewal [10s]: the slots of a crashed or cut-off process come back after
// at most a term and a quarter (renewals come every quarter of it). 10 s
// rides out a Redis failover (a few seconds) with renewals to spare;
// 100 ms to 1 h.
func WithTerm(d time.Duration) Option { return optionFunc(func(c *config) { c.term = d }) }

// WithRetry sets how often a blocked Acquire asks the store again for
// slots other processes may have released [20ms]; a release in this
// process wakes it at once.
func WithRetry(d time.Duration) Option { return optionFunc(func(c *config) { c.retry = d }) }

// WithStoreTimeout bounds each store call [500ms].
func WithStoreTimeout(d time.Duration) Option { return optionFunc(func(c *config) { c.timeout = d }) }

// WithPrefix sets the prefix of the store's keys [remote.DefaultPrefix].
func WithPrefix(p string) Option { return optionFunc(func(c *config) { c.prefix = p }) }

// WithFleetSize fixes N, the processes the limit is shared among while the
// store is away, and sizes batches; by default the store's heartbeats
// count it.
func WithFleetSize(n int) Option { return optionFunc(func(c *config) { c.fleetSize = n }) }

// WithClock sets the clock terms, renewals and retries follow [real time].
func WithClock(c clock.Clock) Option { return optionFunc(func(cfg *config) { cfg.clk = c }) }

// WithTier sets the function that says which of the policy's Tiers a key
// is under; it is called on every acquire, so it should be cheap (a map
// read, a prefix test). A key under "" or a tier the policy does not name
// is under the policy's Slots. When the function starts naming another
// tier for a key, the key moves to it once none of its requests is in
// flight in this process (its slots under the old tier go back). Without
// this option every key is under Slots.
func WithTier(tierOf func(key string) string) Option {
	return optionFunc(func(c *config) { c.tierOf = tierOf })
}

// WithPolicyPoll sets how often the limiter reads its policy's record
// from the store [1s]: a SetPolicy elsewhere reaches this process within
// about that long, and at once for a key whose slots were touched under
// the newer version.
func WithPolicyPoll(d time.Duration) Option { return optionFunc(func(c *config) { c.poll = d }) }

// WithLogger sets where policy changes and a policy in code that differs
// from the store's are logged [slog.Default()].
func WithLogger(l *slog.Logger) Option { return optionFunc(func(c *config) { c.logger = l }) }
