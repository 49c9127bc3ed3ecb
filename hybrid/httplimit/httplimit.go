// Package httplimit is net/http middleware over a hybrid.Limiter: each
// request costs tokens (one by default) of the key its KeyFunc names;
// responses carry the RateLimit-Policy and RateLimit fields of
// draft-ietf-httpapi-ratelimit-headers-11 (and, as an option, the older
// RateLimit-Limit/-Remaining/-Reset trio), and rejected requests get 429
// Too Many Requests with Retry-After. A store outage never turns into a
// 5xx: the limiter decides by its outage mode.
//
// Middleware is safe for concurrent use, like the Limiter it wraps.
package httplimit

import (
	"errors"
	"fmt"
	"github.com/leasehold/leasehold/internal/errs"
	"math"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/leasehold/leasehold/hybrid"
)

// KeyFunc names the bucket a request is charged to. An error rejects the
// request with 400 Bad Request; the error's text is not sent to the
// client.
type KeyFunc func(r *http.Request) (string, error)

// ByRemoteIP charges each client IP address as the connection shows it
// (r.RemoteAddr). It ignores Forwarded and X-Forwarded-For, which any
// client can set; behind a proxy, use ByClientIP.
func ByRemoteIP(r *http.Request) (string, error) {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		return "", err
	}
	return host, nil
}

// ByHeader charges the value of header h; a request without it is rejected.
func ByHeader(h string) KeyFunc {
	return func(r *http.Request) (string, error) {
		v := r.Header.Get(h)
		if v == "" {
			return "", errs.New("httplimit", "missing "+h+" header")
		}
		return v, nil
	}
}

// Middleware limits the requests that reach next with lim, by key. Options
// set the cost of a request, requests to skip, the response to a rejected
// request, and the legacy header trio.
func Middleware(lim *hybrid.Limiter, key KeyFunc, opts ...Option) func(http.Handler) http.Handler {
	cfg := config{cost: func(*http.Request) int64 { return 1 }, deny: http.HandlerFunc(tooMany)}
	for _, o := range opts {
		o.apply(&cfg)
	}
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if cfg.skip != nil && cfg.skip(r) {
				next.ServeHTTP(w, r)
				return
			}
			k, err := key(r)
			if err != nil {
				http.Error(w, "rate limit: cannot tell who is asking", http.StatusBadRequest)
				return
			}
			if cfg.inflight != nil {
				if !cfg.inflight.TryAcquire(k, 1) {
					w.Header().Set("Retry-After", "1")
					cfg.deny.ServeHTTP(w, r)
					return
				}
				defer cfg.inflight.Release(k, 1)
			}
			if cfg.actual != nil {
				charged(lim, k, &cfg, next, w, r)
				return
			}
			d, err := lim.AllowN(r.Context(), k, cfg.cost(r))
			if !decided(lim, &cfg, d, err, w, r) {
				return
			}
			next.ServeHTTP(w, r)
		})
	}
}

// decided writes the response of a request that is not let through (an
// error, a refusal) and reports whether it is let through.
func decided(lim *hybrid.Limiter, cfg *config, d hybrid.Decision, err error, w http.ResponseWriter, r *http.Request) bool {
	if status, msg := errorStatus(err); status != 0 {
		http.Error(w, msg, status)
		return false
	}
	setHeaders(w.Header(), lim.Policy().Name, d, cfg.legacy)
	if !d.Allowed {
		w.Header().Set("Retry-After", retryAfter(d))
		cfg.deny.ServeHTTP(w, r)
		return false
	}
	return true
}

// charged serves a request whose cost is settled after the handler
// (WithActualCost): the estimate is charged, the charge rides in the
// request's context, and what the handler did not settle itself is
// settled from the response.
func charged(lim *hybrid.Limiter, k string, cfg *config, next http.Handler, w http.ResponseWriter, r *http.Request) {
	ch, err := lim.ChargeN(r.Context(), k, cfg.cost(r))
	var d hybrid.Decision
	if ch != nil {
		d = ch.Decision
	}
	if !decided(lim, cfg, d, err, w, r) {
		return
	}
	sw := &statusWriter{ResponseWriter: w, status: http.StatusOK}
	next.ServeHTTP(sw, r.WithContext(hybrid.ContextWithCharge(r.Context(), ch)))
	if ch.Settled() {
		return
	}
	if n := cfg.actual(r, sw.status, w.Header()); n >= 0 {
		_ = ch.Settle(n) // only ErrClosed is left: a limiter shutting down charges nothing
	}
}

