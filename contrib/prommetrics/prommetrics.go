// Package prommetrics exports leasehold limiters' Stats as Prometheus
// metrics. A Collector reads each limiter's counters when scraped, so the
// limiter's hot path does no metrics work at all.
//
// It is its own module, so that users of hybrid alone never download
// client_golang.
package prommetrics

import (
	"github.com/leasehold/leasehold/hybrid"
	"github.com/prometheus/client_golang/prometheus"
)

// Collector is a prometheus.Collector over one or more limiters, labelled
// by policy name. It is safe for concurrent use; create it with
// NewCollector and register it once.
type Collector struct {
	lims []*hybrid.Limiter
}

var _ prometheus.Collector = (*Collector)(nil)

// NewCollector returns a Collector of lims.
func NewCollector(lims ...*hybrid.Limiter) *Collector { return &Collector{lims: lims} }

func desc(name, help string, labels ...string) *prometheus.Desc {
	return prometheus.NewDesc("leasehold_"+name, help, append([]string{"policy"}, labels...), nil)
}

var (
	decisions      = desc("decisions_total", "Decisions by what decided them and their outcome.", "source", "outcome")
	storeCalls     = desc("store_calls_total", "Store round trips (a batch counts once per request in it).")
	storeErrors    = desc("store_errors_total", "Store round trips that failed.")
	storeLatency   = desc("store_latency_seconds", "Lease call round trips.")
	leaseSizes     = desc("lease_size_tokens", "Tokens each lease grant brought.")
	tokensLeased   = desc("tokens_leased_total", "Tokens put into local leases.")
	tokensReturned = desc("tokens_returned_total", "Unspent tokens given back to the store.")
	tokensDebited  = desc("tokens_debited_total", "Outage admissions charged to the store afterwards.")
	bucketsLost    = desc("buckets_lost_total", "Buckets found missing before their TTL (evicted or deleted).")
	keysTracked    = desc("keys_tracked", "Keys held locally.")
	mode           = desc("mode", "1 for the limiter's current mode.", "mode")
	fleetSize      = desc("fleet_size", "Processes assumed to share the limit.")
	policyVersion  = desc("policy_version", "Version of the policy in force.")
	clockOffset    = desc("clock_offset_seconds", "Estimated store clock minus this process's clock.")
	outageDebt     = desc("outage_debt_tokens", "Outage admissions not yet charged to the store.")
)

var all = []*prometheus.Desc{decisions, storeCalls, storeErrors, storeLatency, leaseSizes, tokensLeased, tokensReturned,
	tokensDebited, bucketsLost, keysTracked, mode, fleetSize, policyVersion, clockOffset, outageDebt}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range all {
		ch <- d
	}
}

var sources = []hybrid.Source{hybrid.SourceLease, hybrid.SourceRemote, hybrid.SourceDegraded, hybrid.SourceFailOpen, hybrid.SourceFailClosed}

// Collect implements prometheus.Collector: one Stats snapshot per limiter.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	for _, l := range c.lims {
		s, p := l.Stats(), l.Policy().Name
		for _, src := range sources {
			ss := s.Source(src)
			ch <- prometheus.MustNewConstMetric(decisions, prometheus.CounterValue, float64(ss.Admitted), p, src.String(), "admitted")
			ch <- prometheus.MustNewConstMetric(decisions, prometheus.CounterValue, float64(ss.Rejected), p, src.String(), "rejected")
		}
		counter := func(d *prometheus.Desc, v int64) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), p)
		}
		gauge := func(d *prometheus.Desc, v float64) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, p)
		}
		counter(storeCalls, s.StoreCalls)
		counter(storeErrors, s.StoreErrors)
		counter(tokensLeased, s.TokensLeased)
		counter(tokensReturned, s.TokensReturned)
		counter(tokensDebited, s.TokensDebited)
		counter(bucketsLost, s.BucketsLost)
		ch <- histogram(storeLatency, s.StoreLatency, p)
		ch <- histogram(leaseSizes, s.LeaseSizes, p)
		gauge(keysTracked, float64(s.KeysTracked))
		gauge(fleetSize, float64(s.FleetSize))
		gauge(policyVersion, float64(s.PolicyVersion))
		gauge(clockOffset, s.ClockOffset.Seconds())
		gauge(outageDebt, float64(s.OutageDebt))
		for _, m := range []hybrid.Mode{hybrid.ModeHealthy, hybrid.ModeDegraded, hybrid.ModeRecovering} {
			v := 0.0
			if s.Mode == m {
				v = 1
			}
			ch <- prometheus.MustNewConstMetric(mode, prometheus.GaugeValue, v, p, m.String())
		}
	}
}

// histogram converts a Stats histogram (per-bucket counts) to Prometheus's
// cumulative form.
func histogram(d *prometheus.Desc, h hybrid.Histogram, labels ...string) prometheus.Metric {
	buckets := make(map[float64]uint64, len(h.Bounds))
	var cum uint64
	for i, b := range h.Bounds {
		cum += h.Counts[i]
		buckets[b] = cum
	}
	return prometheus.MustNewConstHistogram(d, h.Count, h.Sum, buckets, labels...)
}
