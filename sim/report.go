package main

import (
	"fmt"
	"io"
	"math"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/leasehold/leasehold/hybrid"
	"github.com/leasehold/leasehold/remote"
)

// phase is a stretch of the run judged on its own: healthy (before any
// fault), outage (while a fault lasts), recovery (the 2 s after it),
// after (the rest); or, for a policy change, healthy / change (one lease
// TTL) / after.
type phase struct {
	name     string
	from, to time.Duration
	limit    hybrid.Limit
	held     int64 // tokens the fleet held when the phase began

	offered, admitted, decisions, storeCalls, errors int64
	idle                                             int64 // decisions at the idle floor (see recorder.seen)
	capCalls                                         int64 // calls at the 10% lease floor (see recorder.spare)
	fullCalls                                        int64 // admissions at the full-bucket floor, beyond idle (see fullFloor)
	perKeyOffered, perKeyAdmitted                    map[string]int64
	latencies                                        []time.Duration // non-zero decision latencies
	zeroLatency                                      int64
}

// recorder collects a run's numbers.
type recorder struct {
	sc     *Scenario
	w      *world
	phases []*phase
	cur    int

	perSecond [][]int64 // [second][process id] admitted
	offeredS  []int64   // [second] offered, all processes
	limitS    []float64 // [second] the limit per second in force (single-key scenarios)
	faults    [][2]time.Duration
	// starve counts, per 100 ms, admissions and what was servable then
	// (each key's offer capped at its rate), for the verdict's note on
	// stretches the fleet admitted less than half of it.
	starve starveBins

	faultEnd     time.Duration
	recoveredAt  time.Duration // -1 until every process is Healthy after the fault
	singleKey    bool
	logY         bool // the plot's y axis is logarithmic (set by writePlots)
	policyChange time.Duration

	// For audited policies (single key): every admission's time, and the
	// spans of constant limits the audit checks them against.
	admits []time.Duration
	spans  []auditSpan

	// A tiered world's regions, and every admission's time.
	regions     []regionStats
	worldAdmits []time.Duration

	// calls counts the run's store calls by kind, leasesAtLimit the lease
	// calls of them on keys at their limit (see leaseAnswered).
	calls         [numCallKinds]int64
	leasesAtLimit int64

	// seen is when each process last decided on each key: a decision on a
	// key its process had not decided for Burst/Rate is at the idle floor.
	seen map[procKey]time.Duration
	// spare is, per process and key, what a limiter whose leases hold at
	// most 10% of Burst could still hold: the 10% lease floor counts an
	// admission made from the store's tokens (not by a degraded share or
	// a grant) as a store call unless such a token, or a call made within
	// joinWindow before, pays for it (see spareCall).
	spare map[procKey]spareTokens
	// full counts the full-bucket floor; nil where it is not counted.
	full *fullFloor

	// Costed traffic: every change of the charged cost, and the charges
	// running now and at most.
	costs []costEvent
	// In-flight traffic: the audit, and the requests in flight now.
	slots               slotAudit
	slotsNow            int64
	running, maxRunning int
}

// spareTokens is what the 10% lease floor's limiter holds for a key.
type spareTokens struct {
	left        int64
	until, join time.Duration
}

// joinWindow is how long after a store call a decision on the same key
// rides on it for free in the 10% lease floor: above the simulated
// store's latency, so the floor stays a lower bound.
const joinWindow = 5 * time.Millisecond

// spareCall reports whether admitting n on pk at now needs a store call
// in the 10% lease floor: with every advantage to the limiter, a call
// takes the whole 10% of Burst besides n, and may spend it for a lease
// TTL and half a TTL more (the default's longest future-dated grant).
func (r *recorder) spareCall(pk procKey, now time.Duration, n int64, lim hybrid.Limit) bool {
	s := r.spare[pk]
	switch {
	case now < s.join:
		return false
	case s.left >= n && now < s.until:
		s.left -= n
		r.spare[pk] = s
		return false
	}
	r.spare[pk] = spareTokens{left: max(1, lim.Burst/10), until: now + r.w.leaseTTL()*3/2, join: now + joinWindow}
	return true
}

