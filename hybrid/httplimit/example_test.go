package httplimit_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"time"

	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/hybrid"
	"github.com/leasehold/leasehold/hybrid/httplimit"
	"github.com/leasehold/leasehold/remote"
)

// policyField returns the RateLimit-Policy field h sends: the same on every
// response.
func policyField(h http.Handler) string {
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	r.Header.Set("X-Tenant", "other")
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	return w.Header().Get("RateLimit-Policy")
}

// ExampleMiddleware limits an API to 2 requests per second per tenant and
// shows what a client sees. (A real service passes remote.NewRedis(rdb);
// the in-memory store and manual clock keep the example deterministic.)
func ExampleMiddleware() {
	clk := clock.NewManual(time.Unix(1_700_000_000, 0))
	lim, err := hybrid.New(remote.NewMemory(clk), hybrid.Policy{Name: "api", Limit: hybrid.PerSecond(2)},
		hybrid.WithClock(clk), hybrid.WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		panic(err)
	}
	defer lim.Close(context.Background())
	api := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { fmt.Fprint(w, "ok") })
	h := httplimit.Middleware(lim, httplimit.ByHeader("X-Tenant"))(api)
	for i := 0; i < 3; i++ {
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		r.Header.Set("X-Tenant", "acme")
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		fmt.Printf("%d RateLimit: %s Retry-After: %q\n", w.Code, w.Header().Get("RateLimit"), w.Header().Get("Retry-After"))
	}
	fmt.Println("RateLimit-Policy:", policyField(h))
	// Output:
	// 200 RateLimit: "api";r=1;t=1 Retry-After: ""
	// 200 RateLimit: "api";r=0;t=1 Retry-After: ""
	// 429 RateLimit: "api";r=0;t=1 Retry-After: "1"
	// RateLimit-Policy: "api";q=2;w=1
}
