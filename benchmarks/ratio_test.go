package benchmarks

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/leasehold/leasehold/internal/testkit/redistest"
)

// ratioRounds is how many times TestZipfRatios runs each row. One run of a
// Zipf row swings with its own speed: a slower run revisits each key later
// in wall time, so its floor and its calls above it both rise, which slows
// it further (5 runs of decaying leases at 16 goroutines: 4 845–11 395
// ns/op, 109–194 store calls per 1 000).
const ratioRounds = 5

// TestZipfRatios runs hybrid and redis_rate on the
// Zipf workload at every concurrency level, ratioRounds times in turn on
// one real Redis, and prints the median of each round's throughput ratio
// against redis_rate, of each round's ratio of client CPU per store call
// to redis_rate's, and the medians of each row's p99 and p99.9: what one
// run of BenchmarkLimiters cannot settle. It takes about 16 minutes, so
// it runs in make bench (LEASEHOLD_BENCH_RATIOS=1), not make test;
// LEASEHOLD_BENCH_GOROUTINES (say "1" or "1,16") runs only those levels.
func TestZipfRatios(t *testing.T) {
	levels, srv := ratioSetup(t)
	w := workloads[2]
	keys, seq := keySet(w.keys), w.sequence()
	impls := []benchImpl{
		{"redis_rate", func(b *testing.B, par int) { benchRedisRate(b, srv, w, keys, seq, par) }},
		{"hybrid", func(b *testing.B, par int) { benchHybrid(b, srv, w, keys, seq, par, hybridSetup{}) }},
	}
	var out strings.Builder
	fmt.Fprintf(&out, "medians of %d rounds, %s:\n", ratioRounds, w.name)
	fmt.Fprintf(&out, "%-10s %-14s %12s %10s %12s %12s %14s %14s\n", "goroutines", "impl", "ns/op", "× rr", "p99 ms", "p99.9 ms", "calls/1000", "cpu/call × rr")
	for _, par := range levels {
		rows := runRounds(t, srv, impls, par, ratioRounds, false)
		for i, im := range impls {
			ratios, cpu := make([]float64, ratioRounds), make([]float64, ratioRounds)
			for r := range ratioRounds {
				ratios[r] = float64(rows[0][r].NsPerOp()) / float64(rows[i][r].NsPerOp())
				// redis_rate makes a store call per decision: its CPU per
				// call is its CPU per decision.
				cpu[r] = rows[i][r].Extra["client-cpu-us/call"] / rows[0][r].Extra["client-cpu-us/call"]
			}
			med := func(f func(testing.BenchmarkResult) float64) float64 { return medianOf(rows[i], f) }
			fmt.Fprintf(&out, "%-10d %-14s %12.0f %10.2f %12.2f %12.2f %14.1f %14.2f\n", par, im.name,
				med(func(r testing.BenchmarkResult) float64 { return float64(r.NsPerOp()) }), median(ratios),
				med(func(r testing.BenchmarkResult) float64 { return r.Extra["p99-ns"] / 1e6 }),
				med(func(r testing.BenchmarkResult) float64 { return r.Extra["p99.9-ns"] / 1e6 }),
				med(func(r testing.BenchmarkResult) float64 { return r.Extra["storecalls/1000"] }), median(cpu))
		}
	}
	t.Log("\n" + out.String())
}

// coldRounds is how many times TestColdRatios runs each limiter at each
// level: one round's ratio of client CPU swings by a third either way.
const coldRounds = 9