// procKey is one process's view of one key.
type procKey struct {
	proc int
	key  string
}

// auditSpan is a stretch of the run under one set of limits.
type auditSpan struct {
	from, to time.Duration
	limits   []hybrid.Limit
}

func newRecorder(sc *Scenario, w *world) *recorder {
	r := &recorder{sc: sc, w: w, recoveredAt: -1, policyChange: -1, seen: map[procKey]time.Duration{}, spare: map[procKey]spareTokens{}}
	keys := map[string]bool{}
	for _, t := range sc.Traffic {
		for k := 0; k < t.Keys; k++ {
			keys[t.KeyPrefix+fmt.Sprint(k)] = true
		}
	}
	r.singleKey = len(keys) == 1
	if !sc.Policy.shaped() && len(sc.Regions) == 0 {
		r.full = newFullFloor()
	}
	r.addPhases(w.leaseTTL())
	secs := int(math.Ceil(sc.DurationS))
	r.perSecond = make([][]int64, secs)
	r.offeredS = make([]int64, secs)
	r.limitS = make([]float64, secs)
	limits := sc.Policy.limitsOf(sc.Policy.Tier)
	for i := range r.limitS {
		r.limitS[i] = sustained(limits)
	}
	if sc.Policy.shaped() && r.singleKey {
		r.spans = []auditSpan{{from: 0, to: sec(sc.DurationS), limits: limits}}
	}
	r.starve.setLimits(limits, sc.Policy.window())
	for _, t := range sc.Traffic {
		r.starve.off = r.starve.off || t.Cost != nil
	}
	return r
}

// sustained is the tightest long-run rate of limits, per second.
func sustained(limits []hybrid.Limit) float64 {
	out := math.Inf(1)
	for _, l := range limits {
		out = math.Min(out, perSecond(l))
	}
	return out
}

// tierChanged records that every key moved to tier at at: the plot's
// limit follows, and the audit judges the old tier's span up to the move
// and the new tier's from one lease TTL after it.
func (r *recorder) tierChanged(at time.Duration, tier string) {
	limits := r.sc.Policy.limitsOf(tier)
	r.starve.setLimits(limits, r.sc.Policy.window())
	for s := int(at / time.Second); s < len(r.limitS); s++ {
		r.limitS[s] = sustained(limits)
	}
	if n := len(r.spans); n > 0 {
		end := r.spans[n-1].to
		r.spans[n-1].to = at
		r.spans = append(r.spans, auditSpan{from: min(at+r.w.leaseTTL(), end), to: end, limits: limits})
	}
}

// addPhases splits the run into phases: healthy / outage / recovery /
// after around the store faults, or healthy / change / after around the
// first policy change.
func (r *recorder) addPhases(ttl time.Duration) {
	sc := r.sc
	total := sec(sc.DurationS)
	lim := sc.Policy.limit()
	fs, fe := time.Duration(-1), time.Duration(-1)
	for _, e := range sc.Events {
		if e.faulty() {
			r.faults = append(r.faults, [2]time.Duration{sec(e.AtS), sec(e.UntilS)})
			if fs < 0 || sec(e.AtS) < fs {
				fs = sec(e.AtS)
			}
			fe = max(fe, sec(e.UntilS))
		}
	}
	if fs >= 0 {
		r.faultEnd = fe
		r.addPhase("healthy", 0, fs, lim)
		r.addPhase("outage", fs, fe, lim)
		r.addPhase("recovery", fe, min(fe+2*time.Second, total), lim)
		r.addPhase("after", min(fe+2*time.Second, total), total, lim)
		return
	}
	lim = sc.Policy.limitsOf(sc.Policy.Tier)[0]
	for _, e := range sc.Events {
		if e.Kind == "policy" || e.Kind == "tier" {
			at := sec(e.AtS)
			next := lim
			next.Rate, next.Burst = e.Rate, e.Burst
			if e.Kind == "tier" {
				next = sc.Policy.limitsOf(e.Tier)[0]
			}
			r.addPhase("healthy", 0, at, lim)
			r.addPhase("change", at, min(at+ttl, total), next)
			r.addPhase("after", min(at+ttl, total), total, next)
			return
		}
	}
	r.addPhase("healthy", 0, total, lim)
}

