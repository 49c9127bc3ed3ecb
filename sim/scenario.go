package main

import (
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"os"
	"path"
	"sort"
	"strings"
	"time"

	"github.com/leasehold/leasehold/hybrid"
)

//go:embed scenarios/*.json
var builtin embed.FS

// Scenario is one JSON file of sim/scenarios. Durations are in seconds or
// milliseconds as their names say; zero fields take the defaults noted.
type Scenario struct {
	// Name identifies the scenario in tables, plots and verdicts.
	Name string `json:"name"`
	// Description says what the scenario shows, in one or two sentences.
	Description string `json:"description"`
	// OverByDesign names the page that explains why the scenario admits
	// over the exact bound in some phase and still passes (a partition
	// without capacity leases); the verdict prints it beside the figure.
	OverByDesign string `json:"over_by_design"`
	// DurationS is the virtual length of the run.
	DurationS float64 `json:"duration_s"`
	// StepMS is the granularity of request generation (default 1 ms);
	// timers fire at their exact virtual deadlines regardless.
	StepMS float64 `json:"step_ms"`
	// Seed makes traffic and latency random but repeatable (-seed
	// overrides it).
	Seed uint64 `json:"seed"`
	// Processes is the initial fleet size.
	Processes int `json:"processes"`
	// Policy is the limit every process starts with.
	Policy PolicySpec `json:"policy"`
	// Limiter tunes hybrid.New's options.
	Limiter LimiterSpec `json:"limiter"`
	// LatencyMS models each store call's latency: uniform in
	// [base, base+jitter] milliseconds, plus any latency event.
	LatencyMS LatencySpec `json:"latency_ms"`
	// Traffic lists request sources; each applies to all processes.
	Traffic []TrafficSpec `json:"traffic"`
	// Events are the timed faults and changes.
	Events []EventSpec `json:"events"`
	// Targets are what the verdict checks.
	Targets Targets `json:"targets"`
	// Regions, if set, make a tiered world: each region's processes
	// lease through a tiered.Store from the region's own store, which
	// leases from the world's store across the region's link. Processes
	// is then their sum.
	Regions []RegionSpec `json:"regions"`
	// RegionCapacityLeaseS is, in a tiered world, the term in seconds of
	// the capacity grants each region's pools hold from the world's store
	// (tiered.WithCapacityLeases); 0: regions lease batches.
	RegionCapacityLeaseS float64 `json:"region_capacity_lease_s"`
}

// PolicySpec is a hybrid.Policy in JSON.
type PolicySpec struct {
	Name     string  `json:"name"`
	Rate     int64   `json:"rate"`
	PeriodMS float64 `json:"period_ms"`
	Burst    int64   `json:"burst"`
	// Algorithm is gcra (default) or sliding-window.
	Algorithm string `json:"algorithm"`
	// Also lists more limits every admission must fit (Policy.Also).
	Also []LimitSpec `json:"also"`
	// Tiers are named limits (Policy.Tiers); Tier is the one every key
	// starts under ("" for the policy's own), moved by "tier" events.
	Tiers map[string]LimitSpec `json:"tiers"`
	Tier  string               `json:"tier"`
}

// LimitSpec is a hybrid.Limit in JSON.
type LimitSpec struct {
	Rate     int64   `json:"rate"`
	PeriodMS float64 `json:"period_ms"`
	Burst    int64   `json:"burst"`
}

func (l LimitSpec) limit() hybrid.Limit {
	return hybrid.Limit{Rate: l.Rate, Period: ms(l.PeriodMS), Burst: l.Burst}
}

func (p PolicySpec) limit() hybrid.Limit {
	return hybrid.Limit{Rate: p.Rate, Period: ms(p.PeriodMS), Burst: p.Burst}
}

// policy is the hybrid.Policy the fleet starts with.
func (p PolicySpec) policy() hybrid.Policy {
	out := hybrid.Policy{Name: p.Name, Limit: p.limit(), Version: 1}
	if p.Algorithm == "sliding-window" {
		out.Algorithm = hybrid.SlidingWindow
	}
	for _, l := range p.Also {
		out.Also = append(out.Also, l.limit())
	}
	for name, l := range p.Tiers {
		if out.Tiers == nil {
			out.Tiers = map[string]hybrid.Tier{}
		}
		out.Tiers[name] = hybrid.Tier{Limit: l.limit()}
	}
	return out
}

