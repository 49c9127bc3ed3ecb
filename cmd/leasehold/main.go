// Command leasehold is the operator's view of leasehold's Redis state: a
// key's bucket, a policy's record (show, set, delete; versioned), and a
// policy's live fleet. It works on a standalone Redis, Cluster and
// Sentinel, with AUTH and TLS, as services connect.
//
// Usage:
//
//	leasehold [-url URL | -addr host:port] [-cluster] [-prefix p] [-timeout d] COMMAND ...
//
//	leasehold bucket POLICY KEY
//	leasehold slots POLICY KEY [-tier T]
//	leasehold policy show POLICY
//	leasehold policy set POLICY -version V -rate R [-period D] [-burst B]
//	leasehold policy set POLICY -version V -slots N
//	leasehold policy delete POLICY
//	leasehold fleet POLICY
//
// A policy is a rate limit's (hybrid) or an in-flight limit's (inflight):
// policy show prints whichever records exist, policy set -slots sets an
// in-flight limit's, and slots shows which processes hold a key's slots.
// Global flags may also follow the command (policy show api -addr h:p).
//
// The URL is go-redis's: redis:// or rediss:// (TLS), user:password@ for
// AUTH, /db, options as query parameters (dial_timeout=3s, skip_verify=
// true), more nodes as addr=host:port; master_name=NAME for Sentinel (the
// URL's hosts are the sentinels), cluster=true (or -cluster) for Cluster.
// Without -url, $LEASEHOLD_REDIS_URL is used, then -addr. Every command
// takes -h.
//
// It exits 0 on success, 1 when Redis refuses or cannot be reached (a
// stale version, an unknown policy, a refused connection) and 2 on bad
// usage (unknown command, bad flags, an invalid limit or name).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"net"
	"os"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/leasehold/leasehold/inflight"
	"github.com/leasehold/leasehold/internal/keys"
	"github.com/leasehold/leasehold/internal/redisurl"
	"github.com/leasehold/leasehold/local"
	"github.com/leasehold/leasehold/remote"
	"github.com/redis/go-redis/v9"
)

func main() {
	// go-redis logs failed dials on its own; the command says what went
	// wrong in one line.
	redis.SetLogger(quiet{})
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

type quiet struct{}

func (quiet) Printf(context.Context, string, ...any) {}

// errUsage marks bad usage: exit 2.
var errUsage = errors.New("bad usage")

// command is a subcommand: its name, its arguments before any flag, and
// what it does.
type command struct {
	name string
	args []string
	does string
}

var commands = []command{
	{"bucket", []string{"POLICY", "KEY"}, "a key's bucket: level, limit, version, next token, TTL"},
	{"slots", []string{"POLICY", "KEY"}, "an in-flight limit's key: its limit and the slots each process holds"},
	{"policy show", []string{"POLICY"}, "the policy record in force (a rate limit's, an in-flight limit's, or both)"},
	{"policy set", []string{"POLICY"}, "a new version (-version V -rate R [-period D] [-burst B], or -version V -slots N for an in-flight limit); every limiter follows"},
	{"policy diff", []string{"POLICY"}, "compare the record with a limit (-rate R [-period D] [-burst B], as in your code); exit 1 if they differ"},
	{"policy delete", []string{"POLICY"}, "remove the record (before limiters start with the code's)"},
	{"fleet", []string{"POLICY"}, "live limiters and their last heartbeat"},
}

func (c command) usage() string { return c.name + " " + strings.Join(c.args, " ") }

func usage(fl *flag.FlagSet, w io.Writer) func() {
	return func() {
		fmt.Fprintln(w, "usage: leasehold [flags] COMMAND ...\n\ncommands:")
		for _, c := range commands {
			fmt.Fprintf(w, "  %-22s %s\n", c.usage(), c.does)
		}
		fmt.Fprintln(w, "\nflags:")
		fl.SetOutput(w)
		fl.PrintDefaults()
		fmt.Fprintln(w, "\nEvery command takes -h.")
	}
}

func run(args []string, stdout, stderr io.Writer) int {
	fl := flag.NewFlagSet("leasehold", flag.ContinueOnError)
	fl.SetOutput(io.Discard)
	rawURL := fl.String("url", "", "Redis URL: redis://[user:password@]host:port[/db][?options], rediss:// for TLS, ?master_name=M for Sentinel (default $"+redisurl.EnvVar+", else -addr)")
	addr := fl.String("addr", "127.0.0.1:6379", "Redis address, when no URL is given (comma-separated seed nodes with -cluster)")
	cluster := fl.Bool("cluster", false, "Redis Cluster")
	prefix := fl.String("prefix", remote.DefaultPrefix, "key prefix the limiters use (hybrid.WithPrefix)")
	timeout := fl.Duration("timeout", 3*time.Second, "how long to wait for Redis")
	// The flag package would print the usage itself on -h and on errors:
	// it is printed once, below, to stdout when asked for and to stderr
	// after an error.
	fl.Usage = func() {}
	if err := fl.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			usage(fl, stdout)()
			return 0
		}
		fmt.Fprintln(stderr, "leasehold:", err)
		usage(fl, stderr)()
		return 2
	}
	rest := fl.Args()
	if len(rest) == 0 {
		fmt.Fprintln(stderr, "leasehold: no command")
		usage(fl, stderr)()
		return 2
	}
	cmd, err := parseCommand(rest, fl, stdout)
	switch {
	case errors.Is(err, flag.ErrHelp):
		return 0
	case err != nil:
		fmt.Fprintln(stderr, "leasehold:", err)
		if cmd == nil {
			usage(fl, stderr)()
		}
		return 2
	}
	u := *rawURL
	if u == "" {
		u = os.Getenv(redisurl.EnvVar)
	}
	if u == "" {
		u = redisurl.FromAddr(*addr)
	}
	c, _, err := redisurl.Dial(u, redisurl.Settings{Cluster: *cluster, OneShot: true})
	if err != nil {
		fmt.Fprintln(stderr, "leasehold:", err)
		return 2
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	return exitCode(cmd(ctx, remote.NewRedis(c), *prefix, stdout), u, stderr)
}

