// Command leasehold-demo serves a small API behind leasehold's HTTP
// middleware, loads it with a built-in client, and shows what happens on a
// status page: admitted and rejected requests per second, the limiter's
// mode and its fleet. It runs anywhere: Redis is an embedded miniredis
// unless -redis (or $LEASEHOLD_REDIS_URL) names a real one, as a
// host:port or a URL like the leasehold command's (redis://, rediss://
// with TLS, user:password@ for AUTH, master_name= for Sentinel,
// cluster=true for Cluster).
//
// Usage:
//
//	go run ./cmd/leasehold-demo                  # http://localhost:8080
//	go run ./cmd/leasehold-demo -redis 127.0.0.1:6379 -rate 100 -load 300
//	go run ./cmd/leasehold-demo -redis rediss://user:pass@redis.example:6380
//	go run ./cmd/leasehold-demo -outage 20s      # a 5 s store outage every 20 s
//
// The page's button (or POST /outage) cuts the store off and reconnects
// it, so a visitor sees degraded mode and the recovery.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/leasehold/leasehold/hybrid"
	"github.com/leasehold/leasehold/hybrid/httplimit"
	"github.com/leasehold/leasehold/internal/redisurl"
	"github.com/leasehold/leasehold/internal/testkit/storetest"
	"github.com/leasehold/leasehold/remote"
	"github.com/redis/go-redis/v9"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	os.Exit(exitCode(run(ctx, os.Args[1:], os.Stderr, nil), os.Stderr))
}

// errUsage marks a bad flag: exit 2, as the flag package's own programs do.
var errUsage = errors.New("bad usage")

// exitCode is 0 when the demo ran until interrupted or -h was asked for, 2
// for bad usage and 1 for anything else, reported in one line.
func exitCode(err error, stderr io.Writer) int {
	switch {
	case err == nil, errors.Is(err, context.Canceled), errors.Is(err, flag.ErrHelp):
		return 0
	case errors.Is(err, errUsage):
		fmt.Fprintln(stderr, "leasehold-demo:", err)
		return 2
	}
	fmt.Fprintln(stderr, "leasehold-demo:", err)
	return 1
}

// options are the demo's flags.
type options struct {
	addr, redis string
	rate, load  int
	outageEvery time.Duration
}

func parse(args []string, stderr io.Writer) (options, error) {
	var o options
	fl := flag.NewFlagSet("leasehold-demo", flag.ContinueOnError)
	fl.SetOutput(io.Discard) // -h prints the usage once, below; errors are one line
	fl.StringVar(&o.addr, "addr", "localhost:8080", "listen address")
	fl.StringVar(&o.redis, "redis", os.Getenv(redisurl.EnvVar), "Redis host:port or URL (default $"+redisurl.EnvVar+", else an embedded miniredis)")
	fl.IntVar(&o.rate, "rate", 50, "limit per second per tenant")
	fl.IntVar(&o.load, "load", 120, "requests per second the built-in client sends, per tenant (3 tenants)")
	fl.DurationVar(&o.outageEvery, "outage", 0, "cut the store off for 5 s every this long (0: only from the page)")
	if err := fl.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fmt.Fprintln(stderr, "usage: leasehold-demo [flags]\n\nA demo server: three tenants over their limit on one leasehold limiter, and a page at -addr that shows it.\n\nflags:")
			fl.SetOutput(stderr)
			fl.PrintDefaults()
			return o, err
		}
		return o, fmt.Errorf("%w: %v (-h lists the flags)", errUsage, err)
	}
	if fl.NArg() > 0 {
		return o, fmt.Errorf("%w: unexpected argument %q (-h lists the flags)", errUsage, fl.Arg(0))
	}
	if o.rate <= 0 || o.load < 0 {
		return o, fmt.Errorf("%w: -rate must be positive and -load not negative", errUsage)
	}
	return o, nil
}

// run serves until ctx ends. ready, if not nil, receives the address once
// the server listens.
func run(ctx context.Context, args []string, stderr io.Writer, ready chan<- string) error {
	o, err := parse(args, stderr)
	if err != nil {
		return err
	}
	rdb, cleanup, err := connect(o.redis)
	if err != nil {
		return err
	}
	defer cleanup()
	// The page's button cuts the store off, as a partition would.
	store := &storetest.Cut{Store: remote.NewRedis(rdb)}
	lim, err := hybrid.New(store, hybrid.Policy{Name: "demo", Limit: hybrid.PerSecond(int64(o.rate))},
		hybrid.WithLogger(slog.New(slog.NewTextHandler(stderr, nil))), hybrid.WithFleetSize(1))
	if err != nil {
		return err
	}
	defer lim.Close(context.Background())
	st := newStatus(lim, store)
	mux := http.NewServeMux()
	mux.Handle("/api/", httplimit.Middleware(lim, httplimit.ByHeader("X-Tenant"))(http.HandlerFunc(
		func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "hello") })))
	mux.HandleFunc("/status.json", st.serveJSON)
	mux.HandleFunc("/outage", st.toggle)
	mux.HandleFunc("/", st.servePage)
	ln, err := net.Listen("tcp", o.addr)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { <-ctx.Done(); _ = srv.Close() }()
	go st.sample(ctx)
	go loadGen(ctx, "http://"+ln.Addr().String(), o.load)
	if o.outageEvery > 0 {
		go st.outages(ctx, o.outageEvery, 5*time.Second)
	}
	fmt.Fprintf(stderr, "leasehold-demo: http://%s (limit %d/s per tenant, load %d/s per tenant)\n", ln.Addr(), o.rate, o.load)
	if ready != nil {
		ready <- ln.Addr().String()
	}
	if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return ctx.Err()
}

// connect returns a client of addr (host:port or a URL), or of an
// embedded miniredis when addr is empty.
func connect(addr string) (redis.UniversalClient, func(), error) {
	var mr *miniredis.Miniredis
	if addr == "" {
		mr = miniredis.NewMiniRedis()
		if err := mr.Start(); err != nil {
			return nil, nil, err
		}
		addr = mr.Addr()
	}
	if !strings.Contains(addr, "://") {
		addr = redisurl.FromAddr(addr)
	}
	c, _, err := redisurl.Dial(addr, redisurl.Settings{})
	if err != nil {
		if mr != nil {
			mr.Close()
		}
		return nil, nil, err
	}
	return c, func() {
		_ = c.Close()
		if mr != nil {
			mr.Close()
		}
	}, nil
}

// loadGen sends perTenant requests per second for each of three tenants
// until ctx ends.
func loadGen(ctx context.Context, base string, perTenant int) {
	if perTenant == 0 {
		return
	}
	client := &http.Client{Timeout: 2 * time.Second}
	tick := time.NewTicker(time.Second / time.Duration(perTenant))
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		for _, tenant := range []string{"acme", "globex", "initech"} {
			req, _ := http.NewRequestWithContext(ctx, http.MethodGet, base+"/api/hello", nil)
			req.Header.Set("X-Tenant", tenant)
			if resp, err := client.Do(req); err == nil {
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		}
	}
}