// TestColdRatios runs BenchmarkColdDecisions's limiters (every decision a
// store call) and coldLayers's layers coldRounds times at every
// concurrency level on one real Redis, flushed before each run, in one
// order in even rounds and the reverse in odd ones (a run pays for the
// keys the one before left to expire), and prints the medians issue 23's
// third point is judged by: hybrid's client CPU per store call against
// redis_rate's per decision, the median of each round's ratio;
// allocations a decision; and what a script call costs Redis. Then the
// same ratio for each layer, which splits hybrid's: its store call alone,
// and go-redis sending each limiter's command to a script that does
// nothing. It runs in make bench beside TestZipfRatios (about 5 minutes).
func TestColdRatios(t *testing.T) {
	levels, srv := ratioSetup(t)
	keys := coldKeySet()
	impls := append(coldLimiters(srv, keys), coldLayers(srv, keys)...)
	if impls[0].name != "hybrid" || impls[1].name != "redis_rate" {
		t.Fatalf("coldLimiters: %s, %s; want hybrid, redis_rate", impls[0].name, impls[1].name)
	}
	var layers strings.Builder
	fmt.Fprintf(&layers, "layers, medians of %d rounds (see coldLayers):\n", coldRounds)
	fmt.Fprintf(&layers, "%-6s %-12s %-12s %16s %16s\n", "layer", "goroutines", "impl", "cpu/call × rr", "script µs/call")
	var out strings.Builder
	fmt.Fprintf(&out, "cold decisions, medians of %d rounds (hybrid / redis_rate):\n", coldRounds)
	fmt.Fprintf(&out, "%-6s %-12s %16s %18s %22s %16s\n", "cold", "goroutines", "cpu/call × rr", "allocs", "script µs/call", "ns/op")
	for _, par := range levels {
		rows := runRounds(t, srv, impls, par, coldRounds, true)
		med := func(i int, f func(testing.BenchmarkResult) float64) float64 { return medianOf(rows[i], f) }
		cpu := make([]float64, coldRounds)
		for r := range coldRounds {
			cpu[r] = rows[0][r].Extra["client-cpu-us/call"] / rows[1][r].Extra["client-cpu-us/call"]
		}
		for i := range impls {
			ratios := make([]float64, coldRounds)
			for r := range coldRounds {
				ratios[r] = rows[i][r].Extra["client-cpu-us/call"] / rows[1][r].Extra["client-cpu-us/call"]
			}
			fmt.Fprintf(&layers, "%-6s %-12d %-12s %16s %16.1f\n", "layer", par, impls[i].name,
				fmt.Sprintf("%.2f (%.2f–%.2f)", median(ratios), slices.Min(ratios), slices.Max(ratios)),
				med(i, func(r testing.BenchmarkResult) float64 { return r.Extra["redis-script-us/call"] }))
		}
		lo, hi := slices.Min(cpu), slices.Max(cpu)
		allocs := func(r testing.BenchmarkResult) float64 { return float64(r.AllocsPerOp()) }
		script := func(r testing.BenchmarkResult) float64 { return r.Extra["redis-script-us/call"] }
		ns := func(r testing.BenchmarkResult) float64 { return float64(r.NsPerOp()) }
		fmt.Fprintf(&out, "%-6s %-12d %16s %18s %22s %16s\n", "cold", par,
			fmt.Sprintf("%.2f (%.2f–%.2f)", median(cpu), lo, hi),
			fmt.Sprintf("%.0f / %.0f", med(0, allocs), med(1, allocs)),
			fmt.Sprintf("%.1f / %.1f", med(0, script), med(1, script)),
			fmt.Sprintf("%.0f / %.0f", med(0, ns), med(1, ns)))
	}
	t.Log("\n" + out.String() + layers.String())
}

// coldFile is where make bench writes TestColdRatios's output.
const coldFile = "results/cold.txt"

// TestColdTable checks that docs/benchmarks.md's table of cold-decision
// medians is the one results/cold.txt gives; after `make bench`, run it
// with UPDATE_README=1 to rewrite it.
func TestColdTable(t *testing.T) {
	want, err := coldTable(coldFile)
	if err != nil {
		t.Fatal(err)
	}
	keepSection(t, "cold", want, coldFile)
}