// exitCode reports a command's error on stderr in one line and returns the
// exit code: 2 for bad usage or input, 1 for anything else.
func exitCode(err error, url string, stderr io.Writer) int {
	switch {
	case err == nil:
		return 0
	case errors.Is(err, errUsage), errors.Is(err, remote.ErrInvalidKey), errors.Is(err, remote.ErrInvalidPolicy), errors.Is(err, local.ErrInvalidLimit):
		fmt.Fprintln(stderr, "leasehold:", err)
		return 2
	case errors.Is(err, remote.ErrUnavailable):
		fmt.Fprintf(stderr, "leasehold: cannot reach Redis at %s: %v\n", redisurl.Redacted(url), rootCause(err))
		return 1
	}
	fmt.Fprintln(stderr, "leasehold:", err)
	return 1
}

// rootCause is the driver's own words for a failed connection (dial tcp
// ...: connection refused), without the layers that all say
// "unavailable"; err itself when there is none.
func rootCause(err error) error {
	var op *net.OpError
	if errors.As(err, &op) {
		return op
	}
	return err
}

// runner is a parsed command, run against the store.
type runner func(ctx context.Context, s *remote.RedisStore, prefix string, out io.Writer) error

// noop stands for a command known but misused (its own usage is shown,
// not the global one).
func noop(context.Context, *remote.RedisStore, string, io.Writer) error { return nil }

// parseCommand parses a command and its own flags, and the global flags
// of global again, so that they may also follow the command. -h prints
// the command's help to out and returns flag.ErrHelp.
func parseCommand(args []string, global *flag.FlagSet, out io.Writer) (runner, error) {
	name, rest := args[0], args[1:]
	if name == "policy" && len(rest) > 0 {
		name, rest = "policy "+rest[0], rest[1:]
	}
	i := slices.IndexFunc(commands, func(c command) bool { return c.name == name })
	if i < 0 {
		return nil, fmt.Errorf("%w: unknown command %q", errUsage, strings.Join(args[:min(len(args), 2)], " "))
	}
	fl := flag.NewFlagSet(name, flag.ContinueOnError)
	fl.SetOutput(io.Discard)
	var set *policyFlags
	if name == "policy set" || name == "policy diff" {
		set = newPolicyFlags(fl, name == "policy set")
	}
	var tier *string
	if name == "slots" {
		tier = fl.String("tier", "", "the key's tier (inflight.WithTier), if any")
	}
	own := flag.NewFlagSet(name, flag.ContinueOnError)
	fl.VisitAll(func(f *flag.Flag) { own.Var(f.Value, f.Name, f.Usage) })
	// The global flags share their values: -addr after the command sets
	// the same -addr as before it.
	global.VisitAll(func(f *flag.Flag) { fl.Var(f.Value, f.Name, f.Usage) })
	fl.Usage = func() {}
	help := func() {
		fmt.Fprintf(out, "usage: leasehold [flags] %s\n\n%s\n", commands[i].usage(), commands[i].does)
		own.SetOutput(out)
		own.PrintDefaults()
		fmt.Fprintln(out, "\nThe global flags (leasehold -h) may also follow the command.")
	}
	// Positional arguments come first (policy set POLICY -version ...).
	var pos []string
	for len(rest) > 0 && !strings.HasPrefix(rest[0], "-") {
		pos, rest = append(pos, rest[0]), rest[1:]
	}
	if err := fl.Parse(rest); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			help()
			return nil, err
		}
		return noop, fmt.Errorf("%w: %s: %v", errUsage, name, err)
	}
	pos = append(pos, fl.Args()...)
	if len(pos) != len(commands[i].args) {
		return noop, fmt.Errorf("%w: want %s", errUsage, commands[i].usage())
	}
	return runnerFor(name, pos, set, tier), nil
}

