package inflight

import (
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
}

func newConfig(opts []Option) (config, error) {
	c := config{term: 10 * time.Second, retry: 20 * time.Millisecond, timeout: 500 * time.Millisecond,
		prefix: remote.DefaultPrefix, clk: clock.Real()}
	for _, o := range opts {
		o.apply(&c)
	}
	switch {
	case c.term < 100*time.Millisecond || c.term > time.Hour:
		return c, errs.Errorf("inflight", "%w: term %v must be 100ms to 1h", ErrInvalidOption, c.term)
	case c.retry <= 0 || c.timeout <= 0:
		return c, errs.Errorf("inflight", "%w: retry %v and store timeout %v must be positive", ErrInvalidOption, c.retry, c.timeout)
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