func (r *recorder) addPhase(name string, from, to time.Duration, l hybrid.Limit) {
	if to > from {
		r.phases = append(r.phases, &phase{name: name, from: from, to: to, limit: l,
			perKeyOffered: map[string]int64{}, perKeyAdmitted: map[string]int64{}})
	}
}

func perSecond(l hybrid.Limit) float64 { return float64(l.Rate) / l.Period.Seconds() }

func (r *recorder) phaseAt(t time.Duration) *phase {
	for r.cur < len(r.phases)-1 && t >= r.phases[r.cur].to {
		r.cur++
	}
	return r.phases[r.cur]
}

// beginStep notes, at each phase's first step, what the fleet holds.
func (r *recorder) beginStep(now time.Duration) {
	p := r.phaseAt(now)
	if now == p.from && p.from > 0 {
		for _, pr := range r.w.alive() {
			p.held += pr.lim.Stats().TokensHeld
		}
	}
}

// endStep watches for the fleet's recovery after the last fault.
func (r *recorder) endStep(now time.Duration) {
	if r.faultEnd > 0 && now >= r.faultEnd && r.recoveredAt < 0 {
		for _, p := range r.w.alive() {
			if p.lim.Mode() != hybrid.ModeHealthy {
				return
			}
		}
		r.recoveredAt = now
	}
}

func (r *recorder) policyChanged(at time.Duration, l hybrid.Limit) {
	r.policyChange = at
	r.starve.setLimits([]hybrid.Limit{l}, r.sc.Policy.window())
	for s := int(at / time.Second); s < len(r.limitS); s++ {
		r.limitS[s] = perSecond(l)
	}
}

func (r *recorder) storeCall(kind callKind) {
	r.phases[r.cur].storeCalls++
	r.calls[kind]++
}

// callKind is what a store call was for, in the breakdown under each
// scenario's table.
type callKind int

const (
	callLease callKind = iota
	callReturn
	callDebit
	callGrant  // capacity grants: grant, renewal, ungrant
	callFleet  // heartbeats and leaves
	callPolicy // policy reads and writes
	numCallKinds
)

// kindOf is the kind of a batch of op.
func kindOf(op remote.Op) callKind {
	switch op {
	case remote.OpReturn:
		return callReturn
	case remote.OpDebit:
		return callDebit
	}
	return callLease
}

// leaseAnswered counts a lease call for r answered with res on a key at
// its limit: refused or future-dated, or leaving the bucket less than a
// tenth of Burst (the largest lease below the limit).
func (r *recorder) leaseAnswered(req *remote.Request, res *remote.Result) {
	if res.Granted == 0 || res.Delay > 0 || res.Remaining < max(req.Limit.Burst/10, 1) {
		r.leasesAtLimit++
	}
}

// decision records one decision of n tokens (n > 1 for costed traffic,
// its estimate).
func (r *recorder) decision(now time.Duration, proc int, key string, n int64, d hybrid.Decision, err error, lat time.Duration) {
	p := r.phaseAt(now)
	s := min(int(now/time.Second), len(r.perSecond)-1)
	p.offered += n
	p.perKeyOffered[key] += n
	r.offeredS[s] += n
	r.starve.offer(now, key, n)
	if err != nil {
		p.errors++
		return
	}
	p.decisions++
	// By Burst/Rate after a process's last decision on a key the bucket
	// has refilled whatever it granted, so no lease that keeps the bound in
	// every window can still hold a token for it: the decision needs a
	// store call whatever the limiter (under the phase's limit).
	pk := procKey{proc, key}
	if last, ok := r.seen[pk]; !ok || now-last >= p.limit.DurationFor(p.limit.Burst) {
		p.idle++
	} else if d.Allowed && r.full != nil && r.full.needsCall(key, p.limit, last, now) {
		p.fullCalls++
	}
	r.seen[pk] = now
	if d.Allowed && (d.Source == hybrid.SourceLease || d.Source == hybrid.SourceRemote) && r.spareCall(pk, now, n, p.limit) {
		p.capCalls++
	}
	r.regionDecision(now, r.w.procs[proc].region, d.Allowed)
	if lat > 0 {
		p.latencies = append(p.latencies, lat)
	} else {
		p.zeroLatency++
	}
	if !d.Allowed {
		return
	}
	if r.spans != nil {
		r.admits = append(r.admits, now)
	}
	p.admitted += n
	p.perKeyAdmitted[key] += n
	r.starve.admit(now, n)
	if r.full != nil {
		r.full.admit(key, p.limit, n, now)
	}
	for len(r.perSecond[s]) <= proc {
		r.perSecond[s] = append(r.perSecond[s], 0)
	}
	r.perSecond[s][proc] += n
}

