package envoyrls

import (
	"bytes"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"

	"github.com/leasehold/leasehold/hybrid"
	"go.yaml.in/yaml/v3"
)

// ErrConfig marks a configuration the server cannot run: the message names
// the file and the rule.
var ErrConfig = errors.New("envoyrls: bad config")

// Config is every domain's rules, as envoyproxy/ratelimit's YAML files
// state them. Build it with Load or Parse.
type Config struct {
	domains map[string]*node
	// files are the files read, for messages.
	files []string
}

// node is one level of a domain's descriptor tree.
type node struct {
	// exact children by "key_value", any-value children by "key".
	exact, anyValue map[string]*node
	// wildcards are children whose value ends in '*', longest prefix first.
	wildcards []wildcard
	rule      *Rule
}

type wildcard struct {
	key, prefix string
	next        *node
}

// Rule is one rate_limit of the config: the limit, and how it is applied.
type Rule struct {
	// Name is the rule's name, or its path in the descriptor tree
	// ("database_users.client") when the YAML gives none.
	Name string
	// Unit and RequestsPerUnit are the limit as the YAML and the Envoy
	// response state it.
	Unit            string
	RequestsPerUnit uint32
	// Unlimited rules never touch the store.
	Unlimited bool
	// Shadow rules are counted but never refuse.
	Shadow bool
	// Replaces names the rules this one replaces when both match.
	Replaces []string
	// Policy is the leasehold policy the rule runs under: its name is the
	// domain, the rule's path and its limit, so a changed limit is a new
	// bucket.
	Policy hybrid.Policy
	// named says the YAML gave the name (replaces refer to such names).
	named bool
	// current is the limit as every response states it: one message per
	// rule, shared by the responses, which only read it.
	current *rlsv3.RateLimitResponse_RateLimit
}

// units are the reference's units, in seconds per unit.
var units = map[string]time.Duration{
	"second": time.Second,
	"minute": time.Minute,
	"hour":   time.Hour,
	"day":    24 * time.Hour,
	"week":   7 * 24 * time.Hour,
	"month":  30 * 24 * time.Hour,
	"year":   365 * 24 * time.Hour,
}

// The YAML, as envoyproxy/ratelimit reads it, with leasehold's extensions
// (burst, algorithm, also).
type yamlConfig struct {
	Domain      string           `yaml:"domain"`
	Descriptors []yamlDescriptor `yaml:"descriptors"`
}

type yamlDescriptor struct {
	Key            string           `yaml:"key"`
	Value          string           `yaml:"value"`
	RateLimit      *yamlRateLimit   `yaml:"rate_limit"`
	Descriptors    []yamlDescriptor `yaml:"descriptors"`
	ShadowMode     bool             `yaml:"shadow_mode"`
	DetailedMetric bool             `yaml:"detailed_metric"`
	Replaces       []struct {
		Name string `yaml:"name"`
	} `yaml:"replaces"`
}

type yamlRateLimit struct {
	Unit            string `yaml:"unit"`
	RequestsPerUnit uint32 `yaml:"requests_per_unit"`
	Name            string `yaml:"name"`
	Unlimited       bool   `yaml:"unlimited"`
	// Extensions: a burst other than requests_per_unit, a sliding window,
	// and more limits every hit must also fit.
	Burst     int64           `yaml:"burst"`
	Algorithm string          `yaml:"algorithm"`
	Also      []yamlExtraRate `yaml:"also"`
}

type yamlExtraRate struct {
	Unit            string `yaml:"unit"`
	RequestsPerUnit uint32 `yaml:"requests_per_unit"`
	Burst           int64  `yaml:"burst"`
}

// Load reads a YAML file, or every .yaml and .yml file of a directory
// (one domain each, as the reference loads them).
func Load(path string) (*Config, error) {
	st, err := os.Stat(path)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrConfig, err)
	}
	files := []string{path}
	if st.IsDir() {
		files = nil
		entries, err := os.ReadDir(path)
		if err != nil {
			return nil, fmt.Errorf("%w: %v", ErrConfig, err)
		}
		for _, e := range entries {
			if ext := filepath.Ext(e.Name()); !e.IsDir() && (ext == ".yaml" || ext == ".yml") {
				files = append(files, filepath.Join(path, e.Name()))
			}
		}
		if len(files) == 0 {
			return nil, fmt.Errorf("%w: %s: no .yaml or .yml files", ErrConfig, path)
		}
	}
	srcs := map[string][]byte{}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			return nil, fmt.Errorf("%w: %v", ErrConfig, err)
		}
		srcs[f] = b
	}
	return Parse(srcs)
}

