package httplimit

import (
	"net/http"

	"github.com/leasehold/leasehold/inflight"
	"strconv"
	"strings"
)

// Option configures Middleware.
type Option interface{ apply(*config) }

type optionFunc func(*config)

func (f optionFunc) apply(c *config) { f(c) }

type config struct {
	inflight *inflight.Limiter
	cost     func(*http.Request) int64
	actual   func(r *http.Request, status int, h http.Header) int64
	skip     func(*http.Request) bool
	deny     http.Handler
	legacy   bool
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

// WithActualCost settles each admitted request's cost once the handler has
// returned (hybrid.Limiter.ChargeN, Charge.Settle): WithCost's cost is the
// estimate charged up front, actual(r, status, h) the cost the request
// really had, read from the request, the response's status and its header
// (CostFromHeader reads a header the handler set). What the estimate did
// not use goes back; what it lacked is charged, as debt the limit's later
// refills pay. A negative actual keeps the estimate. The handler may also
// settle the charge itself with the cost it measured (an LLM response's
// tokens, once streamed): hybrid.ChargeFromContext(r.Context()).Settle(n);
// then actual is not called.
func WithActualCost(actual func(r *http.Request, status int, h http.Header) int64) Option {
	return optionFunc(func(c *config) { c.actual = actual })
}

// CostFromHeader is an actual cost for WithActualCost: the integer value of
// the response header name, which the handler sets (a trailer works too,
// for a streamed response); -1, keeping the estimate, when it is absent or
// not a non-negative integer.
func CostFromHeader(name string) func(r *http.Request, status int, h http.Header) int64 {
	return func(_ *http.Request, _ int, h http.Header) int64 {
		n, err := strconv.ParseInt(strings.TrimSpace(h.Get(name)), 10, 64)
		if err != nil || n < 0 {
			return -1
		}
		return n
	}
}

// WithInFlight also caps the key's requests in flight across the fleet
// with sem: a request that finds every slot taken gets 429 Too Many
// Requests with Retry-After: 1, as the rate limit's refusals do (the caller
// has too many requests running: it should slow down, which a 503 would
// not say); its slot is released when the handler returns. The cap is
// checked before the rate limit, so a request it refuses costs no token.
func WithInFlight(sem *inflight.Limiter) Option {
	return optionFunc(func(c *config) { c.inflight = sem })
}
