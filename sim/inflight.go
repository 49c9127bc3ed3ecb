package main

import (
	"fmt"
	"io"
	"math/rand/v2"
	"time"

	"github.com/leasehold/leasehold/inflight"
)

// Requests in flight (package inflight): a traffic source with an
// InFlightSpec takes a slot of the fleet-wide limit for each request
// (TryAcquire: a request that finds none is shed, as the middleware
// sheds it with a 429) and releases it when its work ends. The work time
// rises during a spike, as when a backend slows down: in flight then
// wants far more than the limit, which must hold it there without
// stranding slots. The audit counts the requests truly in flight, at
// every acquire and release.

// InFlightSpec makes a traffic source's requests limited in flight.
type InFlightSpec struct {
	// Slots is the fleet-wide limit of requests in flight per key.
	Slots int64 `json:"slots"`
	// WorkMS is the mean time a request works (exponential);
	// SpikeWorkMS replaces it from SpikeFromS to SpikeUntilS.
	WorkMS      float64 `json:"work_ms"`
	SpikeWorkMS float64 `json:"spike_work_ms"`
	SpikeFromS  float64 `json:"spike_from_s"`
	SpikeUntilS float64 `json:"spike_until_s"`
}

// work draws how long a request started at now works.
func (s *InFlightSpec) work(r *rand.Rand, now time.Duration) time.Duration {
	mean := s.WorkMS
	if t := now.Seconds(); s.SpikeWorkMS > 0 && t >= s.SpikeFromS && t < s.SpikeUntilS {
		mean = s.SpikeWorkMS
	}
	return time.Duration(r.ExpFloat64() * mean * float64(time.Millisecond))
}

// inFlightSpec is the scenario's in-flight source, if any.
func (s *Scenario) inFlightSpec() *InFlightSpec {
	for _, t := range s.Traffic {
		if t.InFlight != nil {
			return t.InFlight
		}
	}
	return nil
}

// slotLimiter gives process p its in-flight limiter, on its clock and the
// world's store.
func (w *world) slotLimiter(p *process) error {
	spec := w.sc.inFlightSpec()
	if spec == nil {
		return nil
	}
	if p.slots != nil { // a restart: the old incarnation's slots go back
		w.rec.slots.calls += p.slots.Stats().StoreCalls
		_ = p.slots.Close(w.ctx)
	}
	l, err := inflight.New(w.mem, "sim-in-flight", spec.Slots, inflight.WithClock(p.clk))
	if err != nil {
		return fmt.Errorf("process %d: %w", p.id, err)
	}
	p.slots = l
	return nil
}

// releasing is a slot whose request's work ends at at.
type releasing struct {
	at  time.Duration
	l   *inflight.Limiter
	key string
}

func (r releasing) due() time.Duration { return r.at }

// acquire decides one in-flight request of process p on key at now.
func (w *world) acquire(now time.Duration, p *process, key string, s *InFlightSpec) {
	ok := p.slots.TryAcquire(key, 1)
	w.rec.inFlight(now, ok, 1, s)
	if ok {
		w.releases.push(releasing{at: now + s.work(w.rng, now), l: p.slots, key: key})
	}
}

// releaseDue releases the slots whose work has ended by now.
func (w *world) releaseDue(now time.Duration) {
	for r, ok := w.releases.pop(now); ok; r, ok = w.releases.pop(now) {
		r.l.Release(r.key, 1)
		w.rec.inFlight(now, true, -1, nil)
	}
}

// slotAudit is what the in-flight audit counted.
type slotAudit struct {
	admitted, shed int
	most           int64         // most requests in flight at once
	mostAt         time.Duration // when
	// spike: the requests in flight integrated over the spike, and its
	// length, for the mean in flight while it lasted; shedSpike, the
	// requests shed then.
	spikeArea, spikeLen time.Duration
	shedSpike           int
	calls               int64 // store calls of every process's limiter
	// steadyCalls and steadyAdmitted: the calls and admissions before
	// the spike.
	steadyCalls    int64
	steadyAdmitted int
}