// Parse builds a Config from YAML sources by file name.
func Parse(files map[string][]byte) (*Config, error) {
	c := &Config{domains: map[string]*node{}}
	for _, f := range slices.Sorted(maps.Keys(files)) {
		var y yamlConfig
		dec := yaml.NewDecoder(bytes.NewReader(files[f]))
		dec.KnownFields(true)
		if err := dec.Decode(&y); err != nil {
			return nil, fmt.Errorf("%w: %s: %v", ErrConfig, f, err)
		}
		if y.Domain == "" {
			return nil, fmt.Errorf("%w: %s: no domain", ErrConfig, f)
		}
		if _, dup := c.domains[y.Domain]; dup {
			return nil, fmt.Errorf("%w: %s: domain %q is in another file too", ErrConfig, f, y.Domain)
		}
		root, err := build(f, y.Domain, "", y.Descriptors)
		if err != nil {
			return nil, err
		}
		if err := checkReplaces(f, root); err != nil {
			return nil, err
		}
		c.domains[y.Domain] = root
		c.files = append(c.files, f)
	}
	return c, nil
}

func build(file, domain, path string, ds []yamlDescriptor) (*node, error) {
	n := &node{exact: map[string]*node{}, anyValue: map[string]*node{}}
	for _, d := range ds {
		here := d.Key
		if d.Value != "" {
			here += "_" + d.Value
		}
		if path != "" {
			here = path + "." + here
		}
		bad := func(format string, args ...any) error {
			return fmt.Errorf("%w: %s: domain %q, descriptor %q: %s", ErrConfig, file, domain, here, fmt.Sprintf(format, args...))
		}
		if d.Key == "" {
			return nil, bad("no key")
		}
		child, err := build(file, domain, here, d.Descriptors)
		if err != nil {
			return nil, err
		}
		if d.RateLimit != nil {
			r, err := ruleOf(domain, here, d)
			if err != nil {
				return nil, bad("%v", err)
			}
			child.rule = r
		} else if d.ShadowMode || len(d.Replaces) > 0 {
			return nil, bad("shadow_mode or replaces without a rate_limit")
		}
		var dup bool
		switch {
		case strings.HasSuffix(d.Value, "*"):
			w := wildcard{key: d.Key, prefix: strings.TrimSuffix(d.Value, "*"), next: child}
			dup = slices.ContainsFunc(n.wildcards, func(o wildcard) bool { return o.key == w.key && o.prefix == w.prefix })
			n.wildcards = append(n.wildcards, w)
		case d.Value == "":
			_, dup = n.anyValue[d.Key]
			n.anyValue[d.Key] = child
		default:
			_, dup = n.exact[d.Key+"_"+d.Value]
			n.exact[d.Key+"_"+d.Value] = child
		}
		if dup {
			return nil, bad("defined twice")
		}
	}
	// The most specific wildcard wins.
	sort.SliceStable(n.wildcards, func(i, j int) bool { return len(n.wildcards[i].prefix) > len(n.wildcards[j].prefix) })
	return n, nil
}

func ruleOf(domain, path string, d yamlDescriptor) (*Rule, error) {
	y := d.RateLimit
	r := &Rule{Name: y.Name, Unit: y.Unit, RequestsPerUnit: y.RequestsPerUnit, Unlimited: y.Unlimited, Shadow: d.ShadowMode, named: y.Name != ""}
	if r.Name == "" {
		r.Name = path
	}
	r.current = &rlsv3.RateLimitResponse_RateLimit{Name: r.Name, RequestsPerUnit: r.RequestsPerUnit, Unit: unitOf(r.Unit)}
	for _, rep := range d.Replaces {
		if rep.Name == "" {
			return nil, errors.New("replaces an entry with no name")
		}
		r.Replaces = append(r.Replaces, rep.Name)
	}
	if y.Unlimited {
		if y.RequestsPerUnit != 0 || y.Unit != "" || y.Burst != 0 || y.Algorithm != "" || len(y.Also) > 0 {
			return nil, errors.New("unlimited with a limit")
		}
		return r, nil
	}
	main, err := limitOf(y.Unit, y.RequestsPerUnit, y.Burst)
	if err != nil {
		return nil, err
	}
	p := hybrid.Policy{Limit: main}
	switch y.Algorithm {
	case "", "token_bucket":
	case "sliding_window":
		if y.Burst != 0 && y.Burst != main.Rate {
			return nil, errors.New("a sliding window takes no burst")
		}
		p.Algorithm = hybrid.SlidingWindow
	default:
		return nil, fmt.Errorf("algorithm %q: want token_bucket or sliding_window", y.Algorithm)
	}
	for _, a := range y.Also {
		l, err := limitOf(a.Unit, a.RequestsPerUnit, a.Burst)
		if err != nil {
			return nil, fmt.Errorf("also: %w", err)
		}
		p.Also = append(p.Also, l)
	}
	// The policy's name holds the limit: a reload that changes it starts
	// a new bucket, which every replica converges on as it reloads.
	p.Name = fmt.Sprintf("rls:%s:%s:%d/%s", domain, path, y.RequestsPerUnit, y.Unit)
	if main.Burst != main.Rate {
		p.Name += fmt.Sprintf(":b%d", main.Burst)
	}
	if p.Algorithm == hybrid.SlidingWindow {
		p.Name += ":sw"
	}
	for _, l := range p.Also {
		p.Name += fmt.Sprintf(":%v", l)
	}
	r.Policy = p
	return r, nil
}