// runnerFor is the command name with its positional arguments and flags.
func runnerFor(name string, pos []string, set *policyFlags, tier *string) runner {
	return func(ctx context.Context, s *remote.RedisStore, prefix string, out io.Writer) error {
		switch name {
		case "bucket":
			return bucket(ctx, s, prefix, pos[0], pos[1], out)
		case "slots":
			return slots(ctx, s, prefix, pos[0], *tier, pos[1], out)
		case "policy show":
			return showPolicy(ctx, s, prefix, pos[0], out)
		case "policy set":
			return setPolicy(ctx, s, prefix, pos[0], set, out)
		case "policy delete":
			return deletePolicy(ctx, s, prefix, pos[0], out)
		case "policy diff":
			return diffPolicy(ctx, s, prefix, pos[0], set, out)
		}
		return fleet(ctx, s, prefix, pos[0], out)
	}
}

// diffPolicy compares the record of name with the limit the flags give
// (the policy a service's code would start with): it prints both and
// returns an error when they differ, so a script can check before a
// deploy which one limiters will enforce.
func diffPolicy(ctx context.Context, s *remote.RedisStore, prefix, name string, f *policyFlags, out io.Writer) error {
	if *f.rate == 0 {
		return fmt.Errorf("%w: policy diff needs -rate", errUsage)
	}
	if *f.burst == 0 {
		*f.burst = *f.rate
	}
	yours := local.Limit{Rate: *f.rate, Period: *f.period, Burst: *f.burst}
	if err := yours.Validate(); err != nil {
		return err
	}
	rec, ok, err := s.GetPolicy(ctx, prefix, name)
	if err != nil {
		return err
	}
	if !ok {
		fmt.Fprintf(out, "policy %s: no record; a limiter started with %v publishes it\n", name, yours)
		return nil
	}
	if exactlySame(rec.Limit, yours) && !rec.Window && len(rec.Also) == 0 {
		fmt.Fprintf(out, "policy %s: the record (version %d) is %v, as yours\n", name, rec.Version, rec.Limit)
		return nil
	}
	fmt.Fprintf(out, "policy %s: the record (version %d) is %v", name, rec.Version, rec.Limit)
	for _, l := range rec.Also {
		fmt.Fprintf(out, " and %v", l)
	}
	if rec.Window {
		fmt.Fprint(out, ", sliding window")
	}
	fmt.Fprintf(out, "; yours is %v\n", yours)
	return fmt.Errorf("policy %q: the record differs from %v: limiters adopt the record unless started with hybrid.WithPolicyPrecedence(hybrid.PolicyFromCode)", name, yours)
}

// exactlySame reports whether a and b admit the same: equal bursts and
// equal rates per unit of time (5/1s is 300/1m).
func exactlySame(a, b local.Limit) bool {
	return a.Burst == b.Burst && a.Rate*int64(b.Period/time.Microsecond) == b.Rate*int64(a.Period/time.Microsecond)
}

