package doccheck

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// A block is a fenced Go block of a Markdown file, and where it starts.
type block struct {
	file string // relative to the repository's root
	line int    // of the block's first line of code
	code string
}

// blocks returns every ```go block of the files.
func blocks(t *testing.T, root string, files []string) []block {
	t.Helper()
	var all []block
	for _, f := range files {
		data, err := os.ReadFile(filepath.Join(root, f))
		if err != nil {
			t.Fatal(err)
		}
		var cur *block
		sc := bufio.NewScanner(strings.NewReader(string(data)))
		for n := 1; sc.Scan(); n++ {
			line := sc.Text()
			switch {
			case cur == nil && strings.TrimSpace(line) == "```go":
				cur = &block{file: f, line: n + 1}
			case cur != nil && strings.TrimSpace(line) == "```":
				all = append(all, *cur)
				cur = nil
			case cur != nil:
				cur.code += line + "\n"
			}
		}
		if cur != nil {
			t.Fatalf("%s:%d: a Go block that never ends", f, cur.line)
		}
	}
	return all
}

// The harness a fragment is completed with: the packages the docs use,
// by the name they are called by, and the variables a fragment may take
// as given (as a handler or a service's setup would have them).
var (
	packages = map[string]string{
		"context":     "context",
		"errors":      "errors",
		"fmt":         "fmt",
		"log":         "log",
		"slog":        "log/slog",
		"math":        "math",
		"http":        "net/http",
		"os":          "os",
		"strconv":     "strconv",
		"time":        "time",
		"redis":       "github.com/redis/go-redis/v9",
		"logging":     "github.com/redis/go-redis/v9/logging",
		"hybrid":      "github.com/leasehold/leasehold/hybrid",
		"httplimit":   "github.com/leasehold/leasehold/hybrid/httplimit",
		"inflight":    "github.com/leasehold/leasehold/inflight",
		"remote":      "github.com/leasehold/leasehold/remote",
		"tiered":      "github.com/leasehold/leasehold/remote/tiered",
		"grpclimit":   "github.com/leasehold/leasehold/contrib/grpclimit",
		"otelmetrics": "github.com/leasehold/leasehold/contrib/otelmetrics",
		"prommetrics": "github.com/leasehold/leasehold/contrib/prommetrics",
		"prometheus":  "github.com/prometheus/client_golang/prometheus",
		"otel":        "go.opentelemetry.io/otel",
		"grpc":        "google.golang.org/grpc",
		"envoyrls":    "github.com/leasehold/leasehold/contrib/envoyrls",
		"rlsv3":       "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3",
	}
	// given are a fragment's free variables. A fragment runs in a block
	// of its own inside a function with these parameters, so what it
	// declares shadows them and must be used, as in real code.
	given = `ctx context.Context, w http.ResponseWriter, r *http.Request, mux *http.ServeMux, api http.Handler,
	rdb, worldRedis, regionRedis *redis.Client, store remote.Store, lim *hybrid.Limiter,
	customerID, tenant string, plans map[string]string, tenantOf func(string) string,
	req *http.Request, callModel func(context.Context, *http.Request) modelReply`
	givenTypes = `
// modelReply is what an LLM SDK answers: its usage fields are ints.
type modelReply struct{ Usage struct{ PromptTokens, CompletionTokens, TotalTokens int } }
`
	givenImports = []string{"context", "http", "redis", "remote", "hybrid"}
)

var (
	pkgUse   = regexp.MustCompile(`\b([a-z][a-z0-9]*)\.[A-Za-z_]`)
	topLevel = regexp.MustCompile(`(?m)^(func|type|var|const) `)
)