func limitOf(unit string, perUnit uint32, burst int64) (hybrid.Limit, error) {
	period, ok := units[strings.ToLower(unit)]
	if !ok {
		return hybrid.Limit{}, fmt.Errorf("unit %q: want second, minute, hour, day, week, month or year", unit)
	}
	if perUnit == 0 {
		return hybrid.Limit{}, errors.New("requests_per_unit must be above 0 (or set unlimited: true)")
	}
	if burst < 0 {
		return hybrid.Limit{}, fmt.Errorf("burst %d below 0", burst)
	}
	if burst == 0 {
		burst = int64(perUnit)
	}
	return hybrid.Limit{Rate: int64(perUnit), Period: period, Burst: burst}, nil
}

// checkReplaces reports a replaces that names no rule of the domain.
func checkReplaces(file string, root *node) error {
	names := map[string]bool{}
	var rules []*Rule
	var walk func(n *node)
	walk = func(n *node) {
		if n.rule != nil {
			rules = append(rules, n.rule)
			if n.rule.named {
				names[n.rule.Name] = true
			}
		}
		for _, c := range n.exact {
			walk(c)
		}
		for _, c := range n.anyValue {
			walk(c)
		}
		for _, w := range n.wildcards {
			walk(w.next)
		}
	}
	walk(root)
	for _, r := range rules {
		for _, name := range r.Replaces {
			if !names[name] {
				return fmt.Errorf("%w: %s: rule %q replaces %q, which no rate_limit names", ErrConfig, file, r.Name, name)
			}
		}
	}
	return nil
}

// Entry is one key/value of a request's descriptor.
type Entry struct{ Key, Value string }

// Match returns the rule for a descriptor of domain, and the bucket key of
// its values; nil when no rule covers the whole descriptor (the reference
// applies a limit only at the level of the descriptor's last entry).
func (c *Config) Match(domain string, entries []Entry) (*Rule, string) {
	n := c.domains[domain]
	if n == nil {
		return nil, ""
	}
	var key []byte
	for i, e := range entries {
		next := n.exact[e.Key+"_"+e.Value]
		if next == nil {
			for _, w := range n.wildcards {
				if w.key == e.Key && strings.HasPrefix(e.Value, w.prefix) {
					next = w.next
					break
				}
			}
		}
		if next == nil {
			next = n.anyValue[e.Key]
		}
		if next == nil {
			return nil, ""
		}
		if i > 0 {
			key = append(key, '|')
		}
		// Lengths first: no two descriptors write the same key.
		key = strconv.AppendInt(key, int64(len(e.Key)), 10)
		key = append(append(append(key, ':'), e.Key...), '=')
		key = strconv.AppendInt(key, int64(len(e.Value)), 10)
		key = append(append(key, ':'), e.Value...)
		n = next
	}
	if n.rule == nil {
		return nil, ""
	}
	return n.rule, string(key)
}

// rules lists every rule of the config.
func (c *Config) rules() []*Rule {
	var out []*Rule
	var walk func(n *node)
	walk = func(n *node) {
		if n.rule != nil {
			out = append(out, n.rule)
		}
		for _, k := range slices.Sorted(maps.Keys(n.exact)) {
			walk(n.exact[k])
		}
		for _, k := range slices.Sorted(maps.Keys(n.anyValue)) {
			walk(n.anyValue[k])
		}
		for _, w := range n.wildcards {
			walk(w.next)
		}
	}
	for _, d := range slices.Sorted(maps.Keys(c.domains)) {
		walk(c.domains[d])
	}
	return out
}
