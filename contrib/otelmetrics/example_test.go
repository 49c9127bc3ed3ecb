package otelmetrics_test

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/contrib/otelmetrics"
	"github.com/leasehold/leasehold/hybrid"
	"github.com/leasehold/leasehold/remote"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
)

// ExampleRegister observes a limiter through the OpenTelemetry metric API
// (here with the SDK's manual reader; a service passes its own meter).
func ExampleRegister() {
	clk := clock.NewManual(time.Unix(1_700_000_000, 0))
	lim, err := hybrid.New(remote.NewMemory(clk), hybrid.Policy{Name: "api", Limit: hybrid.PerSecond(100)},
		hybrid.WithClock(clk), hybrid.WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		panic(err)
	}
	defer lim.Close(context.Background())
	reader := sdkmetric.NewManualReader()
	meter := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)).Meter("leasehold")
	reg, err := otelmetrics.Register(meter, lim)
	if err != nil {
		panic(err)
	}
	defer reg.Unregister()
	lim.Allow(context.Background(), "k")

	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		panic(err)
	}
	for _, m := range rm.ScopeMetrics[0].Metrics {
		if g, ok := m.Data.(metricdata.Gauge[int64]); ok && m.Name == "leasehold.keys" {
			fmt.Println(m.Name, g.DataPoints[0].Value)
		}
	}
	// Output:
	// leasehold.keys 1
}
