// Command leasehold is the operator's view of leasehold's Redis state: a
// key's bucket, a policy's record (show and set, versioned), and a
// policy's live fleet. It works on a standalone Redis and on Cluster.
//
// Usage:
//
//	leasehold [-addr host:port[,host:port...]] [-cluster] [-prefix p] bucket POLICY KEY
//	leasehold [flags] policy show POLICY
//	leasehold [flags] policy set POLICY -version V -rate R -period D -burst B
//	leasehold [flags] policy delete POLICY
//	leasehold [flags] fleet POLICY
//
// It exits 0 on success, 1 when the store refuses (a stale version, an
// unknown policy, Redis unreachable) and 2 on bad usage.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"github.com/leasehold/leasehold/internal/keys"
	"io"
	"maps"
	"os"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/leasehold/leasehold/local"
	"github.com/leasehold/leasehold/remote"
	"github.com/redis/go-redis/v9"
)

func main() { os.Exit(run(os.Args[1:], os.Stdout, os.Stderr)) }

// errUsage marks a mistake in the command line (exit 2).
var errUsage = errors.New("usage")

func run(args []string, stdout, stderr io.Writer) int {
	fl := flag.NewFlagSet("leasehold", flag.ContinueOnError)
	fl.SetOutput(stderr)
	addr := fl.String("addr", "127.0.0.1:6379", "Redis address (comma-separated seed nodes with -cluster)")
	cluster := fl.Bool("cluster", false, "the address is a Redis Cluster")
	prefix := fl.String("prefix", remote.DefaultPrefix, "key prefix the limiters use (hybrid.WithPrefix)")
	timeout := fl.Duration("timeout", 3*time.Second, "how long to wait for Redis")
	if err := fl.Parse(args); err != nil {
		return 2
	}
	var c redis.UniversalClient
	if *cluster {
		c = redis.NewClusterClient(&redis.ClusterOptions{Addrs: strings.Split(*addr, ","), ContextTimeoutEnabled: true, MaxRetries: 1})
	} else {
		c = redis.NewClient(&redis.Options{Addr: *addr, ContextTimeoutEnabled: true, MaxRetries: 1})
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	err := command(ctx, remote.NewRedis(c), *prefix, fl.Args(), stdout)
	switch {
	case errors.Is(err, errUsage):
		fmt.Fprintln(stderr, "leasehold:", err)
		fl.Usage()
		return 2
	case errors.Is(err, remote.ErrUnavailable):
		fmt.Fprintf(stderr, "leasehold: cannot reach Redis at %s: %v\n", *addr, err)
		return 1
	case err != nil:
		fmt.Fprintln(stderr, "leasehold:", err)
		return 1
	}
	return 0
}

func command(ctx context.Context, s *remote.RedisStore, prefix string, args []string, out io.Writer) error {
	switch {
	case len(args) == 3 && args[0] == "bucket":
		return bucket(ctx, s, prefix, args[1], args[2], out)
	case len(args) == 3 && args[0] == "policy" && args[1] == "show":
		return showPolicy(ctx, s, prefix, args[2], out)
	case len(args) >= 3 && args[0] == "policy" && args[1] == "set":
		return setPolicy(ctx, s, prefix, args[2], args[3:], out)
	case len(args) == 3 && args[0] == "policy" && args[1] == "delete":
		return deletePolicy(ctx, s, prefix, args[2], out)
	case len(args) == 2 && args[0] == "fleet":
		return fleet(ctx, s, prefix, args[1], out)
	}
	return fmt.Errorf("%w: want bucket POLICY KEY, policy show POLICY, policy set POLICY ..., policy delete POLICY, or fleet POLICY", errUsage)
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
	if !ok {
		return fmt.Errorf("policy %q: no record at %s", name, keys.Policy(prefix, name))
	}
	if err := s.Client().Del(ctx, keys.Policy(prefix, name)).Err(); err != nil {
		return fmt.Errorf("policy %q: %w: %v", name, remote.ErrUnavailable, err)
	}
	fmt.Fprintf(out, "policy %s deleted (was version %d: %v); publish a new one with a version above %d\n", name, rec.Version, rec.Limit, rec.Version)
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
	fmt.Fprintf(out, "level      %d of %d\nlimit      %v\nversion    %d\nnext token %v\nfull in    %v\nttl        %v\n",
		b.Level, b.Limit.Burst, b.Limit, b.Version, b.NextToken, b.ResetAfter, b.TTL)
	return nil
}

func showPolicy(ctx context.Context, s *remote.RedisStore, prefix, name string, out io.Writer) error {
	rec, ok, err := s.GetPolicy(ctx, prefix, name)
	if err != nil {
		return err
	}
	if !ok {
		return fmt.Errorf("policy %q: no record at %s (no limiter has published it, or it expired)", name, keys.Policy(prefix, name))
	}
	fmt.Fprintf(out, "policy  %s\nversion %d\nlimit   %v\n", name, rec.Version, rec.Limit)
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
	return nil
}

func setPolicy(ctx context.Context, s *remote.RedisStore, prefix, name string, args []string, out io.Writer) error {
	fl := flag.NewFlagSet("policy set", flag.ContinueOnError)
	fl.SetOutput(io.Discard)
	version := fl.Uint64("version", 0, "new version, above the one in force")
	rate := fl.Int64("rate", 0, "tokens per period")
	period := fl.Duration("period", time.Second, "refill period")
	burst := fl.Int64("burst", 0, "bucket size (default: rate)")
	if err := fl.Parse(args); err != nil {
		return fmt.Errorf("%w: policy set: %v", errUsage, err)
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
