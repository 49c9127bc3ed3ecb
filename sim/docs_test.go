package main

import (
	"bytes"
	"os"
	"regexp"
	"strings"
	"testing"
)

// docsFile is the simulator's page; its samples are runs of this code.
const docsFile = "../docs/simulator.md"

// sampleRE finds a sample: a marker naming the scenario, then a fenced
// block holding its output.
var sampleRE = regexp.MustCompile("(?s)<!-- sample: ([a-z0-9-]+) -->\n```\n(.*?)```")

// wallTime is the part of a run's header that depends on the machine.
var wallTime = regexp.MustCompile(` in [0-9.]+ s\)`)

// TestDocSamples: every sample output in docs/simulator.md is what the
// scenario prints now (wall-clock time aside). After a change that moves
// them, UPDATE_DOCS=1 go test -run TestDocSamples rewrites them.
func TestDocSamples(t *testing.T) {
	doc, err := os.ReadFile(docsFile)
	if err != nil {
		t.Fatal(err)
	}
	suite, err := defaultSuite()
	if err != nil {
		t.Fatal(err)
	}
	byName := map[string]*Scenario{}
	for _, s := range suite {
		byName[s.Name] = s
	}
	matches := sampleRE.FindAllSubmatchIndex(doc, -1)
	if len(matches) == 0 {
		t.Fatalf("%s has no samples", docsFile)
	}
	var out bytes.Buffer
	last := 0
	changed := false
	for _, m := range matches {
		name := string(doc[m[2]:m[3]])
		s, ok := byName[name]
		if !ok {
			t.Fatalf("%s: a sample of %q, which is not in the suite", docsFile, name)
		}
		want := sampleOf(t, s)
		got := string(doc[m[4]:m[5]])
		if wallTime.ReplaceAllString(got, ")") != want {
			changed = true
			if os.Getenv("UPDATE_DOCS") == "" {
				t.Errorf("%s: the %s sample is not what the scenario prints now:\n%s\nwant:\n%s\n(UPDATE_DOCS=1 go test -run TestDocSamples rewrites it)", docsFile, name, got, want)
			}
		}
		out.Write(doc[last:m[4]])
		out.WriteString(want)
		last = m[5]
	}
	out.Write(doc[last:])
	if changed && os.Getenv("UPDATE_DOCS") != "" {
		if err := os.WriteFile(docsFile, out.Bytes(), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// sampleOf runs s with its own seed and returns what the page shows of
// it: the header, tables and verdict, without the description, the
// legend and the plot paths.
func sampleOf(t *testing.T, s *Scenario) string {
	t.Helper()
	var buf, discard bytes.Buffer
	if _, _, err := runOne(s, 0, t.TempDir(), &buf, &discard); err != nil {
		t.Fatal(err)
	}
	var keep []string
	for _, l := range strings.Split(buf.String(), "\n") {
		switch {
		case l == "", l == s.Description, strings.HasPrefix(l, "plots: "), strings.Contains(tableLegend, l), l == fullFloorLegend:
			continue
		}
		keep = append(keep, wallTime.ReplaceAllString(l, ")"))
	}
	return strings.Join(keep, "\n") + "\n"
}
