package main

import (
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"time"

	"github.com/leasehold/leasehold/hybrid"
)

// Costs known only after the work (hybrid.Limiter.ChargeN, Charge.Settle):
// a traffic source with a CostSpec charges each request an estimate and
// settles, when its work ends, a cost drawn from a long-tailed
// distribution. The phase table then counts estimates; the cost audit
// counts what was settled, with the estimates of work still running, at
// every charge and settle, against Burst + Rate·t of the policy's limit.

// CostSpec makes a traffic source's requests costed.
type CostSpec struct {
	// Estimate is what a request is charged when it starts.
	Estimate int64 `json:"estimate"`
	// Mean is the mean actual cost; actual costs are Pareto with shape
	// Alpha (default 1.5: a long tail), capped at CapX times the estimate
	// (default 10).
	Mean  float64 `json:"mean"`
	Alpha float64 `json:"alpha"`
	CapX  float64 `json:"cap_x"`
	// WorkMS is the mean time a request works before it settles
	// (exponential).
	WorkMS float64 `json:"work_ms"`
}

// actual draws one actual cost.
func (c *CostSpec) actual(r *rand.Rand) int64 {
	alpha := c.Alpha
	if alpha <= 1 {
		alpha = 1.5
	}
	capX := c.CapX
	if capX <= 0 {
		capX = 10
	}
	scale := c.Mean * (alpha - 1) / alpha
	x := scale / math.Pow(1-r.Float64(), 1/alpha)
	return int64(math.Min(x, capX*float64(c.Estimate)))
}

// work draws how long one request works.
func (c *CostSpec) work(r *rand.Rand) time.Duration {
	return time.Duration(r.ExpFloat64() * c.WorkMS * float64(time.Millisecond))
}

// settling is a charge whose work ends at at.
type settling struct {
	at               time.Duration
	ch               *hybrid.Charge
	estimate, actual int64
}

func (s settling) due() time.Duration { return s.at }

// charge decides one costed request of process p on key at now.
func (w *world) charge(now time.Duration, p *process, key string, c *CostSpec) (hybrid.Decision, error) {
	ch, err := p.lim.ChargeN(w.ctx, key, c.Estimate)
	if err != nil {
		return hybrid.Decision{}, err
	}
	if ch.Allowed {
		w.rec.costed(now, c.Estimate, 1)
		w.settles.push(settling{at: now + c.work(w.rng), ch: ch, estimate: c.Estimate, actual: c.actual(w.rng)})
	}
	return ch.Decision, nil
}

// settleDue settles the charges whose work has ended by now.
func (w *world) settleDue(now time.Duration) {
	for s, ok := w.settles.pop(now); ok; s, ok = w.settles.pop(now) {
		if err := s.ch.Settle(s.actual); err == nil {
			w.rec.costed(now, s.actual-s.estimate, -1)
		}
	}
}

// costAudit is the settled-cost audit of a run.
type costAudit struct {
	events   int
	settled  int64         // settled costs plus estimates still running, at the end
	worst    int64         // most that ever was over Burst + Rate·t
	worstAt  time.Duration // when
	inFlight int           // most charges running at once
	bound    int64         // Burst + Rate·t at the end
}

// costed records a change of the fleet's charged cost at now: +estimate
// when a charge is admitted (running +1), actual − estimate when it
// settles (running −1).
func (r *recorder) costed(now time.Duration, delta int64, running int) {
	r.costs = append(r.costs, costEvent{at: now, delta: delta})
	r.running += running
	r.maxRunning = max(r.maxRunning, r.running)
}

type costEvent struct {
	at    time.Duration
	delta int64
}

// auditCosts replays the cost events against the policy's limit.
func (r *recorder) auditCosts() (costAudit, bool) {
	if len(r.costs) == 0 {
		return costAudit{}, false
	}
	lim := r.sc.Policy.limit()
	a := costAudit{events: len(r.costs), inFlight: r.maxRunning}
	for _, ev := range r.costs {
		a.settled += ev.delta
		if over := a.settled - (lim.Burst + lim.TokensIn(ev.at)); over > a.worst {
			a.worst, a.worstAt = over, ev.at
		}
	}
	a.bound = lim.Burst + lim.TokensIn(sec(r.sc.DurationS))
	return a, true
}

// costTable writes the cost audit, if the run had costed traffic.
func (r *recorder) costTable(out io.Writer) {
	a, ok := r.auditCosts()
	if !ok {
		return
	}
	lim := r.sc.Policy.limit()
	fmt.Fprintf(out, "settled costs: %d against Burst + Rate·t = %d (%.1f%% of Rate·t); most over Burst + Rate·t at any instant: %d at %.1f s, with at most %d charges running\n",
		a.settled, a.bound, pct(a.settled, lim.TokensIn(sec(r.sc.DurationS))), a.worst, a.worstAt.Seconds(), a.inFlight)
	fmt.Fprintln(out, "settled costs: every settled cost plus the estimates still running, counted at each charge and settle.")
}

// costMisses checks the cost targets.
func (r *recorder) costMisses() []string {
	a, ok := r.auditCosts()
	if !ok {
		return nil
	}
	t := r.sc.Targets
	lim := r.sc.Policy.limit()
	var miss []string
	if t.CostOverMaxEstimates != nil {
		if allowed := int64(*t.CostOverMaxEstimates * float64(r.sc.costEstimate())); a.worst > allowed {
			miss = append(miss, fmt.Sprintf("settled costs %d over Burst + Rate·t > %d", a.worst, allowed))
		}
	}
	if u := pct(a.settled, lim.TokensIn(sec(r.sc.DurationS))); t.CostUtilizationMinPct > 0 && u < t.CostUtilizationMinPct {
		miss = append(miss, fmt.Sprintf("settled costs %.1f%% of Rate·t < %.1f%%", u, t.CostUtilizationMinPct))
	}
	return miss
}

// costEstimate is the estimate of the scenario's costed traffic (0: none).
func (s *Scenario) costEstimate() int64 {
	for _, t := range s.Traffic {
		if t.Cost != nil {
			return t.Cost.Estimate
		}
	}
	return 0
}
