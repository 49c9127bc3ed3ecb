package httplimit

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/hybrid"
	"github.com/leasehold/leasehold/remote"
)

func testLimiter(t *testing.T, p hybrid.Policy) (*hybrid.Limiter, *clock.Manual) {
	t.Helper()
	clk := clock.NewManual(time.Unix(1_700_000_000, 0))
	lim, err := hybrid.New(remote.NewMemory(clk), p, hybrid.WithClock(clk), hybrid.WithMaxReservation(0),
		hybrid.WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = lim.Close(context.Background()) })
	return lim, clk
}

func serve(h http.Handler, r *http.Request) *httptest.ResponseRecorder {
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	return w
}

// TestDraftHeaders: exact field values and syntax of
// draft-ietf-httpapi-ratelimit-headers-11, the legacy trio only on request,
// and Retry-After in whole seconds rounded up, never 0.
func TestDraftHeaders(t *testing.T) {
	// 10 per 4 s, burst 10: an empty bucket fills in 4 s; one token
	// takes 400 ms.
	lim, clk := testLimiter(t, hybrid.Policy{Name: `api "v2"`, Limit: hybrid.Limit{Rate: 10, Period: 4 * time.Second, Burst: 10}})
	h := Middleware(lim, ByHeader("X-Tenant"), WithCost(func(r *http.Request) int64 {
		if r.Method == http.MethodPost {
			return 4
		}
		return 1
	}))(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	req := func(method string) *http.Request {
		r := httptest.NewRequest(method, "/", nil)
		r.Header.Set("X-Tenant", "t1")
		return r
	}
	steps := []struct {
		method                   string
		status                   int
		policy, rateLimit, retry string
	}{
		{http.MethodGet, 200, `"api \"v2\"";q=10;w=4`, `"api \"v2\"";r=9;t=1`, ""},
		// The tenant came back at once: its lease keeps a token for the
		// next request, which the store counts as held under this
		// process's record until its term (the lease TTL and a second of
		// grace), so the bucket is full only later than its level says.
		{http.MethodPost, 200, `"api \"v2\"";q=10;w=4`, `"api \"v2\"";r=5;t=5`, ""},
		{http.MethodPost, 200, `"api \"v2\"";q=10;w=4`, `"api \"v2\"";r=1;t=6`, ""},
		{http.MethodPost, 429, `"api \"v2\"";q=10;w=4`, `"api \"v2\"";r=1;t=2`, "2"}, // 3 tokens short: 1.2 s, rounded up
		{http.MethodGet, 200, `"api \"v2\"";q=10;w=4`, `"api \"v2\"";r=0;t=4`, ""},
		{http.MethodGet, 429, `"api \"v2\"";q=10;w=4`, `"api \"v2\"";r=0;t=1`, "1"}, // 400 ms, rounded up
	}
	for i, s := range steps {
		w := serve(h, req(s.method))
		got := []string{w.Header().Get("RateLimit-Policy"), w.Header().Get("RateLimit"), w.Header().Get("Retry-After")}
		want := []string{s.policy, s.rateLimit, s.retry}
		if w.Code != s.status || strings.Join(got, "|") != strings.Join(want, "|") {
			t.Errorf("request %d (%s): %d %q, want %d %q", i, s.method, w.Code, got, s.status, want)
		}
		if w.Header().Get("RateLimit-Limit") != "" {
			t.Errorf("request %d: legacy RateLimit-Limit sent without WithLegacyHeaders", i)
		}
	}
	clk.Advance(time.Hour)
}

// TestRetryAfterNeverZero: a rejection whose wait is under a second says 1.
func TestRetryAfterNeverZero(t *testing.T) {
	lim, _ := testLimiter(t, hybrid.Policy{Name: "fast", Limit: hybrid.Limit{Rate: 1000, Period: time.Second, Burst: 1}})
	h := Middleware(lim, ByHeader("X-Tenant"))(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	r.Header.Set("X-Tenant", "a")
	serve(h, r)
	w := serve(h, r)
	if w.Code != http.StatusTooManyRequests || w.Header().Get("Retry-After") != "1" {
		t.Fatalf("second request: %d Retry-After %q, want 429 and 1", w.Code, w.Header().Get("Retry-After"))
	}
}

// TestErrorsDoNotEchoInternals: a KeyFunc error is a 400 whose body does
// not repeat the error; a cost above Burst is a 413, not a 429 forever.
func TestErrorsDoNotEchoInternals(t *testing.T) {
	lim, _ := testLimiter(t, hybrid.Policy{Name: "errs", Limit: hybrid.PerSecond(5)})
	secret := errors.New("db password is hunter2")
	h := Middleware(lim, func(*http.Request) (string, error) { return "", secret })(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	w := serve(h, httptest.NewRequest(http.MethodGet, "/", nil))
	if w.Code != http.StatusBadRequest || strings.Contains(w.Body.String(), "hunter2") {
		t.Fatalf("KeyFunc error: %d %q, want 400 without the error's text", w.Code, w.Body.String())
	}
	h = Middleware(lim, func(*http.Request) (string, error) { return "k", nil },
		WithCost(func(*http.Request) int64 { return 6 }))(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	if w := serve(h, httptest.NewRequest(http.MethodGet, "/", nil)); w.Code != http.StatusRequestEntityTooLarge {
		t.Fatalf("cost 6 over burst 5: %d, want 413", w.Code)
	}
}

// TestSkipAndDenyHandler: skipped requests are not charged; rejected ones
// reach the deny handler with the fields set.
func TestSkipAndDenyHandler(t *testing.T) {
	lim, _ := testLimiter(t, hybrid.Policy{Name: "skip", Limit: hybrid.Limit{Rate: 1, Period: time.Hour, Burst: 1}})
	deny := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		if w.Header().Get("Retry-After") == "" || w.Header().Get("RateLimit") == "" {
			t.Error("deny handler ran before the fields were set")
		}
		w.WriteHeader(http.StatusTeapot)
	})
	h := Middleware(lim, ByHeader("X-Tenant"), WithSkip(func(r *http.Request) bool { return r.URL.Path == "/healthz" }),
		WithDenyHandler(deny))(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	for i := 0; i < 5; i++ {
		if w := serve(h, httptest.NewRequest(http.MethodGet, "/healthz", nil)); w.Code != http.StatusOK {
			t.Fatalf("skipped request %d: %d", i, w.Code)
		}
	}
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	r.Header.Set("X-Tenant", "a")
	if w := serve(h, r); w.Code != http.StatusOK {
		t.Fatalf("first charged request: %d, want 200 (skipped ones cost nothing)", w.Code)
	}
	if w := serve(h, r); w.Code != http.StatusTeapot {
		t.Fatalf("rejected request: %d, want the deny handler's 418", w.Code)
	}
}

// TestByClientIP: forwarded addresses count only from trusted proxies.
func TestByClientIP(t *testing.T) {
	key, err := ByClientIP("10.0.0.0/8", "::1/128")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		remote, xff, fwd, want string
	}{
		{"203.0.113.9:1234", "", "", "203.0.113.9"},
		{"203.0.113.9:1234", "1.2.3.4", "", "203.0.113.9"}, // untrusted peer: its claim buys nothing
		{"10.1.2.3:80", "198.51.100.7", "", "198.51.100.7"},
		{"10.1.2.3:80", "1.2.3.4, 198.51.100.7, 10.9.9.9", "", "198.51.100.7"}, // spoofed first hop ignored
		{"10.1.2.3:80", "", `for="[2001:db8::7]:4711";proto=https, for=10.2.2.2`, "2001:db8::7"},
		{"[::1]:80", "", "for=192.0.2.60", "192.0.2.60"},
		{"10.1.2.3:80", "10.5.5.5", "", "10.5.5.5"}, // all trusted: the farthest
	} {
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		r.RemoteAddr = tc.remote
		if tc.xff != "" {
			r.Header.Set("X-Forwarded-For", tc.xff)
		}
		if tc.fwd != "" {
			r.Header.Set("Forwarded", tc.fwd)
		}
		if got, err := key(r); err != nil || got != tc.want {
			t.Errorf("remote %s XFF %q Forwarded %q: %q, %v; want %q", tc.remote, tc.xff, tc.fwd, got, err, tc.want)
		}
	}
	if _, err := ByClientIP("not a cidr"); err == nil {
		t.Fatal("ByClientIP accepted an invalid CIDR")
	}
}