// limitsOf returns the limits of tier ("" for the policy's own), first the
// one the tier is named by.
func (p PolicySpec) limitsOf(tier string) []hybrid.Limit {
	if t, ok := p.Tiers[tier]; ok && tier != "" {
		return []hybrid.Limit{t.limit()}
	}
	out := []hybrid.Limit{p.limit()}
	for _, l := range p.Also {
		out = append(out, l.limit())
	}
	return out
}

// window reports whether the policy's limits are sliding windows.
func (p PolicySpec) window() bool { return p.Algorithm == "sliding-window" }

// shaped reports whether the run audits every window of every limit: a
// sliding window, several limits, or tiers.
func (p PolicySpec) shaped() bool { return p.window() || len(p.Also) > 0 || len(p.Tiers) > 0 }

// LimiterSpec holds hybrid options; zero means the library default.
type LimiterSpec struct {
	LeaseTTLMS     float64 `json:"lease_ttl_ms"`
	StoreTimeoutMS float64 `json:"store_timeout_ms"`
	OutageMode     string  `json:"outage_mode"` // degraded (default), fail-open, fail-closed
	FleetSize      int     `json:"fleet_size"`  // 0: heartbeats
	MaxKeys        int     `json:"max_keys"`
	// CapacityLeaseS is the term of capacity leases in seconds (0: the
	// library's default, 15 s; negative: none).
	CapacityLeaseS float64 `json:"capacity_lease_s"`
}

// LatencySpec is a uniform latency distribution in milliseconds.
type LatencySpec struct {
	Base   float64 `json:"base"`
	Jitter float64 `json:"jitter"`
}

// TrafficSpec is one request source, offered by every process.
type TrafficSpec struct {
	// RatePerS is each process's offered rate (the on-rate for bursty).
	RatePerS float64 `json:"rate_per_s"`
	// Pattern is constant (default), poisson, bursty or diurnal.
	Pattern string `json:"pattern"`
	// OnS and OffS shape bursty traffic.
	OnS  float64 `json:"on_s"`
	OffS float64 `json:"off_s"`
	// Keys is how many keys the source spreads over (default 1).
	Keys int `json:"keys"`
	// KeyDist is uniform (default) or zipf.
	KeyDist string  `json:"key_dist"`
	ZipfS   float64 `json:"zipf_s"`
	// KeyPrefix names the keys (default "k").
	KeyPrefix string `json:"key_prefix"`
	// ProcessSkew in [0, 1] spreads load unevenly: process i offers
	// rate × (1 - skew/2 + skew·i/(n-1)).
	ProcessSkew float64 `json:"process_skew"`
	// FromS and UntilS bound the source in time (default: whole run).
	FromS  float64 `json:"from_s"`
	UntilS float64 `json:"until_s"`
	// Region limits the source to the processes of one region.
	Region string `json:"region"`
	// DayS and PeakS shape diurnal traffic: the rate follows a day of
	// DayS seconds, full at PeakS and a twentieth of it half a day away.
	DayS  float64 `json:"day_s"`
	PeakS float64 `json:"peak_s"`
	// Cost, if set, charges each request an estimate and settles its
	// actual cost when its work ends (see costs.go).
	Cost *CostSpec `json:"cost"`
	// InFlight, if set, limits the source's requests in flight across
	// the fleet instead of their rate (see inflight.go).
	InFlight *InFlightSpec `json:"in_flight"`
}

// rateAt is the source's per-process rate at t (seconds), before skew.
func (t TrafficSpec) rateAt(tS float64) float64 {
	if t.Pattern != "diurnal" {
		return t.RatePerS
	}
	phase := 2 * math.Pi * (tS - t.PeakS) / t.DayS
	return t.RatePerS * max(0.05, (1+math.Cos(phase))/2)
}