// bound returns the phase's exact bound summed over the keys that saw
// demand, the servable demand (each key's offered, capped at its bound)
// and the over-admission beyond the bound and the tokens held at the
// phase's start.
func (p *phase) bound() (bound, servable, over int64) {
	w := p.to - p.from
	per := p.limit.Burst + p.limit.TokensIn(w)
	var excess int64
	for k, off := range p.perKeyOffered {
		bound += per
		servable += min(off, per)
		excess += max(p.perKeyAdmitted[k]-per, 0)
	}
	return bound, servable, max(excess-p.held, 0)
}

// limitFor is the plain limit over the phase, Rate·w per key with demand,
// without Burst: what an outage should admit.
func (p *phase) limitFor() int64 {
	var n int64
	for k, off := range p.perKeyOffered {
		_ = k
		n += min(off, p.limit.TokensIn(p.to-p.from))
	}
	return n
}

func (p *phase) percentile(q float64) time.Duration {
	n := int64(len(p.latencies)) + p.zeroLatency
	if n == 0 {
		return 0
	}
	idx := int64(math.Ceil(q*float64(n))) - 1
	if idx < p.zeroLatency {
		return 0
	}
	sort.Slice(p.latencies, func(i, j int) bool { return p.latencies[i] < p.latencies[j] })
	return p.latencies[min(idx-p.zeroLatency, int64(len(p.latencies))-1)]
}

func pct(a, b int64) float64 {
	if b == 0 {
		return 0
	}
	return 100 * float64(a) / float64(b)
}

// table writes one row per phase.
func (r *recorder) table(out io.Writer) {
	keys := "keys"
	if r.keysWithDemand() == 1 {
		keys = "key"
	}
	fmt.Fprintf(out, "limit: %s per key; %d %s with demand\n", r.limitText(), r.keysWithDemand(), keys)
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "phase\tvirtual s\toffered\tadmitted\tservable\tover-admission %\tutilization %\tstore calls/1000\twait p50\twait p99\t")
	for _, p := range r.phases {
		bound, servable, over := p.bound()
		fmt.Fprintf(tw, "%s\t%.1f–%.1f\t%d\t%d\t%d\t%.2f\t%.1f\t%.1f\t%v\t%v\t\n",
			p.name, p.from.Seconds(), p.to.Seconds(), p.offered, p.admitted, servable, pct(over, bound),
			pct(p.admitted, servable), 1000*float64(p.storeCalls)/math.Max(1, float64(p.decisions)),
			p.percentile(0.5).Round(time.Microsecond), p.percentile(0.99).Round(time.Microsecond))
	}
	_ = tw.Flush()
	var idle, capCalls, fullCalls, decisions int64
	for _, p := range r.phases {
		idle, capCalls, decisions = idle+p.idle, capCalls+p.capCalls, decisions+p.decisions
		fullCalls += p.fullCalls
	}
	per1k := func(n int64) float64 { return 1000 * float64(n) / math.Max(1, float64(decisions)) }
	fmt.Fprintf(out, "idle floor: %.1f store calls/1000; 10%% lease floor: %.1f", per1k(idle), per1k(capCalls))
	if r.full != nil {
		fmt.Fprintf(out, "; full-bucket floor: %.1f", per1k(idle+fullCalls))
	}
	fmt.Fprintln(out)
	c := &r.calls
	fmt.Fprintf(out, "store calls/1000 by kind: leases %.1f (on keys at their limit %.1f), returns %.1f, debits %.1f, grants %.1f, fleet %.1f, policy %.1f\n",
		per1k(c[callLease]), per1k(r.leasesAtLimit), per1k(c[callReturn]), per1k(c[callDebit]), per1k(c[callGrant]), per1k(c[callFleet]), per1k(c[callPolicy]))
	fmt.Fprintln(out, tableLegend)
	if r.full != nil {
		fmt.Fprintln(out, fullFloorLegend)
	}
}

