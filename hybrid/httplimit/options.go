package httplimit

import "net/http"

// Option configures Middleware.
type Option interface{ apply(*config) }

type optionFunc func(*config)

func (f optionFunc) apply(c *config) { f(c) }

type config struct {
	cost   func(*http.Request) int64
	skip   func(*http.Request) bool
	deny   http.Handler
	legacy bool
}

// WithCost charges cost(r) tokens for r instead of one. A cost above the
// limit's Burst can never be admitted: such a request gets 413, not 429.
func WithCost(cost func(r *http.Request) int64) Option {
	return optionFunc(func(c *config) { c.cost = cost })
}

// WithSkip lets requests for which skip returns true through without
// charging them (health checks, internal callers).
func WithSkip(skip func(r *http.Request) bool) Option {
	return optionFunc(func(c *config) { c.skip = skip })
}

// WithDenyHandler serves rejected requests instead of the default plain
// 429 Too Many Requests. The RateLimit fields and Retry-After are already
// set when it runs; it should write a 429.
func WithDenyHandler(h http.Handler) Option {
	return optionFunc(func(c *config) { c.deny = h })
}

// WithLegacyHeaders also sends RateLimit-Limit, RateLimit-Remaining and
// RateLimit-Reset, the fields of earlier drafts that many clients still
// read. The default sends only RateLimit-Policy and RateLimit.
func WithLegacyHeaders() Option {
	return optionFunc(func(c *config) { c.legacy = true })
}
