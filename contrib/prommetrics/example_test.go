package prommetrics_test

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/contrib/prommetrics"
	"github.com/leasehold/leasehold/hybrid"
	"github.com/leasehold/leasehold/remote"
	"github.com/prometheus/client_golang/prometheus"
)

// ExampleNewCollector registers a limiter's metrics and shows what a
// scrape reads after four decisions on a burst of three.
func ExampleNewCollector() {
	clk := clock.NewManual(time.Unix(1_700_000_000, 0))
	lim, err := hybrid.New(remote.NewMemory(clk), hybrid.Policy{Name: "api", Limit: hybrid.Limit{Rate: 1, Period: time.Hour, Burst: 3}},
		hybrid.WithClock(clk), hybrid.WithMaxReservation(0), hybrid.WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		panic(err)
	}
	defer lim.Close(context.Background())
	reg := prometheus.NewRegistry()
	reg.MustRegister(prommetrics.NewCollector(lim)) // in a service: prometheus.MustRegister
	for i := 0; i < 4; i++ {
		lim.Allow(context.Background(), "k")
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
