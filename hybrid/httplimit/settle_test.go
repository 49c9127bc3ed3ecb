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
	"github.com/leasehold/leasehold/inflight"
	"github.com/leasehold/leasehold/remote"
)

// TestActualCost: with WithActualCost a request is charged its estimate
// (10) up front and settled after the handler, from the response or by the
// handler itself; what the bucket of 100 (no refill: the clock stands)
// holds once the limiter is closed is 100 less the settled cost, with
// leases that keep their tokens. A decaying lease (the default) keeps a
// refund of a charge its store call decided in the lease, under a line of
// its own, and Close cannot give it back: the bucket then holds 100 less
// the estimate (hybrid.Limiter.refund).
func TestActualCost(t *testing.T) {
	fromHeader := CostFromHeader("X-Cost")
	serverErrorsFree := func(r *http.Request, status int, h http.Header) int64 {
		if status >= 500 {
			return 0
		}
		return fromHeader(r, status, h)
	}
	for _, tc := range []struct {
		name    string
		actual  func(*http.Request, int, http.Header) int64
		header  string // X-Cost the handler sets
		status  int
		settle  int64 // >0: the handler settles the charge itself
		wantLvl int64
	}{
		{name: "header above the estimate", actual: fromHeader, header: "60", status: 200, wantLvl: 40},
		{name: "header below the estimate", actual: fromHeader, header: "3", status: 200, wantLvl: 97},
		{name: "no header keeps the estimate", actual: fromHeader, status: 200, wantLvl: 90},
		{name: "bad header keeps the estimate", actual: fromHeader, header: "lots", status: 200, wantLvl: 90},
		{name: "the handler settles itself", actual: fromHeader, header: "90", status: 200, settle: 25, wantLvl: 75},
		{name: "server errors are free", actual: serverErrorsFree, header: "60", status: 503, wantLvl: 100},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clk := clock.NewManual(time.Unix(1_700_000_000, 0))
			store := remote.NewMemory(clk)
			p := hybrid.Policy{Name: "cost", Limit: hybrid.Limit{Rate: 1, Period: time.Hour, Burst: 100}, Version: 1}
			lim, err := hybrid.New(store, p, hybrid.WithClock(clk), hybrid.WithLogger(slog.New(slog.DiscardHandler)))
			if err != nil {
				t.Fatal(err)
			}
			h := Middleware(lim, ByHeader("X-Tenant"), WithCost(func(*http.Request) int64 { return 10 }),
				WithActualCost(tc.actual))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if tc.settle > 0 {
					if err := hybrid.ChargeFromContext(r.Context()).Settle(tc.settle); err != nil {
						t.Error(err)
					}
				}
				if tc.header != "" {
					w.Header().Set("X-Cost", tc.header)
				}
				w.WriteHeader(tc.status)
				_, _ = w.Write([]byte("done"))
				f, ok := w.(http.Flusher) // a streamed response still flushes
				if !ok {
					t.Fatal("the handler's writer is no http.Flusher")
				}
				f.Flush()
			}))
			r := httptest.NewRequest(http.MethodPost, "/v1/chat", nil)
			r.Header.Set("X-Tenant", "acme")
			w := httptest.NewRecorder()
			h.ServeHTTP(w, r)
			if w.Code != tc.status || !w.Flushed {
				t.Fatalf("status %d, flushed %v; want %d, flushed", w.Code, w.Flushed, tc.status)
			}
			// Close settles what is queued and gives the lease back.
			if err := lim.Close(context.Background()); err != nil {
				t.Fatal(err)
			}
			res, err := store.Lease(context.Background(), remote.Request{Prefix: remote.DefaultPrefix, Policy: p.Name, Key: "acme",
				Limit: p.Limit, Version: 1, N: 100, Min: 1, Need: 1})
			if err != nil {
				t.Fatal(err)
			}
			if res.Granted != tc.wantLvl {
				t.Fatalf("the bucket holds %d after the request, want %d", res.Granted, tc.wantLvl)
			}
		})
	}
}

// TestInFlight: with WithInFlight a tenant's third request while two run
// gets 429 with Retry-After: 1 and costs no token; a slot is released when
// its handler returns.
func TestInFlight(t *testing.T) {
	clk := clock.NewManual(time.Unix(1_700_000_000, 0))
	store := remote.NewMemory(clk)
	lim, err := hybrid.New(store, hybrid.Policy{Name: "rate", Limit: hybrid.Limit{Rate: 1, Period: time.Hour, Burst: 100}},
		hybrid.WithClock(clk), hybrid.WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	defer lim.Close(context.Background())
	sem, err := inflight.New(store, "in-flight", 2, inflight.WithClock(clk), inflight.WithFleetSize(1))
	if err != nil {
		t.Fatal(err)
	}
	defer sem.Close(context.Background())
	block, entered := make(chan struct{}), make(chan struct{}, 2)
	h := Middleware(lim, ByHeader("X-Tenant"), WithInFlight(sem))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			entered <- struct{}{}
			<-block
		}
		w.WriteHeader(http.StatusNoContent)
	}))
	do := func(path string) *httptest.ResponseRecorder {
		r := httptest.NewRequest(http.MethodGet, path, nil)
		r.Header.Set("X-Tenant", "acme")
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		return w
	}
	done := make(chan int, 2)
	for range 2 {
		go func() { done <- do("/slow").Code }()
		<-entered
	}
	if w := do("/fast"); w.Code != http.StatusTooManyRequests || w.Header().Get("Retry-After") != "1" {
		t.Fatalf("a third request in flight: %d Retry-After %q, want 429 and 1", w.Code, w.Header().Get("Retry-After"))
	}
	close(block)
	for range 2 {
		if code := <-done; code != http.StatusNoContent {
			t.Fatalf("a request in flight: %d", code)
		}
	}
	if w := do("/fast"); w.Code != http.StatusNoContent {
		t.Fatalf("after the two ended: %d, want 204", w.Code)
	}
	if got := lim.Stats().Admitted; got != 3 {
		t.Fatalf("the rate limit admitted %d, want 3: the refused request cost a token", got)
	}
}