// limitText is the scenario's limits at the start, as the policy states
// them ("10/1s burst 10 and 1000/1h0m0s burst 1000, sliding window").
func (r *recorder) limitText() string {
	var parts []string
	for _, l := range r.sc.Policy.limitsOf(r.sc.Policy.Tier) {
		parts = append(parts, l.String())
	}
	s := strings.Join(parts, " and ")
	if r.sc.Policy.window() {
		s += ", sliding window"
	}
	return s
}

// keysWithDemand counts the keys offered any request.
func (r *recorder) keysWithDemand() int {
	keys := map[string]bool{}
	for _, p := range r.phases {
		for k := range p.perKeyOffered {
			keys[k] = true
		}
	}
	return len(keys)
}

// leaseCallsOverFloor is the run's lease calls above its full-bucket
// floor per 1 000 decisions; false where the floor is not counted.
func (r *recorder) leaseCallsOverFloor() (float64, bool) {
	if r.full == nil {
		return 0, false
	}
	var floor, decisions int64
	for _, p := range r.phases {
		floor, decisions = floor+p.idle+p.fullCalls, decisions+p.decisions
	}
	return 1000 * float64(r.calls[callLease]-floor) / math.Max(1, float64(decisions)), true
}

// fullFloorLegend says what the full-bucket floor counts (see fullFloor).
const fullFloorLegend = `full-bucket floor: the idle floor plus admissions on a key whose bucket, fed only the run's admissions, stayed full for a token's refill since the process's last decision on it: calls any limiter needs that keeps the bound in every window and takes no token it does not admit.`

// tableLegend says what the phase table's columns measure.
const tableLegend = `servable: each key's offered demand capped at its exact bound Burst + Rate·w over the phase, summed over keys;
utilization = admitted / servable; over-admission = admissions beyond each key's own bound, as a share of the bounds;
wait: virtual time a decision waited for the store (0 when a lease or a cached refusal answered it);
idle floor: decisions on a key its process had not decided for Burst/Rate, which need a store call whatever the limiter;
10% lease floor: the fewest calls for the same admissions from leases by a limiter whose lease holds at most 10% of Burst, as a stock lease below the limit does, for 1.5 lease TTLs;
by kind: a batch is one call; a lease on a key at its limit was refused or future-dated, or left the bucket less than 10% of Burst.`

