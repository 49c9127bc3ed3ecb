package envoyrls

import (
	"context"
	"log/slog"
	"testing"
	"time"

	ratelimit "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"

	"github.com/leasehold/leasehold/hybrid"
	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"github.com/leasehold/leasehold/remote"
)

// TestOutageModes: with Redis killed, fail-open admits every request and
// fail-closed refuses every one; neither fails a call.
func TestOutageModes(t *testing.T) {
	t.Parallel() // its own servers or prefix
	for _, tc := range []struct {
		name string
		mode hybrid.OutageMode
		want rlsv3.RateLimitResponse_Code
	}{
		{"fail-open", hybrid.OutageFailOpen, rlsv3.RateLimitResponse_OK},
		{"fail-closed", hybrid.OutageFailClosed, rlsv3.RateLimitResponse_OVER_LIMIT},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rs := redistest.NewServer(t)
			cfg, err := Parse(map[string][]byte{"api.yaml": []byte("domain: api\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: second, requests_per_unit: 5}")})
			if err != nil {
				t.Fatal(err)
			}
			srv, err := NewServer(remote.NewRedis(rs.Client(t)), cfg, WithLimiterOptions(hybrid.WithOutageMode(tc.mode),
				hybrid.WithLogger(slog.New(slog.DiscardHandler)), hybrid.WithStoreTimeout(200*time.Millisecond)))
			if err != nil {
				t.Fatal(err)
			}
			client := serve(t, srv)
			ask := func() rlsv3.RateLimitResponse_Code {
				resp, err := client.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "api", Descriptors: []*ratelimit.RateLimitDescriptor{desc("tenant", "acme")}})
				if err != nil {
					t.Fatalf("a call failed: %v", err)
				}
				return resp.GetOverallCode()
			}
			ask()
			if err := rs.Kill(); err != nil {
				t.Fatal(err)
			}
			var lim *hybrid.Limiter
			for _, l := range srv.Limiters() {
				lim = l
			}
			deadline := time.Now().Add(5 * time.Second)
			for lim.Mode() != hybrid.ModeDegraded {
				if time.Now().After(deadline) {
					t.Fatalf("mode %v 5 s after Redis was killed", lim.Mode())
				}
				ask()
			}
			for i := range 20 {
				if got := ask(); got != tc.want {
					t.Fatalf("request %d with Redis away: %v, want %v", i, got, tc.want)
				}
			}
		})
	}
}

// TestUnlimitedNeverTouchesRedis: an unlimited rule and a descriptor with
// no rule cost no Redis command.
func TestUnlimitedNeverTouchesRedis(t *testing.T) {
	c := redistest.Standalone(t).Client(t)
	var n calls
	c.AddHook(&n)
	cfg, err := Parse(map[string][]byte{"a.yaml": []byte("domain: free\ndescriptors:\n  - key: path\n    value: /healthz\n    rate_limit: {unlimited: true}")})
	if err != nil {
		t.Fatal(err)
	}
	srv, err := NewServer(remote.NewRedis(c), cfg, WithLimiterOptions(hybrid.WithLogger(slog.New(slog.DiscardHandler))))
	if err != nil {
		t.Fatal(err)
	}
	client := serve(t, srv)
	before := n.n.Load()
	for range 50 {
		resp, err := client.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "free",
			Descriptors: []*ratelimit.RateLimitDescriptor{desc("path", "/healthz"), desc("path", "/other")}})
		if err != nil || resp.GetOverallCode() != rlsv3.RateLimitResponse_OK || resp.GetStatuses()[0].GetCurrentLimit() != nil {
			t.Fatalf("%v %v", resp, err)
		}
	}
	if got := n.n.Load() - before; got != 0 {
		t.Fatalf("%d Redis commands for 50 requests on an unlimited rule and no rule", got)
	}
}
