package grpclimit

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/hybrid"
	"github.com/leasehold/leasehold/remote"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// serve starts a real loopback gRPC server (the health service) behind
// both interceptors, with a limit of 2 per hour per tenant, and returns a
// client of it.
func serve(t *testing.T) healthpb.HealthClient {
	t.Helper()
	clk := clock.NewManual(time.Unix(1_700_000_000, 0))
	lim, err := hybrid.New(remote.NewMemory(clk), hybrid.Policy{Name: "grpc", Limit: hybrid.Limit{Rate: 2, Period: time.Hour, Burst: 2}},
		hybrid.WithClock(clk), hybrid.WithMaxReservation(0), hybrid.WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = lim.Close(context.Background()) })
	c, _ := serveHealth(t, lim)
	return c
}

func tenant(name string) context.Context {
	return metadata.AppendToOutgoingContext(context.Background(), "x-tenant", name)
}

// TestUnaryAndStream: unary calls and stream openings share the tenant's
// bucket; the third is ResourceExhausted with a RetryInfo the client reads
// back; another tenant is unaffected; a call without a key is
// InvalidArgument.
func TestUnaryAndStream(t *testing.T) {
	c := serve(t)
	ctx := tenant("acme")
	if _, err := c.Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
		t.Fatalf("first call: %v", err)
	}
	stream, err := c.Watch(ctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); err != nil {
		t.Fatalf("second call (a stream): %v", err)
	}
	_, err = c.Check(ctx, &healthpb.HealthCheckRequest{})
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("third call: %v, want ResourceExhausted", err)
	}
	if d, ok := RetryDelay(err); !ok || d <= 0 || d > 30*time.Minute {
		t.Fatalf("RetryDelay = %v, %v; want the wait for one token (30 min at 2/h)", d, ok)
	}
	s2, err := c.Watch(ctx, &healthpb.HealthCheckRequest{})
	if err == nil {
		_, err = s2.Recv()
	}
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("stream over the limit: %v, want ResourceExhausted", err)
	}
	if _, err := c.Check(tenant("other"), &healthpb.HealthCheckRequest{}); err != nil {
		t.Fatalf("another tenant: %v", err)
	}
	_, err = c.Check(context.Background(), &healthpb.HealthCheckRequest{})
	if status.Code(err) != codes.InvalidArgument || status.Convert(err).Message() != "rate limit: cannot tell who is calling" {
		t.Fatalf("call without a key: %v, want InvalidArgument without internals", err)
	}
	if _, ok := RetryDelay(err); ok {
		t.Fatal("RetryDelay of a non-limit error reported ok")
	}
}
