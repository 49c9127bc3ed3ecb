package main

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/hybrid"
	"github.com/leasehold/leasehold/inflight"
	"github.com/leasehold/leasehold/internal/testkit/logtest"
	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"github.com/leasehold/leasehold/local"
	"github.com/leasehold/leasehold/remote"
	"github.com/redis/go-redis/v9"
)

func TestMain(m *testing.M) { redistest.Main(m) }

func cli(args ...string) (int, string, string) {
	var out, errOut strings.Builder
	code := run(args, &out, &errOut)
	return code, out.String(), errOut.String()
}

// TestCommands runs every command against a real standalone Redis and a
// real cluster, on state a real limiter wrote.
func TestCommands(t *testing.T) {
	for _, tc := range []struct {
		name  string
		flags []string
		dial  func(t *testing.T) redis.UniversalClient
	}{
		{"standalone", nil, func(t *testing.T) redis.UniversalClient { return redistest.Standalone(t).Client(t) }},
		{"cluster", []string{"-cluster"}, func(t *testing.T) redis.UniversalClient { return redistest.SharedCluster(t).Client(t) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := tc.dial(t)
			addr := strings.Join(addrsOf(c), ",")
			flags := append([]string{"-addr", addr}, tc.flags...)
			name := "cli-" + tc.name + time.Now().Format("150405.000000")
			// A store timeout far above any round trip on a loaded machine:
			// the three decisions must reach the bucket, not the degraded
			// share a slow call falls back to (this tests the CLI, not
			// slowness).
			lim, err := hybrid.New(remote.NewRedis(c), hybrid.Policy{Name: name, Limit: hybrid.Limit{Rate: 1, Period: time.Hour, Burst: 10}},
				hybrid.WithLogger(slog.New(slog.DiscardHandler)), hybrid.WithHeartbeat(50*time.Millisecond, time.Second),
				hybrid.WithStoreTimeout(10*time.Second))
			if err != nil {
				t.Fatal(err)
			}
			defer lim.Close(context.Background())
			for i := 0; i < 3; i++ {
				lim.Allow(context.Background(), "tenant:{7}")
			}
			code, out, errOut := cli(append(flags, "bucket", name, "tenant:{7}")...)
			if code != 0 || !strings.Contains(out, "level      7 of 10") || !strings.Contains(out, "limit      1/1h0m0s burst 10") ||
				!strings.Contains(out, "next token") {
				t.Fatalf("bucket: %d\n%s%s", code, out, errOut)
			}
			if code, out, _ := cli(append(flags, "bucket", name, "never-used")...); code != 0 || !strings.Contains(out, "no bucket: full") {
				t.Fatalf("bucket of an unused key: %d %s", code, out)
			}
			if code, out, errOut := cli(append(flags, "policy", "set", name, "-version", "2", "-rate", "5", "-period", "1m")...); code != 0 ||
				!strings.Contains(out, "version 2: 5/1m0s burst 5") {
				t.Fatalf("policy set: %d %s%s", code, out, errOut)
			}
			if code, out, _ := cli(append(flags, "policy", "show", name)...); code != 0 || !strings.Contains(out, "version 2") {
				t.Fatalf("policy show: %d %s", code, out)
			}
			if code, _, errOut := cli(append(flags, "policy", "set", name, "-version", "2", "-rate", "9")...); code != 1 ||
				!strings.Contains(errOut, "version 2 is stale: version 2 (5/1m0s burst 5) is in force") {
				t.Fatalf("stale policy set: %d %s", code, errOut)
			}
			if code, _, errOut := cli(append(flags, "policy", "show", "no-such-policy")...); code != 1 || !strings.Contains(errOut, "no record") {
				t.Fatalf("unknown policy: %d %s", code, errOut)
			}
			// A shaped policy: show prints its shape, and set changes its own
			// limit and keeps the rest.
			shaped := name + "-shaped"
			rec := remote.PolicyRecord{Version: 1, Limit: local.PerSecond(10), Window: true, Also: []local.Limit{local.PerHour(1000)},
				Tiers: map[string]remote.TierRecord{"paid": {Limit: local.PerSecond(100)}}}
			if _, _, err := remote.NewRedis(c).SetPolicy(context.Background(), "", shaped, rec); err != nil {
				t.Fatal(err)
			}
			if code, out, errOut := cli(append(flags, "policy", "set", shaped, "-version", "2", "-rate", "20")...); code != 0 {
				t.Fatalf("policy set on a shaped policy: %d %s%s", code, out, errOut)
			}
			code, out, _ = cli(append(flags, "policy", "show", shaped)...)
			for _, want := range []string{"limit   20/1s burst 20", "algorithm sliding-window", "also    1000/1h0m0s burst 1000", "tier    paid: 100/1s burst 100"} {
				if code != 0 || !strings.Contains(out, want) {
					t.Fatalf("policy show of a shaped policy: %d, want %q in\n%s", code, want, out)
				}
			}
			deadline := time.Now().Add(5 * time.Second)
			for {
				code, out, _ := cli(append(flags, "fleet", name)...)
				if code == 0 && strings.HasPrefix(out, "1 limiters of "+name) {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("fleet: %d %s", code, out)
				}
				time.Sleep(20 * time.Millisecond) // polling the heartbeat with a deadline
			}
		})
	}
}

