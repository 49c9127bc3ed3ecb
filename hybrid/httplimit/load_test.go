package httplimit

import (
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leasehold/leasehold/hybrid"
	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"github.com/leasehold/leasehold/remote"
)

// TestFourServersShareOneLimit: real HTTP load through the middleware of 4
// servers, each with its own limiter and Redis client on one real Redis:
// the 2xx responses stay within the exact bound Burst + Rate·elapsed.
func TestFourServersShareOneLimit(t *testing.T) {
	if testing.Short() {
		t.Skip("3 s of load")
	}
	srv := redistest.Standalone(t)
	lim := hybrid.Limit{Rate: 500, Period: time.Second, Burst: 100}
	name := "http-load-" + time.Now().Format("150405.000000")
	var urls []string
	for i := 0; i < 4; i++ {
		l, err := hybrid.New(remote.NewRedis(srv.Client(t)), hybrid.Policy{Name: name, Limit: lim},
			hybrid.WithLogger(slog.New(slog.DiscardHandler)))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = l.Close(context.Background()) })
		s := httptest.NewServer(Middleware(l, ByHeader("X-Tenant"))(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {})))
		t.Cleanup(s.Close)
		urls = append(urls, s.URL)
	}
	client := &http.Client{Timeout: 5 * time.Second}
	var ok, limited, other atomic.Int64
	start := time.Now()
	deadline := start.Add(3 * time.Second)
	var wg sync.WaitGroup
	for g := 0; g < 16; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := g; time.Now().Before(deadline); i++ {
				req, _ := http.NewRequest(http.MethodGet, urls[i%len(urls)], nil)
				req.Header.Set("X-Tenant", "shared")
				resp, err := client.Do(req)
				if err != nil {
					other.Add(1)
					continue
				}
				resp.Body.Close()
				switch resp.StatusCode {
				case http.StatusOK:
					ok.Add(1)
				case http.StatusTooManyRequests:
					limited.Add(1)
				default:
					other.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	bound := lim.Burst + lim.TokensIn(elapsed)
	t.Logf("4 servers, %v: %d admitted (exact bound %d, %.1f%%), %d limited, %d other", elapsed.Round(time.Millisecond),
		ok.Load(), bound, 100*float64(ok.Load())/float64(bound), limited.Load(), other.Load())
	if ok.Load() > bound {
		t.Fatalf("admitted %d through 4 servers, exact bound %d", ok.Load(), bound)
	}
	if other.Load() != 0 || limited.Load() == 0 {
		t.Fatalf("%d unexpected responses, %d limited: the test did not load the limit", other.Load(), limited.Load())
	}
}
