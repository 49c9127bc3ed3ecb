package main

import (
	"context"
	_ "embed"
	"encoding/json"
	"net/http"
	"sync"
	"time"

	"github.com/leasehold/leasehold/hybrid"
	"github.com/leasehold/leasehold/internal/testkit/storetest"
)

// second is one second of the status history.
type second struct {
	At       time.Time `json:"at"`
	Admitted int64     `json:"admitted"`
	Rejected int64     `json:"rejected"`
	Degraded int64     `json:"degraded"` // admitted by the degraded share
	Mode     string    `json:"mode"`
	Cut      bool      `json:"cut"`
}

// statusReport is GET /status.json.
type statusReport struct {
	Mode       string   `json:"mode"`
	FleetSize  int      `json:"fleet_size"`
	Limit      string   `json:"limit"`
	StoreCut   bool     `json:"store_cut"`
	StoreCalls int64    `json:"store_calls"`
	Seconds    []second `json:"seconds"`
}

// status samples the limiter's Stats once a second for the page.
type status struct {
	lim   *hybrid.Limiter
	store *storetest.Cut
	mu    struct {
		sync.Mutex
		history []second // the last 60
	}
}

func newStatus(lim *hybrid.Limiter, store *storetest.Cut) *status {
	return &status{lim: lim, store: store}
}

func (s *status) sample(ctx context.Context) {
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	prev := s.lim.Stats()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-tick.C:
			cur := s.lim.Stats()
			sec := second{At: now, Admitted: cur.Admitted - prev.Admitted, Rejected: cur.Rejected - prev.Rejected,
				Degraded: cur.Source(hybrid.SourceDegraded).Admitted - prev.Source(hybrid.SourceDegraded).Admitted,
				Mode:     cur.Mode.String(), Cut: s.store.Down.Load()}
			prev = cur
			s.mu.Lock()
			s.mu.history = append(s.mu.history, sec)
			if len(s.mu.history) > 60 {
				s.mu.history = s.mu.history[1:]
			}
			s.mu.Unlock()
		}
	}
}

// outages cuts the store off for length every period.
func (s *status) outages(ctx context.Context, every, length time.Duration) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(every - length):
		}
		s.store.Down.Store(true)
		select {
		case <-ctx.Done():
			return
		case <-time.After(length):
		}
		s.store.Down.Store(false)
	}
}

func (s *status) report() statusReport {
	st := s.lim.Stats()
	s.mu.Lock()
	hist := append([]second(nil), s.mu.history...)
	s.mu.Unlock()
	return statusReport{Mode: st.Mode.String(), FleetSize: st.FleetSize, Limit: s.lim.Policy().Limit.String() + " per tenant",
		StoreCut: s.store.Down.Load(), StoreCalls: st.StoreCalls, Seconds: hist}
}

func (s *status) serveJSON(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(s.report())
}

// toggle cuts the store off or reconnects it (POST /outage).
func (s *status) toggle(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost {
		http.Error(w, "POST to toggle the store", http.StatusMethodNotAllowed)
		return
	}
	for {
		old := s.store.Down.Load()
		if s.store.Down.CompareAndSwap(old, !old) {
			break
		}
	}
	s.serveJSON(w, r)
}

//go:embed page.html
var page []byte

func (s *status) servePage(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/" {
		http.NotFound(w, r)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	_, _ = w.Write(page)
}