// coldTable renders TestColdRatios's medians in path as markdown tables:
// the limiters', and their layers'.
func coldTable(path string) (string, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	commit := "?"
	var rows []string
	// layers[goroutines][impl] is "<ratio> (<lo>–<hi>)" and its script µs.
	layers := map[string]map[string][2]string{}
	var levels []string
	for line := range strings.SplitSeq(string(data), "\n") {
		if c, ok := strings.CutPrefix(line, "commit: "); ok {
			commit = strings.TrimSpace(c)
			continue
		}
		fs := strings.Fields(line)
		if len(fs) < 2 {
			continue
		}
		if _, err := strconv.Atoi(fs[1]); err != nil {
			continue
		}
		switch {
		case len(fs) == 13 && fs[0] == "cold":
			// cold <goroutines> <ratio> (<lo>–<hi>) <allocs> / <allocs> <µs> / <µs> <ns> / <ns>
			rows = append(rows, fmt.Sprintf("| %s | %s %s | %s / %s | %s / %s | %s / %s |", fs[1], fs[2], fs[3], fs[4], fs[6], fs[7], fs[9], fs[10], fs[12]))
		case len(fs) == 6 && fs[0] == "layer":
			// layer <goroutines> <impl> <ratio> (<lo>–<hi>) <script µs>
			if layers[fs[1]] == nil {
				layers[fs[1]] = map[string][2]string{}
				levels = append(levels, fs[1])
			}
			layers[fs[1]][fs[2]] = [2]string{fs[3] + " " + fs[4], fs[5]}
		}
	}
	if len(rows) == 0 {
		return "", fmt.Errorf("%s holds no cold medians", path)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "The last run (commit %s), medians of %d rounds:\n\n", commit, coldRounds)
	b.WriteString("| goroutines | client CPU per store call × redis_rate's per decision (rounds' range) | allocations a decision: hybrid / redis_rate | Redis µs a script call: hybrid / redis_rate | ns a decision: hybrid / redis_rate |\n")
	b.WriteString("|---|---|---|---|---|\n")
	for _, r := range rows {
		b.WriteString(r + "\n")
	}
	if len(levels) == 0 {
		return "", fmt.Errorf("%s holds no layer medians", path)
	}
	b.WriteString("\nThe same rounds, client CPU per call × redis_rate's per decision (rounds' range) and Redis µs a script call, of each layer a cold decision passes through (`coldLayers`):\n\n")
	names := []string{"hybrid", "store", "shape", "rr-shape"}
	b.WriteString("| goroutines | hybrid | its store alone | go-redis, the store's command | go-redis, redis_rate's command |\n")
	b.WriteString("|---|---|---|---|---|\n")
	for _, par := range levels {
		b.WriteString("| " + par + " |")
		for _, n := range names {
			l, ok := layers[par][n]
			if !ok {
				return "", fmt.Errorf("%s: no layer %s at %s goroutines", path, n, par)
			}
			fmt.Fprintf(&b, " %s; %s µs |", l[0], l[1])
		}
		b.WriteString("\n")
	}
	return b.String(), nil
}

// benchImpl is one implementation a ratio test runs: run decides b.N
// times from par goroutines.
type benchImpl struct {
	name string
	run  func(b *testing.B, par int)
}

// ratioSetup skips t unless make bench asked for ratios
// (LEASEHOLD_BENCH_RATIOS=1), and returns the concurrency levels to run
// and a real Redis.
func ratioSetup(t *testing.T) ([]int, *redistest.Server) {
	t.Helper()
	if os.Getenv("LEASEHOLD_BENCH_RATIOS") == "" {
		t.Skip("set LEASEHOLD_BENCH_RATIOS=1 (make bench)")
	}
	levels, err := ratioLevels(os.Getenv("LEASEHOLD_BENCH_GOROUTINES"))
	if err != nil {
		t.Fatal(err)
	}
	return levels, redistest.Standalone(t)
}