// EventSpec is a timed change. Kinds:
//   - outage: store calls of the affected processes fail (refused).
//   - hang: store calls time out.
//   - latency: LatencyMS is added to every store call; calls slower
//     than the refill timeout (500 ms) time out.
//   - partition: like outage, for Fraction of the fleet only.
//   - skew: process clocks read SkewMS off (alternating sign by process).
//   - policy: process 0 sets Rate/Burst (a new version).
//   - restart: processes restart one by one, EveryS apart.
//   - join / leave: Count processes join or leave.
//   - crash: Count processes (1 if unset) stop without Close: they get no
//     traffic and nothing reaches the store from them, so grants they
//     hold stay counted until their term ends. until_s marks the end of
//     the span the verdict reads as the fault (e.g. at_s + the term).
//   - tier: every key moves to tier Tier (a tenant upgraded).
//   - link: the link between Region ("" for every region) and the
//     world's store fails: a partition, or the world's store down.
type EventSpec struct {
	Region    string  `json:"region"`
	Tier      string  `json:"tier"`
	Kind      string  `json:"kind"`
	AtS       float64 `json:"at_s"`
	UntilS    float64 `json:"until_s"`
	Fraction  float64 `json:"fraction"`
	LatencyMS float64 `json:"latency_ms"`
	SkewMS    float64 `json:"skew_ms"`
	Rate      int64   `json:"rate"`
	Burst     int64   `json:"burst"`
	EveryS    float64 `json:"every_s"`
	Count     int     `json:"count"`
}

// Targets are the verdict's checks; zero-valued checks are skipped unless
// noted.
type Targets struct {
	// HealthyOverAdmissionMaxPct bounds over-admission before any fault
	// (and in phases with no fault): default 0.
	HealthyOverAdmissionMaxPct float64 `json:"healthy_over_admission_max_pct"`
	// HealthyUtilizationMinPct is the least share of the servable demand
	// admitted while healthy.
	HealthyUtilizationMinPct float64 `json:"healthy_utilization_min_pct"`
	// OutageWithinPct bounds |admitted - limit| / limit during a fault.
	OutageWithinPct float64 `json:"outage_within_pct"`
	// RecoveryMaxS bounds the time from a fault's end until every process
	// is Healthy.
	RecoveryMaxS float64 `json:"recovery_max_s"`
	// AfterOverAdmissionMaxPct bounds over-admission after a policy change
	// has settled (one lease TTL).
	AfterOverAdmissionMaxPct *float64 `json:"after_over_admission_max_pct"`
	// MaxStoreCallsPer1000 bounds store calls per 1 000 decisions while
	// healthy.
	MaxStoreCallsPer1000 float64 `json:"max_store_calls_per_1000"`
	// MaxLeaseCallsOverFloorPer1000 bounds the run's lease calls above its
	// full-bucket floor, per 1 000 decisions (see fullFloor): heartbeats
	// and policy reads, a fixed cost per process and second, are not in it.
	MaxLeaseCallsOverFloorPer1000 float64 `json:"max_lease_calls_over_floor_per_1000"`
	// MaxParentCallsPerSPerRegion bounds, in a tiered world, the calls
	// each region makes to the world's store per second.
	MaxParentCallsPerSPerRegion float64 `json:"max_parent_calls_per_s_per_region"`
	// RegionShareWithinPct bounds, for each region a link event cuts off,
	// |admitted - share| / share while cut off, where share is the
	// region's processes' part of the limit.
	RegionShareWithinPct float64 `json:"region_share_within_pct"`
	// WorldOverMaxBursts bounds, in a tiered world, the most the world's
	// admissions ever ran over Burst + Rate·t since the start, in Bursts.
	WorldOverMaxBursts *float64 `json:"world_over_max_bursts"`
	// RegionSplitWithinPts bounds, in a tiered world whose processes all
	// offer the same load, how far each region's part of the world's
	// admissions strays from its processes' part, in percentage points.
	RegionSplitWithinPts float64 `json:"region_split_within_pts"`
	// FollowLagMaxS bounds, in a tiered world with a traffic source per
	// region, how many seconds each region's admissions lag its demand.
	FollowLagMaxS float64 `json:"follow_lag_max_s"`
	// CostOverMaxEstimates bounds, for costed traffic, the most the
	// settled costs plus the estimates still running ever ran over
	// Burst + Rate·t, in estimates.
	CostOverMaxEstimates *float64 `json:"cost_over_max_estimates"`
	// CostUtilizationMinPct is, for costed traffic, the least share of
	// Rate·t the settled costs reach over the run.
	CostUtilizationMinPct float64 `json:"cost_utilization_min_pct"`
	// InFlightSpikeUtilizationMinPct is, for in-flight traffic, the least
	// mean in flight during the work spike, in percent of the limit (a
	// run never has more in flight than the limit).
	InFlightSpikeUtilizationMinPct float64 `json:"in_flight_spike_utilization_min_pct"`
	// InFlightCallsPer1000Max bounds the in-flight limiters' store calls
	// per 1 000 admitted requests before the spike.
	InFlightCallsPer1000Max float64 `json:"in_flight_calls_per_1000_max"`
	// WindowUtilizationMinPct is, for audited policies, the least share
	// of each binding limit a window of its period must admit once a whole
	// period has passed under it (see the window audit); audits always
	// require that no window admits more than its limit.
	WindowUtilizationMinPct float64 `json:"window_utilization_min_pct"`
}

