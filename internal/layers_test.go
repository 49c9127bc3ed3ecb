// Package internal_test holds the rule that keeps internal/ layered.
package internal_test

import (
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

const module = "github.com/leasehold/leasehold/"

// low are the pieces local and remote build on: they may import each
// other and the standard library (and go-redis), never the packages above
// them or the test kit.
var low = []string{"errs", "exact", "hooks", "keys", "lease", "lua", "redisopts"}

// TestImportsPointDown: internal/'s low pieces import nothing of
// leasehold's but each other; the test kit (internal/testkit) is imported
// only by tests and by commands, never by a library package.
func TestImportsPointDown(t *testing.T) {
	for _, dir := range low {
		for _, imp := range imports(t, dir, false) {
			if rest, ok := strings.CutPrefix(imp, module+"internal/"); ok && slices.Contains(low, rest) {
				continue
			}
			if strings.HasPrefix(imp, module) {
				t.Errorf("internal/%s imports %s: a low piece imports only other low pieces", dir, imp)
			}
		}
	}
	err := filepath.WalkDir("..", func(path string, d os.DirEntry, err error) error {
		if err != nil || !d.IsDir() {
			return err
		}
		rel := filepath.ToSlash(path[len(".."):])
		if strings.HasPrefix(rel, "/cmd") || strings.HasPrefix(rel, "/internal/testkit") || strings.HasPrefix(rel, "/.") {
			return nil
		}
		for _, imp := range imports(t, path, true) {
			if strings.HasPrefix(imp, module+"internal/testkit") {
				t.Errorf("%s imports %s outside its tests", rel, imp)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// imports lists the imports of dir's Go files (without tests), relative
// to internal/ unless abs.
func imports(t *testing.T, dir string, abs bool) []string {
	t.Helper()
	if !abs {
		dir = filepath.Join(".", dir)
	}
	fset := token.NewFileSet()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range entries {
		if e.IsDir() || !strings.HasSuffix(e.Name(), ".go") || strings.HasSuffix(e.Name(), "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, filepath.Join(dir, e.Name()), nil, parser.ImportsOnly)
		if err != nil {
			t.Fatal(err)
		}
		for _, imp := range f.Imports {
			out = append(out, strings.Trim(imp.Path.Value, `"`))
		}
	}
	return out
}