// verdict checks the targets; it returns the misses.
func (r *recorder) verdict() []string {
	t := r.sc.Targets
	var miss []string
	if over, ok := r.leaseCallsOverFloor(); ok && t.MaxLeaseCallsOverFloorPer1000 > 0 && over > t.MaxLeaseCallsOverFloorPer1000 {
		miss = append(miss, fmt.Sprintf("%.1f lease calls per 1000 decisions above the full-bucket floor > %.1f", over, t.MaxLeaseCallsOverFloorPer1000))
	}
	for _, p := range r.phases {
		bound, servable, over := p.bound()
		switch p.name {
		case "healthy":
			if o := pct(over, bound); o > t.HealthyOverAdmissionMaxPct {
				miss = append(miss, fmt.Sprintf("%s over-admission %.2f%% > %.2f%%", p.name, o, t.HealthyOverAdmissionMaxPct))
			}
			if u := pct(p.admitted, servable); t.HealthyUtilizationMinPct > 0 && u < t.HealthyUtilizationMinPct {
				miss = append(miss, fmt.Sprintf("%s utilization %.1f%% < %.1f%%", p.name, u, t.HealthyUtilizationMinPct))
			}
			if t.MaxStoreCallsPer1000 > 0 {
				if c := 1000 * float64(p.storeCalls) / math.Max(1, float64(p.decisions)); c > t.MaxStoreCallsPer1000 {
					miss = append(miss, fmt.Sprintf("%s %.1f store calls per 1000 decisions > %.1f", p.name, c, t.MaxStoreCallsPer1000))
				}
			}
		case "outage":
			if t.OutageWithinPct > 0 {
				lim := p.limitFor()
				if d := math.Abs(float64(p.admitted-lim)) / float64(max(lim, 1)) * 100; d > t.OutageWithinPct {
					miss = append(miss, fmt.Sprintf("outage admitted %d vs limit %d: %.1f%% off > %.1f%%", p.admitted, lim, d, t.OutageWithinPct))
				}
			}
		case "after":
			if t.AfterOverAdmissionMaxPct != nil {
				if o := pct(over, bound); o > *t.AfterOverAdmissionMaxPct {
					miss = append(miss, fmt.Sprintf("after over-admission %.2f%% > %.2f%%", o, *t.AfterOverAdmissionMaxPct))
				}
			}
		}
		if p.errors > 0 {
			miss = append(miss, fmt.Sprintf("%s: %d decisions returned errors", p.name, p.errors))
		}
	}
	miss = append(miss, r.auditMisses()...)
	miss = append(miss, r.regionMisses()...)
	miss = append(miss, r.costMisses()...)
	miss = append(miss, r.slotMisses()...)
	if t.RecoveryMaxS > 0 && r.faultEnd > 0 {
		switch {
		case r.recoveredAt < 0:
			miss = append(miss, "never recovered to Healthy")
		case (r.recoveredAt - r.faultEnd).Seconds() > t.RecoveryMaxS:
			miss = append(miss, fmt.Sprintf("recovered in %.2f s > %.2f s", (r.recoveredAt-r.faultEnd).Seconds(), t.RecoveryMaxS))
		}
	}
	return miss
}

// summary is the one-line verdict.
func (r *recorder) summary() string {
	miss := r.verdict()
	extra := ""
	if r.faultEnd > 0 && r.recoveredAt >= 0 {
		extra = fmt.Sprintf(" (healthy %.2f s after the fault)", (r.recoveredAt - r.faultEnd).Seconds())
	}
	var over []string
	for _, p := range r.phases {
		bound, _, o := p.bound()
		if o > 0 {
			over = append(over, fmt.Sprintf("%s %.2f%% over Burst + Rate·w", p.name, pct(o, bound)))
		}
	}
	if len(over) > 0 {
		see := r.sc.OverByDesign
		if see == "" {
			see = "the scenario's description"
		}
		extra += "; over by design: " + strings.Join(over, ", ") + ": see " + see
	}
	if low := r.starve.starved(); len(low) > 0 {
		extra += "; under half of an exact limiter: " + strings.Join(low, ", ")
	}
	if len(miss) == 0 {
		return fmt.Sprintf("PASS %s%s", r.sc.Name, extra)
	}
	return fmt.Sprintf("MISS %s%s: %s", r.sc.Name, extra, strings.Join(miss, "; "))
}

// auditStep is how often the audit ends a window: every 100 ms.
const auditStep = 100 * time.Millisecond

// limitAudit is one limit's windows in one span: the most any window
// admitted against what the limit allows, and the least a whole window
// admitted once a full period had passed in the span (-1: none did),
// judged against the limit's Rate (what a period yields at the limit).
type limitAudit struct {
	span        int
	limit       hybrid.Limit
	allowed     int64
	windows     int
	most, least int64
	fullWindows int
}

