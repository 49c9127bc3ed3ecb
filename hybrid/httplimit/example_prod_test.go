package httplimit_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"time"

	"github.com/leasehold/leasehold/hybrid"
	"github.com/leasehold/leasehold/hybrid/httplimit"
	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"github.com/leasehold/leasehold/remote"
	"github.com/redis/go-redis/v9"
)

// ExampleMiddleware_production serves an API limited to 2 requests a
// minute per tenant across the fleet, on Redis, as a service would: the
// tenant from a header, draft-11 fields on every response, 429 with
// Retry-After.
func ExampleMiddleware_production() {
	rdb := redis.NewClient(&redis.Options{Addr: redistest.ExampleAddr(), ContextTimeoutEnabled: true})
	defer rdb.Close()
	lim, err := hybrid.New(remote.NewRedis(rdb), hybrid.Policy{Name: "api", Limit: hybrid.PerMinute(2)},
		hybrid.WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		panic(err)
	}
	defer lim.Close(context.Background())

	api := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "hello") })
	srv := httptest.NewServer(httplimit.Middleware(lim, httplimit.ByHeader("X-Tenant"))(api))
	defer srv.Close()

	tenant := "tenant-" + strconv.FormatInt(time.Now().UnixNano(), 36) // a run of its own on a shared server
	for range 3 {
		req, _ := http.NewRequest(http.MethodGet, srv.URL, nil)
		req.Header.Set("X-Tenant", tenant)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			panic(err)
		}
		resp.Body.Close()
		fmt.Println(resp.StatusCode, resp.Header.Get("RateLimit-Policy"), resp.Header.Get("Retry-After") != "")
	}
	// Output:
	// 200 "api";q=2;w=60 false
	// 200 "api";q=2;w=60 false
	// 429 "api";q=2;w=60 true
}
