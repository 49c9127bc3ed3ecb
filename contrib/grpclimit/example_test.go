package grpclimit_test

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"time"

	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/contrib/grpclimit"
	"github.com/leasehold/leasehold/hybrid"
	"github.com/leasehold/leasehold/remote"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// ExampleUnaryServerInterceptor limits each tenant (named in the
// "x-tenant" metadata) to 2 calls per hour on a real loopback server, and
// reads the retry delay back on the client. (A real service passes
// remote.NewRedis(rdb); the in-memory store keeps the example self-contained.)
func ExampleUnaryServerInterceptor() {
	clk := clock.NewManual(time.Unix(1_700_000_000, 0))
	lim, err := hybrid.New(remote.NewMemory(clk), hybrid.Policy{Name: "grpc", Limit: hybrid.Limit{Rate: 2, Period: time.Hour, Burst: 2}},
		hybrid.WithClock(clk), hybrid.WithMaxReservation(0), hybrid.WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		panic(err)
	}
	defer lim.Close(context.Background())
	key := grpclimit.ByMetadata("x-tenant")
	srv := grpc.NewServer(grpc.UnaryInterceptor(grpclimit.UnaryServerInterceptor(lim, key)),
		grpc.StreamInterceptor(grpclimit.StreamServerInterceptor(lim, key)))
	healthpb.RegisterHealthServer(srv, health.NewServer())
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		panic(err)
	}
	go func() { _ = srv.Serve(ln) }()
	defer srv.Stop()
	conn, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		panic(err)
	}
	defer conn.Close()
	client := healthpb.NewHealthClient(conn)
	ctx := metadata.AppendToOutgoingContext(context.Background(), "x-tenant", "acme")
	for i := 0; i < 3; i++ {
		_, err := client.Check(ctx, &healthpb.HealthCheckRequest{})
		delay, limited := grpclimit.RetryDelay(err)
		fmt.Println(status.Code(err), limited, delay)
	}
	// Output:
	// OK false 0s
	// OK false 0s
	// ResourceExhausted true 30m0s
}