// statusWriter records the status a handler wrote. Unwrap lets
// http.ResponseController reach the connection's own writer; Flush keeps
// streamed responses (server-sent events) flushing.
type statusWriter struct {
	http.ResponseWriter
	status int
	wrote  bool
}

func (s *statusWriter) WriteHeader(code int) {
	if !s.wrote {
		s.status, s.wrote = code, true
	}
	s.ResponseWriter.WriteHeader(code)
}

func (s *statusWriter) Write(b []byte) (int, error) {
	s.wrote = true
	return s.ResponseWriter.Write(b)
}

func (s *statusWriter) Flush() { _ = http.NewResponseController(s.ResponseWriter).Flush() }

func (s *statusWriter) Unwrap() http.ResponseWriter { return s.ResponseWriter }

// errorStatus maps an AllowN error to a response; 0 for none. Messages
// never echo the key or other internals.
func errorStatus(err error) (int, string) {
	switch {
	case err == nil:
		return 0, ""
	case errors.Is(err, hybrid.ErrInvalidKey):
		return http.StatusBadRequest, "rate limit: invalid key"
	case errors.Is(err, hybrid.ErrExceedsBurst), errors.Is(err, hybrid.ErrInvalidN):
		// A cost the limit can never admit: retrying cannot help, so this
		// is not a 429.
		return http.StatusRequestEntityTooLarge, "rate limit: request costs more than the limit ever allows"
	}
	// ErrClosed (shutting down), the request's context ending, or a
	// corrupt bucket.
	return http.StatusServiceUnavailable, "rate limit: unavailable"
}

func tooMany(w http.ResponseWriter, _ *http.Request) {
	http.Error(w, http.StatusText(http.StatusTooManyRequests), http.StatusTooManyRequests)
}

// retryAfter is a refusal's Retry-After: whole seconds rounded up, never
// 0 (a client told 0 would ask again at once and be refused again).
func retryAfter(d hybrid.Decision) string { return seconds(max(d.RetryAfter, time.Second)) }

// setHeaders writes the draft-11 fields: RateLimit-Policy names the policy
// with its quota (q, Burst) and the window (w, seconds an empty bucket
// takes to fill, rounded up); RateLimit gives what is left (r) and, on an
// admission, the seconds until the bucket is full again (t, rounded up);
// on a refusal t is the Retry-After, the wait for the request's own cost.
//
// r is Decision.Remaining, an estimate of what the whole fleet may still
// admit: it can rise between two requests of one client as the bucket
// refills, as other processes give leased tokens back, or when a store
// reply replaces an older level; it never exceeds q.
func setHeaders(h http.Header, policy string, d hybrid.Decision, legacy bool) {
	name := sfString(policy)
	t := seconds(d.ResetAfter)
	if !d.Allowed {
		t = retryAfter(d)
	}
	h.Set("RateLimit-Policy", fmt.Sprintf("%s;q=%d;w=%s", name, d.Limit.Burst, seconds(d.Limit.DurationFor(d.Limit.Burst))))
	h.Set("RateLimit", fmt.Sprintf("%s;r=%d;t=%s", name, d.Remaining, t))
	if legacy {
		h.Set("RateLimit-Limit", strconv.FormatInt(d.Limit.Burst, 10))
		h.Set("RateLimit-Remaining", strconv.FormatInt(d.Remaining, 10))
		h.Set("RateLimit-Reset", t)
	}
}

// sfString renders s as a Structured Field String (RFC 8941 §3.3.3):
// printable ASCII in quotes, with '"' and '\' escaped; other bytes become
// '?' (policy names are UTF-8, the field is not).
func sfString(s string) string {
	var b strings.Builder
	b.WriteByte('"')
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c == '"' || c == '\\':
			b.WriteByte('\\')
			b.WriteByte(c)
		case c < 0x20 || c > 0x7e:
			b.WriteByte('?')
		default:
			b.WriteByte(c)
		}
	}
	b.WriteByte('"')
	return b.String()
}

// seconds renders d as whole seconds, rounded up, as HTTP fields want.
func seconds(d time.Duration) string {
	return strconv.FormatInt(int64(math.Ceil(d.Seconds())), 10)
}