// inFlight records an acquire (d = 1, ok whether it was granted) or a
// release (d = -1) at now.
func (r *recorder) inFlight(now time.Duration, ok bool, d int64, s *InFlightSpec) {
	a := &r.slots
	if d > 0 && !ok {
		a.shed++
		if s != nil && now.Seconds() >= s.SpikeFromS && now.Seconds() < s.SpikeUntilS {
			a.shedSpike++
		}
		return
	}
	if d > 0 {
		a.admitted++
	}
	r.slotsNow += d
	if r.slotsNow > a.most {
		a.most, a.mostAt = r.slotsNow, now
	}
}

// slotStep integrates the requests in flight over a step (for the mean
// during the spike), and counts the store calls of the steady phase when
// the spike starts.
func (w *world) slotStep(now, dt time.Duration) {
	r, s := w.rec, w.sc.inFlightSpec()
	if s == nil {
		return
	}
	if now < sec(s.SpikeFromS) && now+dt >= sec(s.SpikeFromS) {
		r.slots.steadyCalls, r.slots.steadyAdmitted = r.slots.calls, r.slots.admitted
		for _, p := range w.procs {
			if p.slots != nil {
				r.slots.steadyCalls += p.slots.Stats().StoreCalls
			}
		}
	}
	if now.Seconds() < s.SpikeFromS || now.Seconds() >= s.SpikeUntilS {
		return
	}
	r.slots.spikeArea += time.Duration(r.slotsNow) * dt
	r.slots.spikeLen += dt
}

// slotTable writes the in-flight audit, if the run had such traffic.
func (r *recorder) slotTable(out io.Writer) {
	s := r.sc.inFlightSpec()
	if s == nil {
		return
	}
	a := r.slots
	fmt.Fprintf(out, "in flight: limit %d; at most %d at once (at %.1f s); %d admitted, %d shed (%d during the spike); %.1f store calls per 1000 admitted, %.1f before the spike\n",
		s.Slots, a.most, a.mostAt.Seconds(), a.admitted, a.shed, a.shedSpike, 1000*float64(a.calls)/float64(max(a.admitted, 1)), r.steadyCallsPer1000())
	if a.spikeLen > 0 {
		fmt.Fprintf(out, "in flight during the spike (%.0f–%.0f s, work %.0f ms instead of %.0f): %.1f on average, %.1f%% of the limit\n",
			s.SpikeFromS, s.SpikeUntilS, s.SpikeWorkMS, s.WorkMS, r.spikeMean(), 100*r.spikeMean()/float64(s.Slots))
	}
}

// steadyCallsPer1000 is the store calls per 1 000 admitted before the
// spike (shed requests ask the store, at most once a retry interval per
// key and process, so a spike costs calls by design).
func (r *recorder) steadyCallsPer1000() float64 {
	return 1000 * float64(r.slots.steadyCalls) / float64(max(r.slots.steadyAdmitted, 1))
}

func (r *recorder) spikeMean() float64 {
	if r.slots.spikeLen == 0 {
		return 0
	}
	return float64(r.slots.spikeArea) / float64(r.slots.spikeLen)
}

// slotMisses checks the in-flight targets.
func (r *recorder) slotMisses() []string {
	s := r.sc.inFlightSpec()
	if s == nil {
		return nil
	}
	t, a := r.sc.Targets, r.slots
	var miss []string
	if a.most > s.Slots {
		miss = append(miss, fmt.Sprintf("%d in flight at once > the limit of %d", a.most, s.Slots))
	}
	if u := 100 * r.spikeMean() / float64(s.Slots); t.InFlightSpikeUtilizationMinPct > 0 && u < t.InFlightSpikeUtilizationMinPct {
		miss = append(miss, fmt.Sprintf("in flight during the spike %.1f%% of the limit < %.1f%%", u, t.InFlightSpikeUtilizationMinPct))
	}
	if c := r.steadyCallsPer1000(); t.InFlightCallsPer1000Max > 0 && c > t.InFlightCallsPer1000Max {
		miss = append(miss, fmt.Sprintf("%.1f store calls per 1000 admitted in flight before the spike > %.1f", c, t.InFlightCallsPer1000Max))
	}
	return miss
}
