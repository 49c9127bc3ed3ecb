// Command sim replays outages, latency spikes, partitions, clock skew,
// policy changes and restarts against the real hybrid.Limiter code, many
// instances ("processes") sharing one remote.MemoryStore behind a fault
// layer, all in virtual time on a clock.Manual. A run is deterministic for
// a given seed and far faster than real time.
//
// Usage:
//
//	go run ./sim                     # the default suite (sim/scenarios)
//	go run ./sim -scenario NAME      # scenarios of the suite by name (comma-separated)
//	go run ./sim -scenario FILE      # a scenario file
//	go run ./sim -list               # list the default suite
//	go run ./sim -seed 7 -out DIR    # another seed, plots elsewhere
//
// For each scenario it prints a table per phase (healthy / outage /
// recovery / after, or healthy / change / after for a policy change),
// writes a plot of admitted requests per second per process against the
// limit (PNG and SVG), and prints a verdict against the scenario's
// targets. It exits 1 if any target is missed. The scenario format is
// documented on the Scenario type in scenario.go.
package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"time"
)

func main() {
	os.Exit(cli(os.Args[1:], os.Stdout, os.Stderr))
}

func cli(args []string, stdout, stderr io.Writer) int {
	fl := flag.NewFlagSet("sim", flag.ContinueOnError)
	fl.SetOutput(stderr)
	file := fl.String("scenario", "", "run these scenarios of the suite (names, comma-separated, see -list) or this scenario file")
	seed := fl.Uint64("seed", 0, "random seed (0: each scenario's own)")
	out := fl.String("out", "sim-out", "directory for plots")
	list := fl.Bool("list", false, "list the default suite and exit")
	if err := fl.Parse(args); err != nil {
		return 2
	}
	suite, err := loadSuite(*file)
	if err != nil {
		fmt.Fprintln(stderr, "sim:", err)
		return 2
	}
	if *list {
		for _, s := range suite {
			fmt.Fprintf(stdout, "%-22s %4.0f s  %4d processes  %s\n", s.Name, s.DurationS, s.Processes, s.Description)
		}
		return 0
	}
	if err := os.MkdirAll(*out, 0o755); err != nil {
		fmt.Fprintln(stderr, "sim:", err)
		return 2
	}
	var verdicts []string
	failed := false
	for _, s := range suite {
		rec, v, err := runOne(s, *seed, *out, stdout, stderr)
		if err != nil {
			fmt.Fprintln(stderr, "sim:", err)
			return 2
		}
		verdicts = append(verdicts, v)
		failed = failed || len(rec.verdict()) > 0
	}
	fmt.Fprintln(stdout, "\n== verdicts")
	for _, v := range verdicts {
		fmt.Fprintln(stdout, v)
	}
	if failed {
		return 1
	}
	return 0
}

// loadSuite returns the default suite, the scenarios of it that which
// names (comma-separated), or the scenario in the file which names.
func loadSuite(which string) ([]*Scenario, error) {
	if which == "" {
		return defaultSuite()
	}
	if _, err := os.Stat(which); err != nil {
		suite, err := defaultSuite()
		if err != nil {
			return nil, err
		}
		var out []*Scenario
		for _, name := range strings.Split(which, ",") {
			i := slices.IndexFunc(suite, func(s *Scenario) bool { return s.Name == name })
			if i < 0 {
				return nil, fmt.Errorf("no scenario named %q and no such file (go run ./sim -list names them)", name)
			}
			out = append(out, suite[i])
		}
		return out, nil
	}
	s, err := loadFile(which)
	if err != nil {
		return nil, err
	}
	return []*Scenario{s}, nil
}

// runOne runs s (with seed, if not 0), prints its table and verdict, and
// writes its plots to out.
func runOne(s *Scenario, seed uint64, out string, stdout, stderr io.Writer) (*recorder, string, error) {
	sd := s.Seed
	if seed != 0 {
		sd = seed
	}
	began := time.Now()
	rec, err := run(s, sd, progressLine(stderr, s.Name))
	if err != nil {
		return nil, "", err
	}
	fmt.Fprintf(stdout, "\n== %s (seed %d, %d processes, %.0f virtual s in %.1f s)\n%s\n\n",
		s.Name, sd, s.Processes, s.DurationS, time.Since(began).Seconds(), s.Description)
	rec.table(stdout)
	rec.auditTable(stdout)
	rec.regionTable(stdout)
	rec.costTable(stdout)
	rec.slotTable(stdout)
	files, err := rec.writePlots(out)
	if err != nil {
		return nil, "", fmt.Errorf("plot: %w", err)
	}
	fmt.Fprintf(stdout, "plots: %v\n", files)
	v := rec.summary()
	fmt.Fprintln(stdout, v)
	return rec, v, nil
}

// progressLine returns a progress callback that rewrites one stderr line,
// or nil when stderr is not a terminal.
func progressLine(w io.Writer, name string) func(done, total time.Duration) {
	f, ok := w.(*os.File)
	if !ok {
		return nil
	}
	if st, err := f.Stat(); err != nil || st.Mode()&os.ModeCharDevice == 0 {
		return nil
	}
	return func(done, total time.Duration) {
		fmt.Fprintf(f, "\r%-24s %3.0f%% (%.0f/%.0f virtual s)", name, 100*done.Seconds()/total.Seconds(), done.Seconds(), total.Seconds())
		if done+time.Second >= total {
			fmt.Fprint(f, "\r\033[K")
		}
	}
}
