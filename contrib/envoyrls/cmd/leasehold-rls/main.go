// Command leasehold-rls is Envoy's rate limit service on leasehold: it
// reads envoyproxy/ratelimit's YAML config and answers
// envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit over gRPC,
// each replica leasing tokens from one Redis.
//
// Usage:
//
//	leasehold-rls -config PATH [-redis URL] [-grpc ADDR] [-http ADDR]
//	              [-tls-cert F -tls-key F [-tls-client-ca F]]
//	              [-shadow] [-headers draft11|legacy] [-outage degraded|open|closed] [-reload D]
//
// PATH is a YAML file or a directory of them (one domain each). URL is a
// go-redis URL (rediss:// for TLS, user:password@, ?master_name= for
// Sentinel, ?cluster=true for Cluster), else $LEASEHOLD_REDIS_URL, else
// localhost:6379. -http serves /healthcheck, /json (a RateLimitRequest as
// JSON, as the reference's) and Prometheus /metrics. The gRPC health service is
// served beside the rate limit service. The config is read again every
// -reload; a bad one keeps the old config and is logged. SIGTERM or
// SIGINT drains calls in flight and closes the limiters, which gives their
// tokens back. A bad flag exits 2.
package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/leasehold/leasehold/contrib/envoyrls"
	"github.com/leasehold/leasehold/hybrid"
	"github.com/leasehold/leasehold/internal/redisurl"
	"github.com/leasehold/leasehold/remote"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stdout, os.Stderr, nil))
}

type options struct {
	config, redis, grpc, http string
	cert, key, clientCA       string
	shadow                    bool
	headers, outage           string
	reload                    time.Duration
}

var errUsage = errors.New("bad usage")

func parse(args []string, stdout io.Writer) (options, error) {
	var o options
	fl := flag.NewFlagSet("leasehold-rls", flag.ContinueOnError)
	fl.SetOutput(io.Discard)
	fl.StringVar(&o.config, "config", "", "YAML config file, or a directory of them (required)")
	fl.StringVar(&o.redis, "redis", os.Getenv(redisurl.EnvVar), "Redis URL (default $"+redisurl.EnvVar+", else redis://localhost:6379)")
	fl.StringVar(&o.grpc, "grpc", ":8081", "gRPC listen address")
	fl.StringVar(&o.http, "http", ":8080", "HTTP listen address (/healthcheck, /json, /metrics); empty for none")
	fl.StringVar(&o.cert, "tls-cert", "", "TLS certificate for the gRPC listener (with -tls-key)")
	fl.StringVar(&o.key, "tls-key", "", "TLS key for the gRPC listener")
	fl.StringVar(&o.clientCA, "tls-client-ca", "", "CA that client certificates must chain to (mutual TLS)")
	fl.BoolVar(&o.shadow, "shadow", false, "shadow mode for every rule: count, never refuse")
	fl.StringVar(&o.headers, "headers", "", "rate limit fields in responses: draft11 or legacy (default none)")
	fl.StringVar(&o.outage, "outage", "degraded", "with Redis away: degraded (each replica's share), open or closed")
	fl.DurationVar(&o.reload, "reload", 5*time.Second, "how often the config is read again (0: never)")
	if err := fl.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fmt.Fprintln(stdout, "usage: leasehold-rls -config PATH [flags]\n\nEnvoy's rate limit service on leasehold.\n\nflags:")
			fl.SetOutput(stdout)
			fl.PrintDefaults()
			return o, err
		}
		return o, fmt.Errorf("%w: %v", errUsage, err)
	}
	switch {
	case fl.NArg() > 0:
		return o, fmt.Errorf("%w: unexpected argument %q", errUsage, fl.Arg(0))
	case o.config == "":
		return o, fmt.Errorf("%w: -config is required", errUsage)
	case (o.cert == "") != (o.key == ""):
		return o, fmt.Errorf("%w: -tls-cert and -tls-key go together", errUsage)
	case o.clientCA != "" && o.cert == "":
		return o, fmt.Errorf("%w: -tls-client-ca needs -tls-cert and -tls-key", errUsage)
	case o.headers != "" && o.headers != "draft11" && o.headers != "legacy":
		return o, fmt.Errorf("%w: -headers %q: want draft11 or legacy", errUsage, o.headers)
	case o.outage != "degraded" && o.outage != "open" && o.outage != "closed":
		return o, fmt.Errorf("%w: -outage %q: want degraded, open or closed", errUsage, o.outage)
	}
	if o.redis == "" {
		o.redis = "redis://localhost:6379"
	}
	return o, nil
}