func addrsOf(c redis.UniversalClient) []string {
	switch c := c.(type) {
	case *redis.Client:
		return []string{c.Options().Addr}
	case *redis.ClusterClient:
		return c.Options().Addrs
	}
	return nil
}

// TestErrors: a wrong address and bad usage say what is wrong.
func TestErrors(t *testing.T) {
	if code, _, errOut := cli("-addr", "127.0.0.1:1", "-timeout", "500ms", "policy", "show", "p"); code != 1 ||
		!strings.Contains(errOut, "cannot reach Redis at redis://127.0.0.1:1: dial tcp 127.0.0.1:1: connect: connection refused") ||
		strings.Count(errOut, "\n") != 1 {
		t.Fatalf("wrong address: %d %s", code, errOut)
	}
	if code, _, errOut := cli("frobnicate"); code != 2 || !strings.Contains(errOut, "usage") {
		t.Fatalf("bad usage: %d %s", code, errOut)
	}
}

// TestPolicyInCodeVersusStore follows the README: the CLI sets policy
// "api" to 500/s (version 3), then a service starts a limiter with 5/s in
// code. By default the record wins and a WARN names both; with
// PolicyFromCode the code's policy is published as version 4; after
// `policy delete` a new limiter publishes its own without a warning.
func TestPolicyInCodeVersusStore(t *testing.T) {
	c := redistest.Standalone(t).Client(t)
	addr := strings.Join(addrsOf(c), ",")
	ctx := context.Background()
	for _, tc := range []struct {
		name        string
		opts        []hybrid.Option
		wantLimit   hybrid.Limit
		wantVersion uint64
		wantWarn    string
	}{
		{"default: the record wins", nil, hybrid.PerSecond(500), 3, "the record wins"},
		{"PolicyFromCode", []hybrid.Option{hybrid.WithPolicyPrecedence(hybrid.PolicyFromCode)}, hybrid.PerSecond(5), 4, "publishing the code's"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			prefix := "readme" + time.Now().Format("150405.000000") + ":"
			flags := []string{"-addr", addr, "-prefix", prefix}
			if code, out, errOut := cli(append(flags, "policy", "set", "api", "-version", "3", "-rate", "500", "-period", "1s")...); code != 0 {
				t.Fatalf("policy set: %d %s%s", code, out, errOut)
			}
			var logs logtest.Buffer
			lim, err := hybrid.New(remote.NewRedis(c), hybrid.Policy{Name: "api", Limit: hybrid.PerSecond(5)},
				append(tc.opts, hybrid.WithPrefix(prefix), hybrid.WithLogger(slog.New(slog.NewTextHandler(&logs, nil))),
					hybrid.WithStoreTimeout(10*time.Second))...)
			if err != nil {
				t.Fatal(err)
			}
			defer lim.Close(ctx)
			lim.Allow(ctx, "customer-1") // the first lease reads the record first
			if got := lim.Policy(); got.Limit != tc.wantLimit || got.Version != tc.wantVersion {
				t.Fatalf("Policy() = %v v%d, want %v v%d", got.Limit, got.Version, tc.wantLimit, tc.wantVersion)
			}
			line := ""
			for _, l := range strings.Split(logs.String(), "\n") {
				if strings.Contains(l, "level=WARN") && strings.Contains(l, "differs from the store's record") {
					line = l
				}
			}
			if !strings.Contains(line, tc.wantWarn) || !strings.Contains(line, "code=\"v1 5/1s burst 5\"") ||
				!strings.Contains(line, "store=\"v3 500/1s burst 500\"") {
				t.Fatalf("no WARN naming both policies; log:\n%s", logs.String())
			}
			if code, out, _ := cli(append(flags, "policy", "show", "api")...); code != 0 || !strings.Contains(out, "version "+string(rune('0'+tc.wantVersion))) {
				t.Fatalf("policy show after New: %d %s", code, out)
			}
		})
	}
	t.Run("delete", func(t *testing.T) {
		prefix := "readme-del" + time.Now().Format("150405.000000") + ":"
		flags := []string{"-addr", addr, "-prefix", prefix}
		if code, out, errOut := cli(append(flags, "policy", "set", "api", "-version", "3", "-rate", "500")...); code != 0 {
			t.Fatalf("policy set: %d %s%s", code, out, errOut)
		}
		if code, out, errOut := cli(append(flags, "policy", "delete", "api")...); code != 0 || !strings.Contains(out, "deleted (was version 3") {
			t.Fatalf("policy delete: %d %s%s", code, out, errOut)
		}
		if code, _, errOut := cli(append(flags, "policy", "delete", "api")...); code != 1 || !strings.Contains(errOut, "no record") {
			t.Fatalf("second delete: %d %s", code, errOut)
		}
		var logs logtest.Buffer
		lim, err := hybrid.New(remote.NewRedis(c), hybrid.Policy{Name: "api", Limit: hybrid.PerSecond(5), Version: 4},
			hybrid.WithPrefix(prefix), hybrid.WithLogger(slog.New(slog.NewTextHandler(&logs, nil))), hybrid.WithStoreTimeout(10*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		defer lim.Close(ctx)
		lim.Allow(ctx, "customer-1")
		if got := lim.Policy(); got.Limit != hybrid.PerSecond(5) || strings.Contains(logs.String(), "differs") {
			t.Fatalf("after delete: Policy() = %v, log:\n%s", got.Limit, logs.String())
		}
	})
}

// TestUsage: per-command help, exit codes, and the URL from a flag or the
// environment.
func TestUsage(t *testing.T) {
	for _, tc := range []struct {
		args     []string
		code     int
		out, err string
	}{
		{[]string{"-h"}, 0, "policy set POLICY", ""},
		{[]string{"slots", "-h"}, 0, "-tier string", ""},
		{[]string{"policy", "set", "api", "-slots", "5"}, 2, "", "needs -version"},
		{[]string{"policy", "set", "api", "-version", "2", "-slots", "5", "-rate", "3"}, 2, "", "takes no -rate"},
		{[]string{"fleet", "api", "-nope"}, 2, "", "flag provided but not defined: -nope"},
		{[]string{"policy", "set", "-h"}, 0, "-version uint", ""},
		{[]string{"bucket", "-h"}, 0, "usage: leasehold [flags] bucket POLICY KEY", ""},
		{[]string{"frobnicate"}, 2, "", `unknown command "frobnicate"`},
		{[]string{"bucket", "api"}, 2, "", "want bucket POLICY KEY"},
		{[]string{"policy", "set", "api", "-rate", "x"}, 2, "", "invalid value"},
		{[]string{"policy", "set", "api", "-rate", "5"}, 2, "", "needs -version and -rate"},
		{[]string{"policy", "diff", "api", "-slots", "5"}, 2, "", "flag provided but not defined: -slots"},
		{[]string{"-url", "redis://h:1?nonsense=1", "fleet", "api"}, 2, "", "bad Redis URL"},
		{nil, 2, "", "no command"},
	} {
		code, out, errOut := cli(tc.args...)
		if code != tc.code || !strings.Contains(out, tc.out) || !strings.Contains(errOut, tc.err) {
			t.Errorf("leasehold %v = %d\nstdout %s\nstderr %s\nwant %d, %q, %q", tc.args, code, out, errOut, tc.code, tc.out, tc.err)
		}
	}
	s := redistest.Standalone(t)
	name := "cli-url" + time.Now().Format("150405.000000")
	if code, out, errOut := cli("-url", "redis://"+s.Addr+"/0", "policy", "set", name, "-version", "1", "-rate", "7"); code != 0 {
		t.Fatalf("policy set by -url: %d %s%s", code, out, errOut)
	}
	t.Setenv("LEASEHOLD_REDIS_URL", "redis://"+s.Addr)
	if code, out, errOut := cli("policy", "show", name); code != 0 || !strings.Contains(out, "7/1s burst 7") {
		t.Fatalf("policy show by $LEASEHOLD_REDIS_URL: %d %s%s", code, out, errOut)
	}
	if code, out, errOut := cli("policy", "set", name, "-version", "2", "-rate", "-5"); code != 2 {
		t.Fatalf("an invalid limit: %d %s%s, want exit 2", code, out, errOut)
	}
	// policy diff: the record (7/1s) against what a service's code says.
	if code, out, errOut := cli("policy", "diff", name, "-rate", "420", "-period", "1m", "-burst", "7"); code != 0 || !strings.Contains(out, "as yours") {
		t.Fatalf("policy diff, same limit in other units: %d %s%s", code, out, errOut)
	}
	if code, out, errOut := cli("policy", "diff", name, "-rate", "5"); code != 1 || !strings.Contains(out, "the record (version 1) is 7/1s burst 7; yours is 5/1s burst 5") ||
		!strings.Contains(errOut, "PolicyFromCode") {
		t.Fatalf("policy diff, another limit: %d %s%s", code, out, errOut)
	}
}

// TestHelpOnce: -h prints the usage once, on stdout, and nothing on
// stderr; a bad global flag prints one error line and the usage once, on
// stderr.
func TestHelpOnce(t *testing.T) {
	code, out, errOut := cli("-h")
	if code != 0 || strings.Count(out, "usage: leasehold") != 1 || errOut != "" {
		t.Fatalf("-h: %d\nstdout %s\nstderr %s", code, out, errOut)
	}
	code, out, errOut = cli("policy", "show", "-h")
	if code != 0 || strings.Count(out, "usage: leasehold") != 1 || errOut != "" || !strings.Contains(out, "may also follow the command") {
		t.Fatalf("policy show -h: %d\nstdout %s\nstderr %s", code, out, errOut)
	}
	code, out, errOut = cli("-nope")
	if code != 2 || out != "" || strings.Count(errOut, "usage: leasehold") != 1 || !strings.HasPrefix(errOut, "leasehold: flag provided but not defined: -nope\n") {
		t.Fatalf("-nope: %d\nstdout %s\nstderr %s", code, out, errOut)
	}
}

// TestInFlightCommands: the CLI reads and sets the policy record of an
// in-flight limit a real inflight.Limiter published, shows which process
// holds a key's slots, and takes the global flags after the command.
func TestInFlightCommands(t *testing.T) {
	c := redistest.Standalone(t).Client(t)
	addr := strings.Join(addrsOf(c), ",")
	ctx := context.Background()
	name := "tenant-in-flight"
	prefix := "cli-inflight" + time.Now().Format("150405.000000") + ":"
	sem, err := inflight.New(remote.NewRedis(c), name, 50, inflight.WithPrefix(prefix), inflight.WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	defer sem.Close(ctx)
	if err := sem.Acquire(ctx, "tenant-1", 3); err != nil {
		t.Fatal(err)
	}
	defer sem.Release("tenant-1", 3)
	// The command first, the global flags after it.
	flags := []string{"-addr", addr, "-prefix", prefix}
	show := func() string {
		t.Helper()
		code, out, errOut := cli(append([]string{"policy", "show", name}, flags...)...)
		if code != 0 {
			t.Fatalf("policy show: %d %s%s", code, out, errOut)
		}
		return out
	}
	deadline := time.Now().Add(5 * time.Second)
	for !strings.Contains(show(), "slots   50 in flight per key") {
		if time.Now().After(deadline) {
			t.Fatalf("policy show never found the in-flight record:\n%s", show())
		}
		time.Sleep(20 * time.Millisecond) // polling the limiter's first publication with a deadline
	}
	if out := show(); !strings.Contains(out, "(in-flight limit)") || !strings.Contains(out, "version 1") || strings.Contains(out, "(rate limit)") {
		t.Fatalf("policy show:\n%s", out)
	}
	code, out, errOut := cli(append([]string{"slots", name, "tenant-1"}, flags...)...)
	if code != 0 || !strings.Contains(out, "limit      50 in flight (policy version 1)") || !strings.Contains(out, "by 1 processes") ||
		!strings.Contains(out, "term ends in") {
		t.Fatalf("slots: %d %s%s", code, out, errOut)
	}
	if code, out, _ := cli(append([]string{"slots", name, "nobody"}, flags...)...); code != 0 || !strings.Contains(out, "no slots held") {
		t.Fatalf("slots of an unused key: %d %s", code, out)
	}
	if code, out, errOut := cli(append([]string{"policy", "set", name, "-version", "2", "-slots", "20"}, flags...)...); code != 0 ||
		!strings.Contains(out, "version 2: 20 in flight per key") {
		t.Fatalf("policy set -slots: %d %s%s", code, out, errOut)
	}
	if code, _, errOut := cli(append([]string{"policy", "set", name, "-version", "2", "-slots", "30"}, flags...)...); code != 1 ||
		!strings.Contains(errOut, "version 2 is stale: version 2 (20 in flight) is in force") {
		t.Fatalf("stale policy set -slots: %d %s", code, errOut)
	}
	if code, _, errOut := cli(append([]string{"policy", "set", name, "-version", "3", "-slots", "0"}, flags...)...); code != 2 {
		t.Fatalf("policy set -slots 0 (no -slots): %d %s", code, errOut)
	}
	// The limiter adopts what the CLI set.
	deadline = time.Now().Add(5 * time.Second)
	for sem.Policy().Slots != 20 {
		if time.Now().After(deadline) {
			t.Fatalf("the limiter kept %+v", sem.Policy())
		}
		time.Sleep(20 * time.Millisecond) // polling the limiter's policy poll with a deadline
	}
	if code, out, errOut := cli(append([]string{"policy", "delete", name}, flags...)...); code != 0 || !strings.Contains(out, "in-flight policy "+name+" deleted (was version 2: 20 in flight)") {
		t.Fatalf("policy delete: %d %s%s", code, out, errOut)
	}
}