func ms(f float64) time.Duration { return time.Duration(f * float64(time.Millisecond)) }
func sec(f float64) time.Duration {
	return time.Duration(f * float64(time.Second))
}

var kinds = map[string]bool{"outage": true, "hang": true, "latency": true, "partition": true, "skew": true,
	"policy": true, "restart": true, "join": true, "leave": true, "tier": true, "link": true, "crash": true}

// validate fills defaults and rejects what cannot run.
func (s *Scenario) validate() error {
	errs := s.validateRegions()
	errs = append(errs, s.validateRun()...)
	for i := range s.Traffic {
		errs = append(errs, s.Traffic[i].validate(i, s.DurationS)...)
	}
	for i := range s.Events {
		errs = append(errs, s.validateEvent(i)...)
	}
	return errors.Join(errs...)
}

func (s *Scenario) validateRun() []error {
	var errs []error
	if s.Name == "" {
		errs = append(errs, errors.New("name is empty"))
	}
	if s.DurationS <= 0 {
		errs = append(errs, errors.New("duration_s must be positive"))
	}
	if s.StepMS == 0 {
		s.StepMS = 1
	}
	if s.StepMS < 0.01 || s.StepMS > 1000 {
		errs = append(errs, fmt.Errorf("step_ms %v outside [0.01, 1000]", s.StepMS))
	}
	if s.Processes <= 0 || s.Processes > 10_000 {
		errs = append(errs, fmt.Errorf("processes %d outside [1, 10000]", s.Processes))
	}
	if s.Policy.Name == "" {
		s.Policy.Name = "sim"
	}
	switch s.Policy.Algorithm {
	case "", "gcra", "sliding-window":
	default:
		errs = append(errs, fmt.Errorf("policy.algorithm %q unknown", s.Policy.Algorithm))
	}
	if err := s.Policy.policy().Validate(); err != nil {
		errs = append(errs, fmt.Errorf("policy: %w", err))
	}
	if _, ok := s.Policy.Tiers[s.Policy.Tier]; s.Policy.Tier != "" && !ok {
		errs = append(errs, fmt.Errorf("policy.tier %q is not among policy.tiers", s.Policy.Tier))
	}
	switch s.Limiter.OutageMode {
	case "", "degraded", "fail-open", "fail-closed":
	default:
		errs = append(errs, fmt.Errorf("limiter.outage_mode %q unknown", s.Limiter.OutageMode))
	}
	if len(s.Traffic) == 0 {
		errs = append(errs, errors.New("traffic is empty"))
	}
	return errs
}

// validate fills the defaults of traffic spec i and checks it.
func (t *TrafficSpec) validate(i int, durationS float64) []error {
	if t.Keys == 0 {
		t.Keys = 1
	}
	if t.KeyPrefix == "" {
		t.KeyPrefix = "k"
	}
	if t.Pattern == "" {
		t.Pattern = "constant"
	}
	if t.UntilS == 0 {
		t.UntilS = durationS
	}
	switch {
	case t.RatePerS <= 0:
		return []error{fmt.Errorf("traffic[%d].rate_per_s must be positive", i)}
	case t.Pattern != "constant" && t.Pattern != "poisson" && t.Pattern != "bursty" && t.Pattern != "diurnal":
		return []error{fmt.Errorf("traffic[%d].pattern %q unknown", i, t.Pattern)}
	case t.Pattern == "bursty" && (t.OnS <= 0 || t.OffS <= 0):
		return []error{fmt.Errorf("traffic[%d]: bursty needs on_s and off_s", i)}
	case t.KeyDist != "" && t.KeyDist != "uniform" && t.KeyDist != "zipf":
		return []error{fmt.Errorf("traffic[%d].key_dist %q unknown", i, t.KeyDist)}
	case t.KeyDist == "zipf" && t.ZipfS <= 1:
		return []error{fmt.Errorf("traffic[%d].zipf_s must be > 1", i)}
	case t.ProcessSkew < 0 || t.ProcessSkew > 1:
		return []error{fmt.Errorf("traffic[%d].process_skew outside [0, 1]", i)}
	case t.Pattern == "diurnal" && t.DayS <= 0:
		return []error{fmt.Errorf("traffic[%d]: diurnal needs day_s", i)}
	}
	return nil
}