// run serves until ctx ends; ready, if not nil, gets the gRPC address.
func run(ctx context.Context, args []string, stdout, stderr io.Writer, ready chan<- string) int {
	o, err := parse(args, stdout)
	switch {
	case errors.Is(err, flag.ErrHelp):
		return 0
	case err != nil:
		fmt.Fprintln(stderr, "leasehold-rls:", err)
		return 2
	}
	log := slog.New(slog.NewTextHandler(stderr, nil))
	if err := serve(ctx, o, log, ready); err != nil {
		fmt.Fprintln(stderr, "leasehold-rls:", err)
		return 1
	}
	return 0
}

func serve(ctx context.Context, o options, log *slog.Logger, ready chan<- string) error {
	cfg, err := envoyrls.Load(o.config)
	if err != nil {
		return err
	}
	c, _, err := redisurl.Dial(o.redis, redisurl.Settings{})
	if err != nil {
		return err
	}
	defer c.Close()
	mode := map[string]hybrid.OutageMode{"degraded": hybrid.OutageDegraded, "open": hybrid.OutageFailOpen, "closed": hybrid.OutageFailClosed}[o.outage]
	headers := map[string]envoyrls.Headers{"": envoyrls.HeadersNone, "draft11": envoyrls.HeadersDraft11, "legacy": envoyrls.HeadersLegacy}[o.headers]
	srv, err := envoyrls.NewServer(remote.NewRedis(c), cfg, envoyrls.WithShadowMode(o.shadow), envoyrls.WithHeaders(headers),
		envoyrls.WithLogger(log), envoyrls.WithLimiterOptions(hybrid.WithOutageMode(mode), hybrid.WithLogger(log)))
	if err != nil {
		return err
	}
	defer srv.Close()
	l, err := listen(o, srv)
	if err != nil {
		return err
	}
	log.Info("leasehold-rls: serving", slog.String("grpc", l.grpcAddr), slog.String("http", o.http), slog.String("config", o.config))
	if ready != nil {
		ready <- l.grpcAddr
	}
	var tick <-chan time.Time
	if o.reload > 0 {
		t := time.NewTicker(o.reload)
		defer t.Stop()
		tick = t.C
	}
	for {
		select {
		case <-tick:
			next, err := envoyrls.Load(o.config)
			if err == nil {
				err = srv.Reload(next)
			}
			if err != nil {
				log.Warn("leasehold-rls: config not reloaded; the old one stays", slog.String("error", err.Error()))
			}
		case err := <-l.errc:
			l.grpc.Stop()
			return err
		case <-ctx.Done():
			log.Info("leasehold-rls: draining")
			l.drain()
			return srv.Close()
		}
	}
}

// listeners are the gRPC server (the rate limit and health services) and
// the HTTP one, serving; errc gets the error that stops either.
type listeners struct {
	grpc     *grpc.Server
	health   *health.Server
	http     *http.Server // nil without -http
	grpcAddr string
	errc     chan error
}

func listen(o options, srv *envoyrls.Server) (*listeners, error) {
	var gopts []grpc.ServerOption
	if o.cert != "" {
		tc, err := tlsConfig(o)
		if err != nil {
			return nil, err
		}
		gopts = append(gopts, grpc.Creds(credentials.NewTLS(tc)))
	}
	l := &listeners{grpc: grpc.NewServer(gopts...), health: health.NewServer(), errc: make(chan error, 2)}
	rlsv3.RegisterRateLimitServiceServer(l.grpc, srv)
	healthpb.RegisterHealthServer(l.grpc, l.health)
	ln, err := net.Listen("tcp", o.grpc)
	if err != nil {
		return nil, err
	}
	l.grpcAddr = ln.Addr().String()
	go func() { l.errc <- l.grpc.Serve(ln) }()
	if o.http != "" {
		hl, err := net.Listen("tcp", o.http)
		if err != nil {
			l.grpc.Stop()
			return nil, err
		}
		l.http = &http.Server{Handler: srv.HTTPHandler(), ReadHeaderTimeout: 5 * time.Second}
		go func() {
			if err := l.http.Serve(hl); !errors.Is(err, http.ErrServerClosed) {
				l.errc <- err
			}
		}()
	}
	return l, nil
}

// drain lets the calls in flight finish, then stops both servers.
func (l *listeners) drain() {
	l.health.Shutdown()
	l.grpc.GracefulStop()
	if l.http != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = l.http.Shutdown(ctx)
	}
}

func tlsConfig(o options) (*tls.Config, error) {
	cert, err := tls.LoadX509KeyPair(o.cert, o.key)
	if err != nil {
		return nil, err
	}
	tc := &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	if o.clientCA != "" {
		pem, err := os.ReadFile(o.clientCA)
		if err != nil {
			return nil, err
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("-tls-client-ca %s: no certificate in it", o.clientCA)
		}
		tc.ClientCAs, tc.ClientAuth = pool, tls.RequireAndVerifyClientCert
	}
	return tc, nil
}