// source is b as a Go file: a whole file as it is; declarations under a
// package clause and the imports they use; statements in a function that
// gives them the harness's variables. A //line comment maps every error
// to the Markdown line.
func source(b block, pkg string) string {
	if strings.HasPrefix(b.code, "package ") {
		return fmt.Sprintf("//line %s:%d\n%s", b.file, b.line, b.code)
	}
	var names []string
	for _, m := range pkgUse.FindAllStringSubmatch(b.code, -1) {
		if _, ok := packages[m[1]]; ok {
			names = append(names, m[1])
		}
	}
	decls := topLevel.MatchString(b.code)
	if !decls {
		names = append(names, givenImports...)
	}
	slices.Sort(names)
	var s strings.Builder
	fmt.Fprintf(&s, "package %s\n\nimport (\n", pkg)
	for _, n := range slices.Compact(names) {
		fmt.Fprintf(&s, "\t%s %q\n", n, packages[n])
	}
	s.WriteString(")\n")
	if decls {
		fmt.Fprintf(&s, "\n//line %s:%d\n%s", b.file, b.line, b.code)
		return s.String()
	}
	s.WriteString(givenTypes)
	fmt.Fprintf(&s, "\nfunc _(%s) error {\n\t{\n//line %s:%d\n%s\t}\n\treturn nil\n}\n", given, b.file, b.line, b.code)
	return s.String()
}

// TestDocsCompile builds every Go block of the README and docs/, each as a
// package of its own: a block that does not compile fails with the
// Markdown file and line of the error.
func TestDocsCompile(t *testing.T) {
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	files := []string{"README.md", "RELIABILITY.md"}
	docs, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range docs {
		files = append(files, filepath.Join("docs", filepath.Base(d)))
	}
	all := blocks(t, root, files)
	if len(all) < 10 {
		t.Fatalf("found %d Go blocks in %v: fewer than the docs hold", len(all), files)
	}
	out, err := vet(t, all)
	if err != nil {
		t.Fatalf("Go blocks of the docs that do not build (%d blocks):\n%s", len(all), out)
	}
	var quickStart bool
	for _, b := range all {
		quickStart = quickStart || b.file == "README.md" && strings.HasPrefix(b.code, "package main")
	}
	if !quickStart {
		t.Error("the README has no whole program (package main) a newcomer can go run")
	}
	t.Logf("%d Go blocks of %d files build and vet", len(all), len(files))
}

// TestHarnessKeepsFragmentsStrict: the harness completes a fragment
// without hiding its mistakes: the README's old in-flight block (an err
// never checked, shadowed on the next line) and an undeclared variable
// fail, while the same block done right builds.
func TestHarnessKeepsFragmentsStrict(t *testing.T) {
	bad := []block{
		{file: "shadowed.md", line: 1, code: "sem, err := inflight.New(remote.NewRedis(rdb), \"tenant-in-flight\", 50)\n" +
			"if err := sem.Acquire(ctx, tenant, 1); err != nil {\n\treturn err\n}\ndefer sem.Release(tenant, 1)\n"},
		{file: "undeclared.md", line: 1, code: "d, err := lim.AllowN(ctx, customerID, 1)\nif err != nil || !d.Allowed {\n\treturn errNope\n}\n"},
	}
	for _, b := range bad {
		if out, err := vet(t, []block{b}); err == nil || !strings.Contains(string(out), b.file+":") {
			t.Errorf("%s built, or failed elsewhere:\n%s", b.file, out)
		}
	}
	good := block{file: "good.md", line: 1, code: "sem, err := inflight.New(remote.NewRedis(rdb), \"tenant-in-flight\", 50)\n" +
		"if err != nil {\n\treturn err\n}\nif err := sem.Acquire(ctx, tenant, 1); err != nil {\n\treturn err\n}\ndefer sem.Release(tenant, 1)\n"}
	if out, err := vet(t, []block{good}); err != nil {
		t.Errorf("the right block does not build:\n%s", out)
	}
}

// vet writes each block as a package of its own and runs go vet on them
// all.
func vet(t *testing.T, all []block) ([]byte, error) {
	t.Helper()
	// The packages go under this module (its dependencies resolve), in a
	// directory the go command's ./... skips.
	dir, err := os.MkdirTemp(".", "_snippets")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	var pkgs []string
	for i, b := range all {
		pkg := fmt.Sprintf("b%02d", i)
		if strings.HasPrefix(b.code, "package main") {
			pkg = "main"
		}
		p := filepath.Join(dir, fmt.Sprintf("b%02d", i))
		pkgs = append(pkgs, "./"+filepath.ToSlash(p))
		if err := os.Mkdir(p, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(p, "block.go"), []byte(source(b, pkg)), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return exec.Command(goTool(), append([]string{"vet"}, pkgs...)...).CombinedOutput()
}

func goTool() string {
	if p, err := exec.LookPath("go"); err == nil {
		return p
	}
	return filepath.Join(os.Getenv("GOROOT"), "bin", "go")
}
