// Package httplimit is net/http middleware over a hybrid.Limiter: each
// request costs one token of the key its KeyFunc names; admitted requests
// carry RateLimit headers, rejected ones get 429 Too Many Requests with
// Retry-After. A store outage never turns into a 5xx: the limiter decides by
// its outage mode.
package httplimit

import (
	"errors"
	"math"
	"net"
	"net/http"
	"strconv"
	"time"

	"github.com/leasehold/leasehold/hybrid"
)

// KeyFunc names the bucket a request is charged to. An error rejects the
// request with 400 Bad Request.
type KeyFunc func(r *http.Request) (string, error)

// ByRemoteIP charges each client IP address.
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
			return "", errors.New("httplimit: missing " + h + " header")
		}
		return v, nil
	}
}

// Middleware limits the requests that reach next with lim, by key. It is
// safe for concurrent use, like lim.
func Middleware(lim *hybrid.Limiter, key KeyFunc) func(http.Handler) http.Handler {
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			k, err := key(r)
			if err != nil {
				http.Error(w, "cannot tell who is asking: "+err.Error(), http.StatusBadRequest)
				return
			}
			d, err := lim.AllowN(r.Context(), k, 1)
			switch {
			case errors.Is(err, hybrid.ErrInvalidKey):
				http.Error(w, "invalid rate-limit key", http.StatusBadRequest)
				return
			case err != nil:
				// ErrClosed (shutting down) or the request's context ended.
				http.Error(w, "rate limiter unavailable", http.StatusServiceUnavailable)
				return
			}
			h := w.Header()
			h.Set("RateLimit-Limit", strconv.FormatInt(d.Limit.Burst, 10))
			h.Set("RateLimit-Remaining", strconv.FormatInt(d.Remaining, 10))
			h.Set("RateLimit-Reset", seconds(d.ResetAfter))
			if !d.Allowed {
				h.Set("Retry-After", seconds(d.RetryAfter))
				http.Error(w, http.StatusText(http.StatusTooManyRequests), http.StatusTooManyRequests)
				return
			}
			next.ServeHTTP(w, r)
		})
	}
}

// seconds renders d as whole seconds, rounded up, as HTTP headers want.
func seconds(d time.Duration) string {
	return strconv.FormatInt(int64(math.Ceil(d.Seconds())), 10)
}
