// Package otelmetrics exports leasehold limiters' Stats through the
// OpenTelemetry metric API: asynchronous instruments read each limiter's
// counters when the SDK collects, so the hot path does no metrics work.
// OpenTelemetry has no asynchronous histogram, so store latency is
// exported as its count and sum (the Prometheus collector in
// contrib/prommetrics has the buckets).
//
// It is its own module, so that users of hybrid alone never download the
// OpenTelemetry API.
package otelmetrics

import (
	"context"
	"errors"

	"github.com/leasehold/leasehold/hybrid"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

// Register creates leasehold's instruments on meter and observes lims on
// every collection, with a "policy" attribute. Unregister the returned
// registration to stop.
func Register(meter metric.Meter, lims ...*hybrid.Limiter) (metric.Registration, error) {
	i, err := newInstruments(meter)
	if err != nil {
		return nil, err
	}
	return meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		for _, l := range lims {
			i.observe(o, l)
		}
		return nil
	}, i.all...)
}

type instruments struct {
	decisions, storeCalls, storeErrors, tokensLeased, tokensReturned, tokensDebited, latencyCount metric.Int64ObservableCounter
	latencySum                                                                                    metric.Float64ObservableCounter
	keys, fleet, version, debt, mode                                                              metric.Int64ObservableGauge
	offset                                                                                        metric.Float64ObservableGauge
	all                                                                                           []metric.Observable
}

func newInstruments(m metric.Meter) (*instruments, error) {
	var i instruments
	var errs []error
	counter := func(name, unit, desc string) metric.Int64ObservableCounter {
		c, err := m.Int64ObservableCounter("leasehold."+name, metric.WithUnit(unit), metric.WithDescription(desc))
		errs = append(errs, err)
		i.all = append(i.all, c)
		return c
	}
	gauge := func(name, unit, desc string) metric.Int64ObservableGauge {
		g, err := m.Int64ObservableGauge("leasehold."+name, metric.WithUnit(unit), metric.WithDescription(desc))
		errs = append(errs, err)
		i.all = append(i.all, g)
		return g
	}
	i.decisions = counter("decisions", "{decision}", "Decisions by what decided them and their outcome.")
	i.storeCalls = counter("store.calls", "{call}", "Store round trips.")
	i.storeErrors = counter("store.errors", "{call}", "Store round trips that failed.")
	i.tokensLeased = counter("tokens.leased", "{token}", "Tokens put into local leases.")
	i.tokensReturned = counter("tokens.returned", "{token}", "Unspent tokens given back to the store.")
	i.tokensDebited = counter("tokens.debited", "{token}", "Outage admissions charged to the store afterwards.")
	i.latencyCount = counter("store.latency.count", "{call}", "Lease calls timed.")
	i.keys = gauge("keys", "{key}", "Keys held locally.")
	i.fleet = gauge("fleet.size", "{process}", "Processes assumed to share the limit.")
	i.version = gauge("policy.version", "1", "Version of the policy in force.")
	i.debt = gauge("outage.debt", "{token}", "Outage admissions not yet charged to the store.")
	i.mode = gauge("mode", "1", "1 for the limiter's current mode.")
	var err error
	i.latencySum, err = m.Float64ObservableCounter("leasehold.store.latency.sum", metric.WithUnit("s"),
		metric.WithDescription("Total time of the lease calls timed."))
	errs = append(errs, err)
	i.offset, err = m.Float64ObservableGauge("leasehold.clock.offset", metric.WithUnit("s"),
		metric.WithDescription("Estimated store clock minus this process's clock."))
	errs = append(errs, err)
	i.all = append(i.all, i.latencySum, i.offset)
	return &i, errors.Join(errs...)
}

var sources = []hybrid.Source{hybrid.SourceLease, hybrid.SourceRemote, hybrid.SourceDegraded, hybrid.SourceFailOpen, hybrid.SourceFailClosed}

func (i *instruments) observe(o metric.Observer, l *hybrid.Limiter) {
	s := l.Stats()
	pol := attribute.String("policy", l.Policy().Name)
	at := metric.WithAttributes(pol)
	for _, src := range sources {
		ss := s.Source(src)
		o.ObserveInt64(i.decisions, ss.Admitted, metric.WithAttributes(pol, attribute.String("source", src.String()), attribute.String("outcome", "admitted")))
		o.ObserveInt64(i.decisions, ss.Rejected, metric.WithAttributes(pol, attribute.String("source", src.String()), attribute.String("outcome", "rejected")))
	}
	o.ObserveInt64(i.storeCalls, s.StoreCalls, at)
	o.ObserveInt64(i.storeErrors, s.StoreErrors, at)
	o.ObserveInt64(i.tokensLeased, s.TokensLeased, at)
	o.ObserveInt64(i.tokensReturned, s.TokensReturned, at)
	o.ObserveInt64(i.tokensDebited, s.TokensDebited, at)
	o.ObserveInt64(i.latencyCount, int64(s.StoreLatency.Count), at)
	o.ObserveFloat64(i.latencySum, s.StoreLatency.Sum, at)
	o.ObserveInt64(i.keys, s.KeysTracked, at)
	o.ObserveInt64(i.fleet, int64(s.FleetSize), at)
	o.ObserveInt64(i.version, int64(s.PolicyVersion), at)
	o.ObserveInt64(i.debt, s.OutageDebt, at)
	o.ObserveFloat64(i.offset, s.ClockOffset.Seconds(), at)
	for _, m := range []hybrid.Mode{hybrid.ModeHealthy, hybrid.ModeDegraded, hybrid.ModeRecovering} {
		v := int64(0)
		if s.Mode == m {
			v = 1
		}
		o.ObserveInt64(i.mode, v, metric.WithAttributes(pol, attribute.String("mode", m.String())))
	}
}
