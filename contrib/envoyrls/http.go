package envoyrls

import (
	"io"
	"net/http"
	"slices"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/leasehold/leasehold/contrib/prommetrics"
	"github.com/leasehold/leasehold/hybrid"
)

// HTTPHandler serves what the reference serves over HTTP: /healthcheck
// ("OK" while serving, 503 once closed), /json (a RateLimitRequest as
// JSON in a POST, answered as the gRPC call would be, in JSON) and
// /metrics (Prometheus: the server's counters and every rule's limiter,
// labelled by policy).
func (s *Server) HTTPHandler() http.Handler {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collector{s})
	mux := http.NewServeMux()
	mux.HandleFunc("/healthcheck", func(w http.ResponseWriter, _ *http.Request) {
		if s.state.Load().closed {
			http.Error(w, "shutting down", http.StatusServiceUnavailable)
			return
		}
		_, _ = io.WriteString(w, "OK")
	})
	mux.HandleFunc("POST /json", s.serveJSON)
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	return mux
}

// serveJSON answers 200 with the response for OK, 429 for OVER_LIMIT (as
// the reference does), 400 for a request that does not parse or is
// invalid.
func (s *Server) serveJSON(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	var req rlsv3.RateLimitRequest
	if err := protojson.Unmarshal(body, &req); err != nil {
		http.Error(w, "bad request: "+err.Error(), http.StatusBadRequest)
		return
	}
	resp, err := s.ShouldRateLimit(r.Context(), &req)
	if err != nil {
		http.Error(w, status.Convert(err).Message(), http.StatusBadRequest)
		return
	}
	out, err := protojson.Marshal(resp)
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	if resp.GetOverallCode() == rlsv3.RateLimitResponse_OVER_LIMIT {
		w.WriteHeader(http.StatusTooManyRequests)
	}
	_, _ = w.Write(out)
}

// collector exports the server's counters, and its limiters' through
// prommetrics (the set in force when scraped: a reload changes it).
type collector struct{ s *Server }

var (
	requestsDesc = prometheus.NewDesc("leasehold_rls_requests_total", "ShouldRateLimit calls, by outcome.", []string{"outcome"}, nil)
	reloadsDesc  = prometheus.NewDesc("leasehold_rls_reloads_total", "Config reloads, by result.", []string{"result"}, nil)
)

func (c collector) Describe(ch chan<- *prometheus.Desc) {
	ch <- requestsDesc
	ch <- reloadsDesc
	prommetrics.NewCollector().Describe(ch)
}

func (c collector) Collect(ch chan<- prometheus.Metric) {
	st := &c.s.stats
	for _, o := range []struct {
		name string
		n    int64
	}{
		{"all", st.Requests.Load()}, {"over_limit", st.OverLimit.Load()}, {"shadow_over_limit", st.ShadowOverLimit.Load()},
		{"no_rule", st.NoRule.Load()}, {"invalid_argument", st.InvalidArgument.Load()},
	} {
		ch <- prometheus.MustNewConstMetric(requestsDesc, prometheus.CounterValue, float64(o.n), o.name)
	}
	ch <- prometheus.MustNewConstMetric(reloadsDesc, prometheus.CounterValue, float64(st.Reloads.Load()), "ok")
	ch <- prometheus.MustNewConstMetric(reloadsDesc, prometheus.CounterValue, float64(st.ReloadErrors.Load()), "error")
	lims := c.s.Limiters()
	names := slices.Sorted(func(yield func(string) bool) {
		for n := range lims {
			if !yield(n) {
				return
			}
		}
	})
	var all []*hybrid.Limiter
	for _, n := range names {
		all = append(all, lims[n])
	}
	prommetrics.NewCollector(all...).Collect(ch)
}
