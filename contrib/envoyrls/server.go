// Package envoyrls serves Envoy's rate limit service
// (envoy.service.ratelimit.v3.RateLimitService) on leasehold limiters: the
// configuration is envoyproxy/ratelimit's YAML, unchanged, and each
// replica of the service leases tokens from Redis as any leasehold process
// does, so most requests cost no Redis round trip.
//
// Each rate_limit of the config runs on a hybrid.Limiter of its own; a
// descriptor's bucket key is its entries' keys and values. Where the
// reference uses fixed windows (N a minute lets 2N through across a
// window's edge), a rule here is a token bucket (or, as an extension, a
// sliding window) that never admits more than Burst + Rate·w in any
// window w, fleet-wide.
//
// Differences from the reference: a refused request charges none of its
// descriptors (the reference charges its OK ones anyway); Redis away means
// each replica's degraded share of the limit (WithLimiterOptions with
// hybrid.WithOutageMode for fail-open or fail-closed), not fail-open.
package envoyrls

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	core "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/leasehold/leasehold/hybrid"
	"github.com/leasehold/leasehold/remote"
)

// Request limits: a request beyond them is InvalidArgument.
const (
	MaxDescriptors = 64
	MaxValueLen    = 1024
)

// Headers selects the rate limit fields added to Envoy's response.
type Headers int

const (
	// HeadersNone adds no fields (the default).
	HeadersNone Headers = iota
	// HeadersDraft11 adds RateLimit-Policy and RateLimit
	// (draft-ietf-httpapi-ratelimit-headers-11).
	HeadersDraft11
	// HeadersLegacy adds RateLimit-Limit, RateLimit-Remaining and
	// RateLimit-Reset, as the reference does.
	HeadersLegacy
)

// Option configures a Server.
type Option func(*Server)

// WithLimiterOptions passes options to every rule's limiter (outage mode,
// prefix, store timeout, logger).
func WithLimiterOptions(opts ...hybrid.Option) Option {
	return func(s *Server) { s.limiterOpts = append(s.limiterOpts, opts...) }
}

// WithShadowMode makes every rule a shadow rule: counted, never refusing.
func WithShadowMode(on bool) Option { return func(s *Server) { s.shadow = on } }

// WithHeaders adds rate limit fields to every response [HeadersNone].
func WithHeaders(h Headers) Option { return func(s *Server) { s.headers = h } }

// WithLogger sets where reloads and their failures are logged
// [slog.Default()].
func WithLogger(l *slog.Logger) Option { return func(s *Server) { s.logger = l } }

// Server is a RateLimitServiceServer on leasehold limiters. It is safe for
// concurrent use; Reload swaps its config while it serves.
type Server struct {
	rlsv3.UnimplementedRateLimitServiceServer
	store       remote.Store
	limiterOpts []hybrid.Option
	shadow      bool
	headers     Headers
	logger      *slog.Logger

	mu    sync.Mutex // serialises Reload and Close
	state atomic.Pointer[state]
	stats Stats
}

// state is a config and the limiters of its rules.
type state struct {
	cfg      *Config
	limiters map[string]*hybrid.Limiter // by policy name
	closed   bool
}

// Stats are the server's counters.
type Stats struct {
	Requests, OverLimit, ShadowOverLimit, NoRule, InvalidArgument, Reloads, ReloadErrors atomic.Int64
}

// NewServer returns a server of cfg's rules on store.
func NewServer(store remote.Store, cfg *Config, opts ...Option) (*Server, error) {
	s := &Server{store: store, logger: slog.Default()}
	for _, o := range opts {
		o(s)
	}
	st, err := s.build(cfg, nil)
	if err != nil {
		return nil, err
	}
	s.state.Store(st)
	return s, nil
}

// build makes the limiters of cfg, taking over those of old whose policy
// is unchanged.
func (s *Server) build(cfg *Config, old *state) (*state, error) {
	st := &state{cfg: cfg, limiters: map[string]*hybrid.Limiter{}}
	for _, r := range cfg.rules() {
		if r.Unlimited || st.limiters[r.Policy.Name] != nil {
			continue
		}
		if old != nil && old.limiters[r.Policy.Name] != nil {
			st.limiters[r.Policy.Name] = old.limiters[r.Policy.Name]
			continue
		}
		lim, err := hybrid.New(s.store, r.Policy, s.limiterOpts...)
		if err != nil {
			st.close(old)
			return nil, fmt.Errorf("%w: rule %q: %w", ErrConfig, r.Name, err)
		}
		st.limiters[r.Policy.Name] = lim
	}
	return st, nil
}

// close closes st's limiters that keep is not using.
func (st *state) close(keep *state) {
	for name, lim := range st.limiters {
		if keep == nil || keep.limiters[name] != lim {
			_ = lim.Close(context.Background())
		}
	}
}

// Reload swaps in cfg: rules whose limit is unchanged keep their limiter
// and its leases; the limiters of rules gone are closed, giving their
// tokens back. On error the old config stays.
func (s *Server) Reload(cfg *Config) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	old := s.state.Load()
	if old.closed {
		return hybrid.ErrClosed
	}
	st, err := s.build(cfg, old)
	if err != nil {
		s.stats.ReloadErrors.Add(1)
		return err
	}
	s.state.Store(st)
	old.close(st)
	s.stats.Reloads.Add(1)
	return nil
}

