package otelmetrics

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/hybrid"
	"github.com/leasehold/leasehold/remote"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
)

// TestRegisterOnKnownTraffic: 5 decisions on a burst of 3 show up as 3
// admitted after a store call each (a stock lease in a fleet of 2 asks at
// most Burst/4, here the one token the decision needs) and 2 rejected,
// with the gauges set.
func TestRegisterOnKnownTraffic(t *testing.T) {
	clk := clock.NewManual(time.Unix(1_700_000_000, 0))
	l, err := hybrid.New(remote.NewMemory(clk), hybrid.Policy{Name: "api", Limit: hybrid.Limit{Rate: 1, Period: time.Hour, Burst: 3}},
		hybrid.WithClock(clk), hybrid.WithFleetSize(2), hybrid.WithMaxReservation(0), hybrid.WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close(context.Background())
	for i := 0; i < 5; i++ {
		l.Allow(context.Background(), "k")
	}
	reader := sdkmetric.NewManualReader()
	provider := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	reg, err := Register(provider.Meter("leasehold"), l)
	if err != nil {
		t.Fatal(err)
	}
	defer reg.Unregister()
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	got := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			switch d := m.Data.(type) {
			case metricdata.Sum[int64]:
				for _, p := range d.DataPoints {
					src, _ := p.Attributes.Value(attribute.Key("source"))
					out, _ := p.Attributes.Value(attribute.Key("outcome"))
					got[m.Name+"/"+src.AsString()+"/"+out.AsString()] = p.Value
				}
			case metricdata.Gauge[int64]:
				for _, p := range d.DataPoints {
					mode, _ := p.Attributes.Value(attribute.Key("mode"))
					got[m.Name+"/"+mode.AsString()] = p.Value
				}
			}
		}
	}
	for k, want := range map[string]int64{
		"leasehold.decisions/remote/admitted": 3,
		"leasehold.decisions/lease/admitted":  0,
		"leasehold.decisions/lease/rejected":  1,
		"leasehold.decisions/remote/rejected": 1,
		"leasehold.store.calls//":             4,
		"leasehold.fleet.size/":               2,
		"leasehold.keys/":                     1,
		"leasehold.policy.version/":           1,
		"leasehold.mode/healthy":              1,
		"leasehold.mode/degraded":             0,
	} {
		if got[k] != want {
			t.Errorf("%s = %d, want %d (all: %v)", k, got[k], want, got)
		}
	}
}
