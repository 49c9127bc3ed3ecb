package prommetrics

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/hybrid"
	"github.com/leasehold/leasehold/remote"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

func limiter(t testing.TB, lim hybrid.Limit) *hybrid.Limiter {
	t.Helper()
	clk := clock.NewManual(time.Unix(1_700_000_000, 0))
	l, err := hybrid.New(remote.NewMemory(clk), hybrid.Policy{Name: "api", Limit: lim},
		hybrid.WithClock(clk), hybrid.WithFleetSize(2), hybrid.WithMaxReservation(0), hybrid.WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.Close(context.Background()) })
	return l
}

// TestCollectorOnKnownTraffic: 5 decisions on a burst of 3: 3 admitted
// after a store call each (a stock lease in a fleet of 2 asks at most
// Burst/4, here the one token the decision needs); 2 rejected, from the
// store's first refusal then its cached answer.
func TestCollectorOnKnownTraffic(t *testing.T) {
	l := limiter(t, hybrid.Limit{Rate: 1, Period: time.Hour, Burst: 3})
	for i := 0; i < 5; i++ {
		l.Allow(context.Background(), "k")
	}
	c := NewCollector(l)
	want := `
# HELP leasehold_decisions_total Decisions by what decided them and their outcome.
# TYPE leasehold_decisions_total counter
leasehold_decisions_total{outcome="admitted",policy="api",source="degraded"} 0
leasehold_decisions_total{outcome="admitted",policy="api",source="fail-closed"} 0
leasehold_decisions_total{outcome="admitted",policy="api",source="fail-open"} 0
leasehold_decisions_total{outcome="admitted",policy="api",source="lease"} 0
leasehold_decisions_total{outcome="admitted",policy="api",source="remote"} 3
leasehold_decisions_total{outcome="rejected",policy="api",source="degraded"} 0
leasehold_decisions_total{outcome="rejected",policy="api",source="fail-closed"} 0
leasehold_decisions_total{outcome="rejected",policy="api",source="fail-open"} 0
leasehold_decisions_total{outcome="rejected",policy="api",source="lease"} 1
leasehold_decisions_total{outcome="rejected",policy="api",source="remote"} 1
# HELP leasehold_fleet_size Processes assumed to share the limit.
# TYPE leasehold_fleet_size gauge
leasehold_fleet_size{policy="api"} 2
# HELP leasehold_keys_tracked Keys held locally.
# TYPE leasehold_keys_tracked gauge
leasehold_keys_tracked{policy="api"} 1
# HELP leasehold_lease_size_tokens Tokens each lease grant brought.
# TYPE leasehold_lease_size_tokens histogram
leasehold_lease_size_tokens_bucket{policy="api",le="1"} 3
leasehold_lease_size_tokens_bucket{policy="api",le="2"} 3
leasehold_lease_size_tokens_bucket{policy="api",le="5"} 3
leasehold_lease_size_tokens_bucket{policy="api",le="10"} 3
leasehold_lease_size_tokens_bucket{policy="api",le="20"} 3
leasehold_lease_size_tokens_bucket{policy="api",le="50"} 3
leasehold_lease_size_tokens_bucket{policy="api",le="100"} 3
leasehold_lease_size_tokens_bucket{policy="api",le="200"} 3
leasehold_lease_size_tokens_bucket{policy="api",le="500"} 3
leasehold_lease_size_tokens_bucket{policy="api",le="1000"} 3
leasehold_lease_size_tokens_bucket{policy="api",le="10000"} 3
leasehold_lease_size_tokens_bucket{policy="api",le="+Inf"} 3
leasehold_lease_size_tokens_sum{policy="api"} 3
leasehold_lease_size_tokens_count{policy="api"} 3
# HELP leasehold_mode 1 for the limiter's current mode.
# TYPE leasehold_mode gauge
leasehold_mode{mode="degraded",policy="api"} 0
leasehold_mode{mode="healthy",policy="api"} 1
leasehold_mode{mode="recovering",policy="api"} 0
# HELP leasehold_policy_version Version of the policy in force.
# TYPE leasehold_policy_version gauge
leasehold_policy_version{policy="api"} 1
# HELP leasehold_store_calls_total Store round trips (a batch counts once per request in it).
# TYPE leasehold_store_calls_total counter
leasehold_store_calls_total{policy="api"} 4
`
	if err := testutil.CollectAndCompare(c, strings.NewReader(want), "leasehold_decisions_total", "leasehold_fleet_size",
		"leasehold_keys_tracked", "leasehold_lease_size_tokens", "leasehold_mode", "leasehold_policy_version",
		"leasehold_store_calls_total"); err != nil {
		t.Fatal(err)
	}
	// 10 decision series, 6 counters, 2 histograms, 5 gauges, 3 modes.
	if n := testutil.CollectAndCount(c); n != 26 {
		t.Fatalf("collected %d metrics, want 26", n)
	}
	reg := prometheus.NewPedanticRegistry()
	if err := reg.Register(c); err != nil {
		t.Fatalf("registering: %v", err)
	}
	if _, err := reg.Gather(); err != nil {
		t.Fatalf("gathering: %v", err)
	}
}

// BenchmarkAllowWithCollector: a registered collector costs the hot path
// nothing; compare the two in one run.
func BenchmarkAllowWithCollector(b *testing.B) {
	for _, with := range []bool{false, true} {
		name := "collector=no"
		if with {
			name = "collector=yes"
		}
		b.Run(name, func(b *testing.B) {
			// A key whose lease covers the whole run: the hot path.
			l := limiter(b, hybrid.Limit{Rate: 1e9, Period: time.Second, Burst: 1e12})
			if with {
				reg := prometheus.NewRegistry()
				reg.MustRegister(NewCollector(l))
			}
			ctx := context.Background()
			b.ReportAllocs()
			for i := 0; i < b.N; i++ {
				l.Allow(ctx, "k")
			}
		})
	}
}