// validateRegions checks a tiered world and sets Processes to its sum.
func (s *Scenario) validateRegions() []error {
	if len(s.Regions) == 0 {
		for i, t := range s.Traffic {
			if t.Region != "" {
				return []error{fmt.Errorf("traffic[%d].region %q without regions", i, t.Region)}
			}
		}
		return nil
	}
	var errs []error
	names := map[string]bool{}
	s.Processes = 0
	for i, r := range s.Regions {
		if r.Name == "" || names[r.Name] {
			errs = append(errs, fmt.Errorf("regions[%d]: name %q empty or repeated", i, r.Name))
		}
		names[r.Name] = true
		if r.Processes <= 0 || r.LinkMS < 0 || r.LinkJitterMS < 0 {
			errs = append(errs, fmt.Errorf("regions[%d]: processes must be positive, link_ms and link_jitter_ms not negative", i))
		}
		s.Processes += r.Processes
	}
	for i, t := range s.Traffic {
		if t.Region != "" && !names[t.Region] {
			errs = append(errs, fmt.Errorf("traffic[%d].region %q unknown", i, t.Region))
		}
	}
	for i, e := range s.Events {
		if e.Region != "" && !names[e.Region] {
			errs = append(errs, fmt.Errorf("events[%d].region %q unknown", i, e.Region))
		}
	}
	return errs
}

func (s *Scenario) validateEvent(i int) []error {
	var errs []error
	e := &s.Events[i]
	if !kinds[e.Kind] {
		errs = append(errs, fmt.Errorf("events[%d].kind %q unknown", i, e.Kind))
	}
	if e.AtS < 0 || e.AtS > s.DurationS {
		errs = append(errs, fmt.Errorf("events[%d].at_s %v outside the run", i, e.AtS))
	}
	if e.faulty() && e.UntilS <= e.AtS {
		errs = append(errs, fmt.Errorf("events[%d]: %s needs until_s after at_s", i, e.Kind))
	}
	if e.Kind == "link" && len(s.Regions) == 0 {
		errs = append(errs, fmt.Errorf("events[%d]: link needs regions", i))
	}
	if e.Kind == "partition" && (e.Fraction <= 0 || e.Fraction > 1) {
		errs = append(errs, fmt.Errorf("events[%d]: partition needs a fraction in (0, 1]", i))
	}
	if _, ok := s.Policy.Tiers[e.Tier]; e.Kind == "tier" && !ok {
		errs = append(errs, fmt.Errorf("events[%d]: tier %q is not among policy.tiers", i, e.Tier))
	}
	if e.Kind == "policy" {
		l := s.Policy.limit()
		l.Rate, l.Burst = e.Rate, e.Burst
		if err := l.Validate(); err != nil {
			errs = append(errs, fmt.Errorf("events[%d]: %w", i, err))
		}
	}
	return errs
}

// faulty reports whether the event makes the store fail for someone.
func (e EventSpec) faulty() bool {
	switch e.Kind {
	case "outage", "hang", "latency", "partition", "link", "crash":
		return true
	}
	return false
}

func parseScenario(name string, data []byte) (*Scenario, error) {
	var s Scenario
	dec := json.NewDecoder(strings.NewReader(string(data)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&s); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	if err := s.validate(); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	return &s, nil
}

// loadFile reads one scenario file.
func loadFile(file string) (*Scenario, error) {
	data, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	return parseScenario(file, data)
}

// defaultSuite returns the built-in scenarios in file-name order.
func defaultSuite() ([]*Scenario, error) {
	names, err := fs.Glob(builtin, "scenarios/*.json")
	if err != nil {
		return nil, err
	}
	sort.Strings(names)
	var out []*Scenario
	for _, n := range names {
		data, err := builtin.ReadFile(n)
		if err != nil {
			return nil, err
		}
		s, err := parseScenario(path.Base(n), data)
		if err != nil {
			return nil, err
		}
		out = append(out, s)
	}
	return out, nil
}
