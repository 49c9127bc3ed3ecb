package benchmarks

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
)

// resultsFile is what `make bench` writes; docs/benchmarks.md's table is
// made from it (TestReadmeTable keeps them in step).
const resultsFile = "results/latest.txt"

// row is one benchmark line of a results file.
type row struct {
	impl, workload, goroutines string
	metrics                    map[string]float64
}

// parseResults reads benchmark lines in the standard format, with names
// impl=X/workload=Y/goroutines=G, and the "key: value" configuration
// lines (machine, date, versions).
func parseResults(path string) (config []string, rows []row, err error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for sc.Scan() {
		line := sc.Text()
		fields := strings.Fields(line)
		if len(fields) >= 2 && strings.HasSuffix(fields[0], ":") && !strings.HasPrefix(line, "Benchmark") {
			config = append(config, line)
			continue
		}
		if !strings.HasPrefix(line, "Benchmark") || len(fields) < 4 || len(fields)%2 != 0 {
			continue
		}
		r := row{metrics: map[string]float64{}}
		name := fields[0][:strings.LastIndex(fields[0], "-")] // drop the GOMAXPROCS suffix
		for part := range strings.SplitSeq(name, "/") {
			k, v, _ := strings.Cut(part, "=")
			switch k {
			case "impl":
				r.impl = v
			case "workload":
				r.workload = v
			case "goroutines":
				r.goroutines = v
			}
		}
		for i := 2; i+1 < len(fields); i += 2 {
			v, err := strconv.ParseFloat(fields[i], 64)
			if err != nil {
				return nil, nil, fmt.Errorf("%s: %q: %w", path, line, err)
			}
			r.metrics[fields[i+1]] = v
		}
		if r.impl != "" {
			rows = append(rows, r)
		}
	}
	return config, rows, sc.Err()
}

// markdownTable renders rows as docs/benchmarks.md's table.
func markdownTable(config []string, rows []row) string {
	var b strings.Builder
	fmt.Fprintf(&b, "Measured with `make bench` (%s).\n\n", strings.Join(config, "; "))
	b.WriteString("| workload | goroutines | impl | ns/op | allocs/op | admitted % | store calls /1000 | floor /1000 | 10% lease floor /1000 | /1000 admitted | bucket calls /1000 admitted | Redis CPU µs /1000 | p50 | p99 | p99.9 | B/key | utilization % |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, r := range rows {
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", r.workload, r.goroutines, r.impl,
			num(r, "ns/op"), num(r, "allocs/op"), num(r, "%admitted"), num(r, "storecalls/1000"), num(r, "floorcalls/1000"), num(r, "capfloorcalls/1000"),
			num(r, "storecalls/1000admitted"), num(r, "bucketcalls/1000admitted"),
			num(r, "redis-cpu-us/1000"), dur(r, "p50-ns"), dur(r, "p99-ns"), dur(r, "p99.9-ns"), num(r, "B/key"), num(r, "%utilization"))
	}
	return b.String()
}

func num(r row, unit string) string {
	v, ok := r.metrics[unit]
	switch {
	case !ok:
		return "–"
	case v >= 100:
		return strconv.FormatFloat(v, 'f', 0, 64)
	case v >= 1:
		return strconv.FormatFloat(v, 'f', 1, 64)
	}
	return strconv.FormatFloat(v, 'g', 2, 64)
}

func dur(r row, unit string) string {
	v, ok := r.metrics[unit]
	switch {
	case !ok:
		return "–"
	case v >= 1e6:
		return strconv.FormatFloat(v/1e6, 'f', 1, 64) + " ms"
	case v >= 1e3:
		return strconv.FormatFloat(v/1e3, 'f', 1, 64) + " µs"
	}
	return strconv.FormatFloat(v, 'f', 0, 64) + " ns"
}

// docsFile holds the benchmark table (the README links to it).
const docsFile = "../docs/benchmarks.md"

// TestReadmeTable checks that the documented benchmark table
// (docs/benchmarks.md) is the one results/latest.txt gives; after `make
// bench`, run it with UPDATE_README=1 to rewrite it.
func TestReadmeTable(t *testing.T) { checkTable(t, "bench", resultsFile, markdownTable) }

// checkTable checks docsFile's section name against the table render
// makes of file's benchmark lines (see keepSection).
func checkTable(t *testing.T, name, file string, render func(config []string, rows []row) string) {
	t.Helper()
	config, rows, err := parseResults(file)
	if err != nil {
		t.Fatal(err)
	}
	if len(rows) == 0 {
		t.Fatalf("%s holds no benchmark lines", file)
	}
	keepSection(t, name, render(config, rows), file)
}

// keepSection checks that docsFile's section between <!-- name:start -->
// and <!-- name:end --> is want, made from source; with UPDATE_README set
// it rewrites the section instead.
func keepSection(t *testing.T, name, want, source string) {
	t.Helper()
	start, end := "<!-- "+name+":start -->\n", "<!-- "+name+":end -->"
	readme, err := os.ReadFile(docsFile)
	if err != nil {
		t.Fatal(err)
	}
	before, rest, ok1 := strings.Cut(string(readme), start)
	_, after, ok2 := strings.Cut(rest, end)
	if !ok1 || !ok2 {
		t.Fatalf("%s has no %q … %q section", docsFile, start, end)
	}
	got := rest[:len(rest)-len(after)-len(end)]
	if got == want {
		return
	}
	if os.Getenv("UPDATE_README") != "" {
		if err := os.WriteFile(docsFile, []byte(before+start+want+end+after), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	t.Fatalf("%s's %s section is not the one %s gives; run `UPDATE_README=1 go test -run %s` in benchmarks/", docsFile, name, source, t.Name())
}