// Config returns the config in force.
func (s *Server) Config() *Config { return s.state.Load().cfg }

// Limiters returns the limiters in force, by policy name (for metrics).
func (s *Server) Limiters() map[string]*hybrid.Limiter {
	out := map[string]*hybrid.Limiter{}
	for k, v := range s.state.Load().limiters {
		out[k] = v
	}
	return out
}

// Stats returns the server's counters.
func (s *Server) Stats() *Stats { return &s.stats }

// Close closes every limiter, giving leased tokens back. Calls after it
// are answered Unavailable.
func (s *Server) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	old := s.state.Load()
	if old.closed {
		return nil
	}
	s.state.Store(&state{cfg: old.cfg, closed: true})
	old.close(nil)
	return nil
}

// match is one descriptor of a request and what decides it.
type match struct {
	rule   *Rule
	key    string
	hits   int64
	lim    *hybrid.Limiter
	charge *hybrid.Charge
	shadow bool
	// replaced: a rule matched, and another matched rule replaces it.
	replaced bool
}

// ShouldRateLimit decides a request: OVER_LIMIT when any descriptor is
// over its limit, and then none is charged.
func (s *Server) ShouldRateLimit(ctx context.Context, req *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, error) {
	s.stats.Requests.Add(1)
	if err := validate(req); err != nil {
		s.stats.InvalidArgument.Add(1)
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	for range 2 {
		st := s.state.Load()
		if st.closed {
			return nil, status.Error(codes.Unavailable, "leasehold-rls: shutting down")
		}
		resp, err := s.decide(ctx, st, req)
		if errors.Is(err, hybrid.ErrClosed) {
			continue // a reload closed a limiter this call used: again, on the new config
		}
		return resp, err
	}
	return nil, status.Error(codes.Unavailable, "leasehold-rls: config reloading")
}

func validate(req *rlsv3.RateLimitRequest) error {
	switch {
	case req.GetDomain() == "":
		return errors.New("empty domain")
	case len(req.GetDescriptors()) == 0:
		return errors.New("no descriptors")
	case len(req.GetDescriptors()) > MaxDescriptors:
		return fmt.Errorf("%d descriptors, at most %d", len(req.GetDescriptors()), MaxDescriptors)
	}
	for i, d := range req.GetDescriptors() {
		if len(d.GetEntries()) == 0 {
			return fmt.Errorf("descriptor %d: no entries", i)
		}
		for _, e := range d.GetEntries() {
			switch {
			case e.GetKey() == "":
				return fmt.Errorf("descriptor %d: an entry with an empty key", i)
			case len(e.GetKey()) > MaxValueLen || len(e.GetValue()) > MaxValueLen:
				return fmt.Errorf("descriptor %d: key %.32q: a key or value over %d bytes", i, e.GetKey(), MaxValueLen)
			}
		}
	}
	return nil
}

func (s *Server) decide(ctx context.Context, st *state, req *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, error) {
	ms := matches(st.cfg, req)
	resp := &rlsv3.RateLimitResponse{OverallCode: rlsv3.RateLimitResponse_OK, Statuses: make([]*rlsv3.RateLimitResponse_DescriptorStatus, len(ms))}
	for i := range ms {
		stat, err := s.decideOne(ctx, st, &ms[i], len(ms) == 1)
		if err != nil {
			return nil, err
		}
		resp.Statuses[i] = stat
		if stat.Code == rlsv3.RateLimitResponse_OVER_LIMIT {
			resp.OverallCode = rlsv3.RateLimitResponse_OVER_LIMIT
		}
	}
	if resp.OverallCode == rlsv3.RateLimitResponse_OVER_LIMIT {
		s.stats.OverLimit.Add(1)
		// A refused request charges nothing: what the others took goes
		// back.
		for i := range ms {
			if c := ms[i].charge; c != nil && c.Allowed {
				_ = c.Settle(0)
			}
		}
	}
	s.addHeaders(resp, ms)
	return resp, nil
}

// matches finds each descriptor's rule, bucket key and hits; a rule that
// another matched rule replaces is dropped from its match.
func matches(cfg *Config, req *rlsv3.RateLimitRequest) []match {
	hits := int64(req.GetHitsAddend())
	if hits == 0 {
		hits = 1
	}
	ms := make([]match, len(req.GetDescriptors()))
	var replaced map[string]bool
	for i, d := range req.GetDescriptors() {
		entries := make([]Entry, len(d.GetEntries()))
		for j, e := range d.GetEntries() {
			entries[j] = Entry{e.GetKey(), e.GetValue()}
		}
		m := &ms[i]
		m.rule, m.key = cfg.Match(req.GetDomain(), entries)
		m.hits = hits
		if h := d.GetHitsAddend(); h != nil {
			m.hits = int64(min(h.GetValue(), 1<<62))
		}
		if m.rule != nil && len(m.rule.Replaces) > 0 {
			if replaced == nil {
				replaced = map[string]bool{}
			}
			for _, name := range m.rule.Replaces {
				replaced[name] = true
			}
		}
	}
	for i := range ms {
		if r := ms[i].rule; r != nil && r.named && replaced[r.Name] {
			ms[i].rule, ms[i].replaced = nil, true
		}
	}
	return ms
}

// decideOne decides one descriptor and returns its status: OK with no
// limit for no rule (or a replaced or unlimited one), OVER_LIMIT when
// refused outside shadow mode.
func (s *Server) decideOne(ctx context.Context, st *state, m *match, alone bool) (*rlsv3.RateLimitResponse_DescriptorStatus, error) {
	stat := &rlsv3.RateLimitResponse_DescriptorStatus{Code: rlsv3.RateLimitResponse_OK}
	switch {
	case m.rule == nil:
		if !m.replaced {
			s.stats.NoRule.Add(1)
		}
		return stat, nil
	case m.rule.Unlimited:
		return stat, nil
	}
	stat.CurrentLimit = m.rule.current
	m.lim = st.limiters[m.rule.Policy.Name]
	m.shadow = s.shadow || m.rule.Shadow
	d, err := s.charge(ctx, m, alone)
	if err != nil {
		return nil, err
	}
	stat.LimitRemaining = uint32(min(max(d.Remaining, 0), 1<<32-1))
	if d.Allowed {
		stat.DurationUntilReset = durationpb.New(d.ResetAfter)
		return stat, nil
	}
	stat.DurationUntilReset = durationpb.New(d.RetryAfter)
	if m.shadow {
		s.stats.ShadowOverLimit.Add(1)
		return stat, nil
	}
	stat.Code = rlsv3.RateLimitResponse_OVER_LIMIT
	return stat, nil
}

// charge decides m's hits; 0 hits only checks (a hit taken and given
// back). A hit count over the rule's burst can never pass: OVER_LIMIT.
// alone says m is the request's only descriptor: nothing could make it
// give its hits back.
func (s *Server) charge(ctx context.Context, m *match, alone bool) (hybrid.Decision, error) {
	n := m.hits
	check := n == 0
	if check {
		n = 1
	}
	if alone && !check {
		d, err := m.lim.AllowN(ctx, m.key, n)
		if err != nil {
			return s.misuse(m, err)
		}
		return d, nil
	}
	c, err := m.lim.ChargeN(ctx, m.key, n)
	if err != nil {
		return s.misuse(m, err)
	}
	switch {
	case check:
		_ = c.Settle(0)
	default:
		m.charge = c
	}
	return c.Decision, nil
}

// misuse turns a decision's error into its answer: a hit count over the
// rule's burst can never pass (OVER_LIMIT); a closed limiter is retried on
// the config in force.
func (*Server) misuse(m *match, err error) (hybrid.Decision, error) {
	switch {
	case errors.Is(err, hybrid.ErrExceedsBurst):
		p := m.lim.Policy()
		return hybrid.Decision{Limit: p.Limit, RetryAfter: p.Limit.Period}, nil
	case errors.Is(err, hybrid.ErrClosed):
		return hybrid.Decision{}, err
	}
	return hybrid.Decision{}, status.Error(codes.InvalidArgument, err.Error())
}

func unitOf(u string) rlsv3.RateLimitResponse_RateLimit_Unit {
	return rlsv3.RateLimitResponse_RateLimit_Unit(rlsv3.RateLimitResponse_RateLimit_Unit_value[strings.ToUpper(u)])
}

// addHeaders adds the fields of the descriptor with the least remaining.
func (s *Server) addHeaders(resp *rlsv3.RateLimitResponse, ms []match) {
	if s.headers == HeadersNone {
		return
	}
	best := -1
	for i, st := range resp.Statuses {
		if st.CurrentLimit == nil || ms[i].lim == nil {
			continue
		}
		if best < 0 || st.LimitRemaining < resp.Statuses[best].LimitRemaining {
			best = i
		}
	}
	if best < 0 {
		return
	}
	st, r := resp.Statuses[best], ms[best].rule
	window := units[strings.ToLower(r.Unit)]
	reset := strconv.FormatInt(int64((st.DurationUntilReset.AsDuration()+time.Second-1)/time.Second), 10)
	add := func(k, v string) {
		resp.ResponseHeadersToAdd = append(resp.ResponseHeadersToAdd, &core.HeaderValue{Key: k, Value: v})
	}
	switch s.headers {
	case HeadersDraft11:
		add("RateLimit-Policy", fmt.Sprintf("%q;q=%d;w=%d", r.Name, r.RequestsPerUnit, int64(window/time.Second)))
		add("RateLimit", fmt.Sprintf("%q;r=%d;t=%s", r.Name, st.LimitRemaining, reset))
	case HeadersLegacy:
		add("RateLimit-Limit", fmt.Sprintf("%d, %d;w=%d", r.RequestsPerUnit, r.RequestsPerUnit, int64(window/time.Second)))
		add("RateLimit-Remaining", strconv.FormatUint(uint64(st.LimitRemaining), 10))
		add("RateLimit-Reset", reset)
	}
}
