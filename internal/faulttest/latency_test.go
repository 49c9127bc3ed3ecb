package faulttest

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/Shopify/toxiproxy/v2"
	"github.com/Shopify/toxiproxy/v2/collectors"
	"github.com/leasehold/leasehold/hybrid"
	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"github.com/leasehold/leasehold/remote"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"github.com/rs/zerolog"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	redistest.MainWith(m, func() error {
		// toxiproxy's in-process server keeps no goroutine once its proxy
		// is stopped, if no timeout toxic is ever removed (silentLink).
		return goleak.Find()
	})
}

// startProxies starts a toxiproxy link (in process, on a free loopback
// port) to upstream for each name, stopped when the test ends.
func startProxies(t *testing.T, upstream string, names ...string) []*toxiproxy.Proxy {
	t.Helper()
	tp := toxiproxy.NewServer(toxiproxy.NewMetricsContainer(prometheus.NewRegistry()), zerolog.Nop())
	tp.Metrics.ProxyMetrics = collectors.NewProxyMetricCollectors()
	var out []*toxiproxy.Proxy
	for _, name := range names {
		p := toxiproxy.NewProxy(tp, name, "127.0.0.1:0", upstream)
		if err := p.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Stop)
		out = append(out, p)
	}
	return out
}

// TestLatencySpikeOpensBreaker: a real TCP proxy (toxiproxy, in process)
// between the limiter and Redis adds 800 ms to every reply. Calls still
// succeed, slowly; the breaker opens on latency alone (no errors), degraded
// mode serves, and the limiter is healthy again once the latency is gone.
func TestLatencySpikeOpensBreaker(t *testing.T) {
	srv := redistest.NewServer(t)
	proxy := startProxies(t, srv.Addr, "redis")[0]

	rdb := redis.NewClient(&redis.Options{Addr: proxy.Listen, ContextTimeoutEnabled: true, MaxRetries: -1})
	defer rdb.Close()
	// A store timeout far above the spike (a new connection pays it on the
	// handshake too), so that calls succeed slowly and
	// only the breaker's 500 ms latency threshold can trip it.
	lim, err := hybrid.New(remote.NewRedis(rdb), hybrid.Policy{Name: "spike", Limit: hybrid.PerSecond(1000)},
		hybrid.WithStoreTimeout(5*time.Second), hybrid.WithFleetSize(1), hybrid.WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	defer lim.Close(context.Background())
	ctx := context.Background()
	if !lim.Allow(ctx, "warm") {
		t.Fatal("first Allow rejected")
	}

	if _, err := proxy.Toxics.AddToxicJson(strings.NewReader(
		`{"name": "spike", "type": "latency", "stream": "downstream", "attributes": {"latency": 800}}`)); err != nil {
		t.Fatal(err)
	}
	spikeAt := time.Now()
	// Several cold keys at once: each decision waits for one slow call.
	var wg sync.WaitGroup
	for i := 0; i < 4; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, _ = lim.AllowN(ctx, "cold-"+string(rune('a'+i)), 1)
		}()
	}
	wg.Wait()
	deadline := time.Now().Add(10 * time.Second)
	for lim.Mode() != hybrid.ModeDegraded {
		if time.Now().After(deadline) {
			t.Fatalf("breaker did not open under 800 ms latency: %+v", lim.Stats())
		}
		_, _ = lim.AllowN(ctx, "cold-probe", 1)
		time.Sleep(10 * time.Millisecond) // polling with a deadline
	}
	s := lim.Stats()
	t.Logf("degraded %v after the spike began; store errors %d", time.Since(spikeAt).Round(time.Millisecond), s.StoreErrors)
	if s.StoreErrors != 0 {
		t.Fatalf("%d store errors: the breaker should have opened on latency alone", s.StoreErrors)
	}
	d, err := lim.AllowN(ctx, "during", 1)
	if err != nil || d.Source != hybrid.SourceDegraded {
		t.Fatalf("decision during the spike = %+v, %v; want SourceDegraded", d, err)
	}

	if err := proxy.Toxics.RemoveToxic(ctx, "spike"); err != nil {
		t.Fatal(err)
	}
	calm := time.Now()
	deadline = time.Now().Add(10 * time.Second)
	for lim.Mode() != hybrid.ModeHealthy {
		if time.Now().After(deadline) {
			t.Fatalf("not healthy 10 s after the latency dropped: %+v", lim.Stats())
		}
		_, _ = lim.AllowN(ctx, "after", 1)
		time.Sleep(10 * time.Millisecond) // polling with a deadline
	}
	t.Logf("healthy %v after the latency dropped", time.Since(calm).Round(time.Millisecond))
	d, err = lim.AllowN(ctx, "after-2", 1)
	if err != nil || !d.Allowed || d.Source == hybrid.SourceDegraded {
		t.Fatalf("decision after recovery = %+v, %v", d, err)
	}
}