// audit checks every window of every limit of each span, ending at
// 100 ms steps: admissions in (t - Period, t], counted from the span's
// start, against Rate for a sliding window and Burst + Rate for a token
// bucket.
func (r *recorder) audit() []limitAudit {
	var out []limitAudit
	for si, sp := range r.spans {
		for _, l := range sp.limits {
			a := limitAudit{span: si, limit: l, allowed: l.Burst + l.Rate, least: -1}
			if r.sc.Policy.window() {
				a.allowed = l.Rate
			}
			for t := sp.from + auditStep; t <= sp.to; t += auditStep {
				from := max(t-l.Period, sp.from)
				n := int64(sort.Search(len(r.admits), func(i int) bool { return r.admits[i] > t }) -
					sort.Search(len(r.admits), func(i int) bool { return r.admits[i] > from }))
				a.windows++
				a.most = max(a.most, n)
				if t-l.Period >= sp.from {
					a.fullWindows++
					if a.least < 0 || n < a.least {
						a.least = n
					}
				}
			}
			out = append(out, a)
		}
	}
	return out
}

// auditTable prints the window audit of an audited policy.
func (r *recorder) auditTable(out io.Writer) {
	if len(r.spans) == 0 {
		return
	}
	fmt.Fprintln(out, "\nwindow audit (every window ending at 100 ms steps):")
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "span\tlimit\twindows\tmost admitted\tallowed\tleast in a full window\t")
	audits := r.audit()
	binding := bindingLimits(audits)
	for _, a := range audits {
		sp := r.spans[a.span]
		least := "- (no full window in the span)"
		if a.least >= 0 {
			least = fmt.Sprintf("%d (%.1f%% of %d)", a.least, pct(a.least, a.limit.Rate), a.limit.Rate)
			if b, ok := binding[a.span]; ok && b != a.limit {
				// Several limits: the least full window of one that does
				// not bind says nothing of utilization.
				least += fmt.Sprintf("; %v binds", b)
			}
		}
		fmt.Fprintf(tw, "%.1f–%.1f s\t%s\t%d\t%d\t%d\t%s\t\n", sp.from.Seconds(), sp.to.Seconds(), a.limit, a.windows, a.most,
			a.allowed, least)
	}
	_ = tw.Flush()
}

// bindingLimits returns, for each span with several limits, the limit
// that bound: of those some window filled, the longest (once its quota is
// spent, the shorter limits' windows stay empty), else the one whose full
// windows were fullest.
func bindingLimits(audits []limitAudit) map[int]hybrid.Limit {
	n := map[int]int{}
	out := map[int]hybrid.Limit{}
	filled := map[int]bool{}
	best := map[int]float64{}
	for _, a := range audits {
		n[a.span]++
		switch {
		case a.most >= a.allowed && (!filled[a.span] || a.limit.Period > out[a.span].Period):
			filled[a.span], out[a.span] = true, a.limit
		case !filled[a.span] && a.least >= 0 && (pct(a.least, a.limit.Rate) >= best[a.span] || out[a.span] == (hybrid.Limit{})):
			best[a.span], out[a.span] = pct(a.least, a.limit.Rate), a.limit
		}
	}
	for span := range out {
		if n[span] < 2 {
			delete(out, span)
		}
	}
	return out
}

// auditMisses returns the audit's misses: any window over its limit, and
// spans where no limit kept every full window at the utilization target.
func (r *recorder) auditMisses() []string {
	var miss []string
	best := map[int]float64{}
	hasFull := map[int]bool{}
	for _, a := range r.audit() {
		if a.most > a.allowed {
			miss = append(miss, fmt.Sprintf("a window of %s admitted %d > %d", a.limit, a.most, a.allowed))
		}
		if a.least >= 0 {
			hasFull[a.span] = true
			best[a.span] = math.Max(best[a.span], pct(a.least, a.limit.Rate))
		}
	}
	if t := r.sc.Targets.WindowUtilizationMinPct; t > 0 {
		for si := range r.spans {
			if hasFull[si] && best[si] < t {
				miss = append(miss, fmt.Sprintf("span %d: full windows at %.1f%% of their limit < %.1f%%", si, best[si], t))
			}
		}
	}
	return miss
}