// runRounds runs each of impls rounds times at par goroutines and returns
// rows[i][r], impl i's result in round r. Each run starts on an empty
// Redis: the keys an earlier run left (redis_rate's 100 000 expire within
// a second of its end) would be expired and freed by Redis during the
// next run, on the same 2 cores. With alternate, odd rounds run the impls
// in reverse order, so that no impl always follows the same one.
func runRounds(t *testing.T, srv *redistest.Server, impls []benchImpl, par, rounds int, alternate bool) [][]testing.BenchmarkResult {
	t.Helper()
	flush := srv.Client(t)
	rows := make([][]testing.BenchmarkResult, len(impls))
	for r := range rounds {
		for k := range impls {
			i := k
			if alternate && r%2 == 1 {
				i = len(impls) - 1 - k
			}
			if err := flush.FlushAll(context.Background()).Err(); err != nil {
				t.Fatal(err)
			}
			res := testing.Benchmark(func(b *testing.B) { impls[i].run(b, par) })
			if res.N == 0 {
				t.Fatalf("%s at %d goroutines did not run", impls[i].name, par)
			}
			rows[i] = append(rows[i], res)
		}
	}
	return rows
}

// medianOf is the median of f over rs.
func medianOf(rs []testing.BenchmarkResult, f func(testing.BenchmarkResult) float64) float64 {
	v := make([]float64, len(rs))
	for r, res := range rs {
		v[r] = f(res)
	}
	return median(v)
}

// ratioLevels is the concurrency levels TestZipfRatios runs: all of
// goroutines, or those listed in env ("1,16").
func ratioLevels(env string) ([]int, error) {
	if env == "" {
		return goroutines, nil
	}
	var levels []int
	for f := range strings.SplitSeq(env, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || !slices.Contains(goroutines, n) {
			return nil, fmt.Errorf("LEASEHOLD_BENCH_GOROUTINES=%q: %q is not one of %v", env, f, goroutines)
		}
		levels = append(levels, n)
	}
	return levels, nil
}

// median is the middle of v (the mean of the two middle values for an
// even count); v is sorted in place.
func median(v []float64) float64 {
	slices.Sort(v)
	n := len(v)
	if n%2 == 1 {
		return v[n/2]
	}
	return (v[n/2-1] + v[n/2]) / 2
}

// ratiosFile is where make bench writes TestZipfRatios's output.
const ratiosFile = "results/ratios.txt"

// TestRatiosTable checks that docs/benchmarks.md's table of medians is the
// one results/ratios.txt gives; after `make bench`, run it with
// UPDATE_README=1 to rewrite it.
func TestRatiosTable(t *testing.T) {
	want, err := ratiosTable(ratiosFile)
	if err != nil {
		t.Fatal(err)
	}
	keepSection(t, "ratios", want, ratiosFile)
}

// ratiosTable reads TestZipfRatios's output in path and makes the
// markdown table of its medians, one line per concurrency level.
func ratiosTable(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	commit := "?"
	// med[goroutines][impl] is the line's fields after the impl's name:
	// ns/op, × rr, p99 ms, p99.9 ms, calls/1000, cpu/call × rr.
	med := map[string]map[string][]string{}
	var order []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		if c, ok := strings.CutPrefix(line, "commit: "); ok {
			commit = strings.Fields(c)[0]
			continue
		}
		fs := strings.Fields(line)
		if len(fs) != 8 {
			continue
		}
		if _, err := strconv.Atoi(fs[0]); err != nil {
			continue
		}
		if med[fs[0]] == nil {
			med[fs[0]] = map[string][]string{}
			order = append(order, fs[0])
		}
		med[fs[0]][fs[1]] = fs[2:]
	}
	if err := sc.Err(); err != nil {
		return "", err
	}
	if len(order) == 0 {
		return "", fmt.Errorf("%s holds no medians", path)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "The last run (commit %s):\n\n", commit)
	b.WriteString("| goroutines | hybrid × redis_rate | p99 ms: hybrid / redis_rate | p99.9 ms: hybrid / redis_rate | client CPU per store call × redis_rate's |\n")
	b.WriteString("|---|---|---|---|---|\n")
	for _, g := range order {
		h, rr := med[g]["hybrid"], med[g]["redis_rate"]
		if h == nil || rr == nil {
			return "", fmt.Errorf("%s: goroutines=%s lacks a row", path, g)
		}
		fmt.Fprintf(&b, "| %s | %s | %s / %s | %s / %s | %s |\n", g, h[1], h[2], rr[2], h[3], rr[3], h[5])
	}
	return b.String(), nil
}
