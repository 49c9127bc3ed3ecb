package prommetrics_test

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	"github.com/leasehold/leasehold/contrib/prommetrics"
	"github.com/leasehold/leasehold/hybrid"
	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"github.com/leasehold/leasehold/remote"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
)

// ExampleNewCollector registers a limiter's metrics and shows what a
// scrape reads after four decisions on a burst of three.
func ExampleNewCollector() {
	rdb := redis.NewClient(&redis.Options{Addr: redistest.ExampleAddr(), ContextTimeoutEnabled: true})
	defer rdb.Close()
	lim, err := hybrid.New(remote.NewRedis(rdb), hybrid.Policy{Name: "api", Limit: hybrid.Limit{Rate: 1, Period: time.Hour, Burst: 3}},
		hybrid.WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		panic(err)
	}
	defer lim.Close(context.Background())
	reg := prometheus.NewRegistry()
	reg.MustRegister(prommetrics.NewCollector(lim)) // in a service: prometheus.MustRegister
	tenant := "tenant-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	for i := 0; i < 4; i++ {
		lim.Allow(context.Background(), tenant)
	}
	families, err := reg.Gather()
	if err != nil {
		panic(err)
	}
	for _, f := range families {
		if f.GetName() != "leasehold_decisions_total" {
			continue
		}
		for _, m := range f.GetMetric() {
			if v := m.GetCounter().GetValue(); v > 0 {
				labels := map[string]string{}
				for _, l := range m.GetLabel() {
					labels[l.GetName()] = l.GetValue()
				}
				fmt.Printf("%s %s %v\n", labels["source"], labels["outcome"], v)
			}
		}
	}
	// Output:
	// remote admitted 3
	// remote rejected 1
}