// deletePolicy removes a policy record, so that the next limiter started
// publishes the policy in its code. It is for a record no limiter runs
// under (a test, a policy set by hand): a running limiter of the policy
// publishes the version it holds again at its next poll. Buckets keep the
// version they were last written under until they expire (about
// time-to-full): publish the next policy with a version above the deleted
// one, or limiters started meanwhile are told by the buckets of a newer
// version they find no record of.
func deletePolicy(ctx context.Context, s *remote.RedisStore, prefix, name string, out io.Writer) error {
	rec, ok, err := s.GetPolicy(ctx, prefix, name)
	if err != nil {
		return err
	}
	slots, slotsOK, err := inflight.ReadPolicy(ctx, s, prefix, name)
	if err != nil {
		return err
	}
	if !ok && !slotsOK {
		return fmt.Errorf("policy %q: no record at %s nor %s", name, keys.Policy(prefix, name), keys.SlotsPolicy(prefix, name))
	}
	del := func(key string) error {
		if err := s.Client().Del(ctx, key).Err(); err != nil {
			return fmt.Errorf("policy %q: %w: %v", name, remote.ErrUnavailable, err)
		}
		return nil
	}
	if ok {
		if err := del(keys.Policy(prefix, name)); err != nil {
			return err
		}
		fmt.Fprintf(out, "policy %s deleted (was version %d: %v); publish a new one with a version above %d\n", name, rec.Version, rec.Limit, rec.Version)
	}
	if slotsOK {
		if err := del(keys.SlotsPolicy(prefix, name)); err != nil {
			return err
		}
		fmt.Fprintf(out, "in-flight policy %s deleted (was version %d: %d in flight); publish a new one with a version above %d\n", name, slots.Version, slots.Slots, slots.Version)
	}
	return nil
}

func bucket(ctx context.Context, s *remote.RedisStore, prefix, policy, key string, out io.Writer) error {
	b, err := s.Peek(ctx, prefix, policy, key)
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "key        %s\n", keys.Bucket(prefix, policy, "", key))
	if !b.Exists {
		fmt.Fprintln(out, "state      no bucket: full (never used, or idle past its TTL)")
		return nil
	}
	level := fmt.Sprintf("%d of %d", b.Level, b.Limit.Burst)
	if b.Level < 0 {
		// Future-dated grants and outage debt are paid from refills.
		level = fmt.Sprintf("0 of %d, %d owed (future-dated grants or outage debt)", b.Limit.Burst, -b.Level)
	}
	fmt.Fprintf(out, "level      %s\nlimit      %v\nversion    %d\nnext token %v\nfull in    %v\nttl        %v\n",
		level, b.Limit, b.Version, b.NextToken, b.ResetAfter, b.TTL)
	return nil
}

// showPolicy prints the records of name: a rate limit's, an in-flight
// limit's, or both when both kinds of limiter run under one name.
func showPolicy(ctx context.Context, s *remote.RedisStore, prefix, name string, out io.Writer) error {
	rec, ok, err := s.GetPolicy(ctx, prefix, name)
	if err != nil {
		return err
	}
	slots, slotsOK, err := inflight.ReadPolicy(ctx, s, prefix, name)
	if err != nil {
		return err
	}
	if !ok && !slotsOK {
		return fmt.Errorf("policy %q: no record at %s nor %s (no limiter has published it, or it expired)",
			name, keys.Policy(prefix, name), keys.SlotsPolicy(prefix, name))
	}
	if ok {
		fmt.Fprintf(out, "policy  %s (rate limit)\nversion %d\nlimit   %v\n", name, rec.Version, rec.Limit)
		if rec.Window {
			fmt.Fprintln(out, "algorithm sliding-window")
		}
		for _, l := range rec.Also {
			fmt.Fprintf(out, "also    %v\n", l)
		}
		for _, tier := range slices.Sorted(maps.Keys(rec.Tiers)) {
			t := rec.Tiers[tier]
			fmt.Fprintf(out, "tier    %s: %v", tier, t.Limit)
			for _, l := range t.Also {
				fmt.Fprintf(out, " and %v", l)
			}
			fmt.Fprintln(out)
		}
	}
	if slotsOK {
		if ok {
			fmt.Fprintln(out)
		}
		fmt.Fprintf(out, "policy  %s (in-flight limit)\nversion %d\nslots   %d in flight per key\n", name, slots.Version, slots.Slots)
		for _, tier := range slices.Sorted(maps.Keys(slots.Tiers)) {
			fmt.Fprintf(out, "tier    %s: %d\n", tier, slots.Tiers[tier])
		}
	}
	return nil
}

// slots prints an in-flight limit's key: the limit the store holds it
// under and what each live process holds.
func slots(ctx context.Context, s *remote.RedisStore, prefix, policy, tier, key string, out io.Writer) error {
	h, err := inflight.ReadSlots(ctx, s, prefix, policy, tier, key)
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "key        %s\n", keys.Slots(prefix, policy, tier, key))
	if h.Version == 0 && len(h.Held) == 0 {
		fmt.Fprintln(out, "state      no slots held (never used, or every term ended)")
		return nil
	}
	var held int64
	for _, x := range h.Held {
		held += x.Slots
	}
	fmt.Fprintf(out, "limit      %d in flight (policy version %d)\nheld       %d by %d processes\n", h.Limit, h.Version, held, len(h.Held))
	for _, x := range h.Held {
		fmt.Fprintf(out, "  %s  holds %d, wants %d, term ends in %v\n", x.Holder, x.Slots, x.Wants, x.TermLeft.Round(time.Millisecond))
	}
	return nil
}

