package faulttest

import (
	"context"
	"log/slog"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leasehold/leasehold/hybrid"
	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"github.com/leasehold/leasehold/remote"
	"github.com/redis/go-redis/v9"
)

// admitted is one admission: when it was asked (since the run began) and
// what decided it.
type admitted struct {
	at     time.Duration
	source hybrid.Source
}

// TestPartialPartitionThroughProxy: 6 limiters with capacity leases (10 s
// term) share a key of 1 000/s burst 100 on one real Redis, each at more
// than the whole limit. Two of them reach Redis through their own
// toxiproxy link; for 4 s one link refuses connections (the proxy stops)
// and the other goes silent (a timeout toxic drops every byte and keeps
// the connection open), while the other four keep Redis. A cut shorter
// than the term admits nothing over Burst + Rate·w (1% for timing), is
// decided by the grants, and the fleet uses ≥ 95% of the limit over the
// run. The same as TestCapacityLeasesPartition, over real TCP.
func TestPartialPartitionThroughProxy(t *testing.T) {
	if testing.Short() {
		t.Skip("9 s of load")
	}
	srv := redistest.NewServer(t)
	proxies := startProxies(t, srv.Addr, "refused", "silent")
	lim := hybrid.Limit{Rate: 1000, Period: time.Second, Burst: 100}
	policy := hybrid.Policy{Name: "proxy-partition", Limit: lim}
	var lims []*hybrid.Limiter
	for i := range 6 {
		addr := srv.Addr
		if i < len(proxies) {
			addr = proxies[i].Listen
		}
		c := redis.NewClient(&redis.Options{Addr: addr, ContextTimeoutEnabled: true, MaxRetries: -1})
		defer c.Close()
		l, err := hybrid.New(remote.NewRedis(c), policy, hybrid.WithCapacityLeases(10*time.Second),
			hybrid.WithLogger(slog.New(slog.DiscardHandler)))
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close(context.Background())
		lims = append(lims, l)
	}

	var stop atomic.Bool
	var mu sync.Mutex
	var all []admitted
	var wg sync.WaitGroup
	start := time.Now()
	for _, l := range lims {
		for range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				var mine []admitted
				for !stop.Load() {
					at := time.Since(start)
					if d, _ := l.AllowN(context.Background(), "k", 1); d.Allowed {
						mine = append(mine, admitted{at, d.Source})
						continue
					}
					runtime.Gosched()
				}
				mu.Lock()
				all = append(all, mine...)
				mu.Unlock()
			}()
		}
	}
	time.Sleep(5 * time.Second)
	cutAt := time.Since(start)
	proxies[0].Stop()
	silentLink(t, proxies[1], true)
	time.Sleep(4 * time.Second)
	healAt := time.Since(start)
	if err := proxies[0].Start(); err != nil {
		t.Fatal(err)
	}
	silentLink(t, proxies[1], false)
	time.Sleep(2 * time.Second)
	stop.Store(true)
	wg.Wait()
	end := time.Since(start)

	var during int64
	by := map[hybrid.Source]int64{}
	for _, a := range all {
		if a.at >= cutAt && a.at < healAt {
			during++
			by[a.source]++
		}
	}
	w := healAt - cutAt
	bound := lim.Burst + lim.TokensIn(w)
	total, totalBound := int64(len(all)), lim.Burst+lim.TokensIn(end)
	modes := make([]hybrid.Mode, len(lims))
	for i, l := range lims {
		modes[i] = l.Mode()
	}
	t.Logf("2 of 6 cut for %v (one refused, one silent): admitted %d against Burst + Rate·w = %d (%+.2f%%), by source %v; whole run %d of %d (%.1f%%); modes after the heal %v",
		w.Round(time.Millisecond), during, bound, 100*float64(during-bound)/float64(bound), by,
		total, totalBound, 100*float64(total)/float64(totalBound), modes)
	if float64(during) > 1.01*float64(bound) {
		t.Fatalf("admitted %d during the cut, over Burst + Rate·w = %d by more than 1%%", during, bound)
	}
	if by[hybrid.SourceDegraded] > 0 {
		t.Fatalf("%d decided by the degraded share: a grant should have served the cut-off limiters", by[hybrid.SourceDegraded])
	}
	// Under-use: the cut-off ones spend what their grants had; the
	// others refill at what the grants leave.
	if float64(total) < 0.95*float64(totalBound) {
		t.Fatalf("admitted %d of %d over the run: under 95%%", total, totalBound)
	}
}
