package grpclimit

import (
	"context"
	"log/slog"
	"net"
	"testing"
	"time"

	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/hybrid"
	"github.com/leasehold/leasehold/inflight"
	"github.com/leasehold/leasehold/remote"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
)

// TestActualCost: with WithActualCost a call is charged its estimate (10)
// and settled once its handler returns: a unary call that succeeds at 60,
// a failed one and a stream the client cancels at nothing. What the bucket
// of 100 (no refill: the clock stands) holds once the limiter is closed is
// 100 less the settled costs; a call whose estimate exceeds the burst is
// InvalidArgument. Leases that keep their tokens give all of them back at
// Close; a decaying lease (the default) gives them back only while its
// grant is the bucket's last write, and keeps a charge's refund under a
// line of its own, which Close cannot give back (the bucket then holds
// 20).
func TestActualCost(t *testing.T) {
	clk := clock.NewManual(time.Unix(1_700_000_000, 0))
	store := remote.NewMemory(clk)
	p := hybrid.Policy{Name: "grpc-cost", Limit: hybrid.Limit{Rate: 1, Period: time.Hour, Burst: 100}, Version: 1}
	lim, err := hybrid.New(store, p, hybrid.WithClock(clk), hybrid.WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	estimate := int64(10)
	opts := []Option{
		WithCost(func(context.Context, string) int64 { return estimate }),
		WithActualCost(func(_ context.Context, _ string, err error) int64 {
			if err != nil {
				return 0 // failed calls are free
			}
			return 60
		}),
	}
	c, s := serveHealth(t, lim, opts...)
	ctx := tenant("acme")
	if _, err := c.Check(ctx, &healthpb.HealthCheckRequest{Service: "up"}); err != nil {
		t.Fatalf("a call that succeeds: %v", err)
	}
	if _, err := c.Check(ctx, &healthpb.HealthCheckRequest{Service: "unknown"}); status.Code(err) != codes.NotFound {
		t.Fatalf("a call that fails: %v, want NotFound", err)
	}
	sctx, cancel := context.WithCancel(ctx)
	stream, err := c.Watch(sctx, &healthpb.HealthCheckRequest{Service: "up"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); err != nil {
		t.Fatal(err)
	}
	cancel() // the handler returns with the stream's error: settled at nothing
	estimate = 101
	if _, err := c.Check(ctx, &healthpb.HealthCheckRequest{Service: "up"}); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("a call costing more than the burst: %v, want InvalidArgument", err)
	}
	s.GracefulStop() // every handler has returned and settled
	if err := lim.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	res, err := store.Lease(context.Background(), remote.Request{Prefix: remote.DefaultPrefix, Policy: p.Name, Key: "acme",
		Limit: p.Limit, Version: 1, N: 100, Min: 1, Need: 1})
	if err != nil {
		t.Fatal(err)
	}
	if res.Granted != 40 {
		t.Fatalf("the bucket holds %d, want 40 (100 less 60 for the call that succeeded)", res.Granted)
	}
}

// TestInFlight: with WithInFlight, two open streams of a tenant take both
// of its slots: a call meanwhile is ResourceExhausted, with a RetryInfo;
// once a stream ends its slot serves the next call.
func TestInFlight(t *testing.T) {
	clk := clock.NewManual(time.Unix(1_700_000_000, 0))
	store := remote.NewMemory(clk)
	lim, err := hybrid.New(store, hybrid.Policy{Name: "grpc-rate", Limit: hybrid.Limit{Rate: 1, Period: time.Hour, Burst: 100}},
		hybrid.WithClock(clk), hybrid.WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	defer lim.Close(context.Background())
	sem, err := inflight.New(store, "grpc-in-flight", 2, inflight.WithClock(clk), inflight.WithFleetSize(1))
	if err != nil {
		t.Fatal(err)
	}
	defer sem.Close(context.Background())
	c, _ := serveHealth(t, lim, WithInFlight(sem))
	ctx := tenant("acme")
	var cancels []context.CancelFunc
	for range 2 {
		sctx, cancel := context.WithCancel(ctx)
		cancels = append(cancels, cancel)
		stream, err := c.Watch(sctx, &healthpb.HealthCheckRequest{Service: "up"})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := stream.Recv(); err != nil {
			t.Fatal(err)
		}
	}
	_, err = c.Check(ctx, &healthpb.HealthCheckRequest{Service: "up"})
	if d, ok := RetryDelay(err); status.Code(err) != codes.ResourceExhausted || !ok || d != time.Second {
		t.Fatalf("a third call in flight: %v (retry %v), want ResourceExhausted with a retry of 1 s", err, d)
	}
	cancels[0]()
	deadline := time.Now().Add(5 * time.Second)
	for {
		if _, err := c.Check(ctx, &healthpb.HealthCheckRequest{Service: "up"}); err == nil {
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("after a stream ended: %v", err)
		}
		time.Sleep(time.Millisecond) // polling with a deadline: the stream's handler returns on its own
	}
	cancels[1]()
}

// serveHealth starts a loopback gRPC server of the health service ("up"
// serving) behind both interceptors with opts, keyed by x-tenant, and
// returns a client of it and the server; both end with the test.
func serveHealth(t *testing.T, lim *hybrid.Limiter, opts ...Option) (healthpb.HealthClient, *grpc.Server) {
	t.Helper()
	key := ByMetadata("x-tenant")
	s := grpc.NewServer(grpc.UnaryInterceptor(UnaryServerInterceptor(lim, key, opts...)),
		grpc.StreamInterceptor(StreamServerInterceptor(lim, key, opts...)))
	hs := health.NewServer()
	hs.SetServingStatus("up", healthpb.HealthCheckResponse_SERVING)
	healthpb.RegisterHealthServer(s, hs)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = s.Serve(ln) }()
	t.Cleanup(s.Stop)
	conn, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return healthpb.NewHealthClient(conn), s
}