// policyFlags are policy set's and policy diff's flags.
type policyFlags struct {
	version            *uint64
	rate, burst, slots *int64
	period             *time.Duration
}

func newPolicyFlags(fl *flag.FlagSet, set bool) *policyFlags {
	f := &policyFlags{
		rate:   fl.Int64("rate", 0, "tokens per period (required for a rate limit)"),
		period: fl.Duration("period", time.Second, "refill period"),
		burst:  fl.Int64("burst", 0, "bucket size (default: rate)"),
		slots:  new(int64),
	}
	if set {
		f.version = fl.Uint64("version", 0, "new version, above the one in force (required)")
		f.slots = fl.Int64("slots", 0, "requests in flight per key: sets an in-flight limit's policy instead (no -rate)")
	}
	return f
}

func setPolicy(ctx context.Context, s *remote.RedisStore, prefix, name string, f *policyFlags, out io.Writer) error {
	version, rate, period, burst := f.version, f.rate, f.period, f.burst
	if *f.slots != 0 {
		return setSlotsPolicy(ctx, s, prefix, name, f, out)
	}
	if *version == 0 || *rate == 0 {
		return fmt.Errorf("%w: policy set needs -version and -rate (or -slots for an in-flight limit)", errUsage)
	}
	if *burst == 0 {
		*burst = *rate
	}
	rec := remote.PolicyRecord{Version: *version, Limit: local.Limit{Rate: *rate, Period: *period, Burst: *burst}}
	// Only the policy's own limit changes: a sliding window, more limits
	// and tiers in force are kept.
	if old, ok, err := s.GetPolicy(ctx, prefix, name); err == nil && ok {
		rec.Window, rec.Also, rec.Tiers = old.Window, old.Also, old.Tiers
	}
	cur, applied, err := s.SetPolicy(ctx, prefix, name, rec)
	if err != nil {
		return err
	}
	if !applied {
		return fmt.Errorf("policy %q: version %d is stale: version %d (%v) is in force", name, *version, cur.Version, cur.Limit)
	}
	fmt.Fprintf(out, "policy %s is now version %d: %v\n", name, cur.Version, cur.Limit)
	return nil
}

// setSlotsPolicy publishes an in-flight limit's policy; its tiers in
// force are kept.
func setSlotsPolicy(ctx context.Context, s *remote.RedisStore, prefix, name string, f *policyFlags, out io.Writer) error {
	if *f.version == 0 || *f.rate != 0 || *f.burst != 0 {
		return fmt.Errorf("%w: policy set -slots needs -version, and takes no -rate or -burst", errUsage)
	}
	p := inflight.Policy{Name: name, Slots: *f.slots, Version: *f.version}
	if old, ok, err := inflight.ReadPolicy(ctx, s, prefix, name); err == nil && ok {
		p.Tiers = old.Tiers
	}
	cur, err := inflight.PublishPolicy(ctx, s, prefix, p)
	switch {
	case errors.Is(err, inflight.ErrStalePolicy):
		return fmt.Errorf("policy %q: version %d is stale: version %d (%d in flight) is in force", name, *f.version, cur.Version, cur.Slots)
	case errors.Is(err, inflight.ErrInvalidOption):
		return fmt.Errorf("%w: %v", errUsage, err)
	case err != nil:
		return err
	}
	fmt.Fprintf(out, "policy %s is now version %d: %d in flight per key\n", name, cur.Version, cur.Slots)
	return nil
}

func fleet(ctx context.Context, s *remote.RedisStore, prefix, policy string, out io.Writer) error {
	members, err := s.Members(ctx, prefix, policy)
	if err != nil {
		return err
	}
	names := make([]string, 0, len(members))
	for m := range members {
		names = append(names, m)
	}
	sort.Strings(names)
	fmt.Fprintf(out, "%d limiters of %s\n", len(names), policy)
	for _, m := range names {
		fmt.Fprintf(out, "%s  last heartbeat %v ago\n", m, members[m].Round(time.Millisecond))
	}
	return nil
}
