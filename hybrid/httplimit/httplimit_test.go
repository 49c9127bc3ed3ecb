package httplimit

import (
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/hybrid"
	"github.com/leasehold/leasehold/remote"
)

func TestMiddleware(t *testing.T) {
	clk := clock.NewManual(time.Unix(1_700_000_000, 0))
	lim, err := hybrid.New(remote.NewMemory(clk), hybrid.Policy{Name: "http", Limit: hybrid.Limit{Rate: 1, Period: time.Second, Burst: 2}},
		hybrid.WithClock(clk), hybrid.WithMaxReservation(0), hybrid.WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	defer lim.Close(context.Background())
	h := Middleware(lim, ByHeader("X-Tenant"), WithLegacyHeaders())(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusNoContent)
	}))
	do := func(tenant string) *httptest.ResponseRecorder {
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		if tenant != "" {
			r.Header.Set("X-Tenant", tenant)
		}
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		return w
	}
	steps := []struct {
		tenant     string
		wantStatus int
		wantRetry  string
	}{
		{"a", http.StatusNoContent, ""},
		{"a", http.StatusNoContent, ""},
		{"a", http.StatusTooManyRequests, "1"},
		{"b", http.StatusNoContent, ""}, // another key, another bucket
		{"", http.StatusBadRequest, ""},
	}
	for i, s := range steps {
		w := do(s.tenant)
		if w.Code != s.wantStatus || w.Header().Get("Retry-After") != s.wantRetry {
			t.Errorf("request %d (%q): status %d Retry-After %q, want %d %q", i, s.tenant, w.Code, w.Header().Get("Retry-After"), s.wantStatus, s.wantRetry)
		}
		if s.wantStatus != http.StatusBadRequest && w.Header().Get("RateLimit-Limit") != "2" {
			t.Errorf("request %d: RateLimit-Limit %q, want 2", i, w.Header().Get("RateLimit-Limit"))
		}
	}
	clk.Advance(time.Second)
	if w := do("a"); w.Code != http.StatusNoContent {
		t.Fatalf("after the refill: status %d, want 204", w.Code)
	}
	_ = lim.Close(context.Background())
	if w := do("a"); w.Code != http.StatusServiceUnavailable {
		t.Fatalf("after Close: status %d, want 503", w.Code)
	}
}

func TestByRemoteIP(t *testing.T) {
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	r.RemoteAddr = "192.0.2.7:5555"
	if k, err := ByRemoteIP(r); err != nil || k != "192.0.2.7" {
		t.Fatalf("ByRemoteIP = %q, %v", k, err)
	}
	r.RemoteAddr = "garbage"
	if _, err := ByRemoteIP(r); err == nil {
		t.Fatal("ByRemoteIP(garbage) = nil error")
	}
}

// TestRemainingHeaderIsTheFleetsEstimate (issue 10.2): a client's first
// request on a PerSecond(1000) key sees about 999 left, not what is left of
// this server's small lease.
func TestRemainingHeaderIsTheFleetsEstimate(t *testing.T) {
	clk := clock.NewManual(time.Unix(1_700_000_000, 0))
	lim, err := hybrid.New(remote.NewMemory(clk), hybrid.Policy{Name: "http-remaining", Limit: hybrid.PerSecond(1000)},
		hybrid.WithClock(clk), hybrid.WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	defer lim.Close(context.Background())
	h := Middleware(lim, ByHeader("X-Tenant"), WithLegacyHeaders())(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {}))
	for i, want := range []string{"999", "998", "997"} {
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		r.Header.Set("X-Tenant", "a")
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		if got := w.Header().Get("RateLimit-Remaining"); got != want {
			t.Fatalf("request %d: RateLimit-Remaining %q, want %q", i, got, want)
		}
	}
}
