package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	ratelimit "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/leasehold/leasehold/internal/testkit/logtest"
	"github.com/leasehold/leasehold/internal/testkit/redistest"
)

func TestMain(m *testing.M) {
	redistest.MainWith(m, func() error { return goleak.Find() })
}

// TestFlags: -h exits 0 with the usage once; a bad flag exits 2 with one
// line that names it.
func TestFlags(t *testing.T) {
	for _, tc := range []struct {
		args []string
		code int
		has  string
	}{
		{[]string{"-h"}, 0, "usage: leasehold-rls"},
		{nil, 2, "-config is required"},
		{[]string{"-config", "x", "-nope"}, 2, "flag provided but not defined: -nope"},
		{[]string{"-config", "x", "-tls-cert", "c"}, 2, "-tls-cert and -tls-key go together"},
		{[]string{"-config", "x", "-headers", "fancy"}, 2, `-headers "fancy"`},
		{[]string{"-config", "x", "-outage", "maybe"}, 2, `-outage "maybe"`},
		{[]string{"-config", "/no/such/file", "-http", ""}, 1, "no such file"},
	} {
		var out, errOut strings.Builder
		code := run(context.Background(), tc.args, &out, &errOut, nil)
		all := out.String() + errOut.String()
		if code != tc.code || !strings.Contains(all, tc.has) || code == 2 && strings.Count(errOut.String(), "\n") != 1 {
			t.Errorf("%v: exit %d, want %d with %q:\n%s", tc.args, code, tc.code, tc.has, all)
		}
	}
}

// TestServe runs the binary's code on real Redis: it answers, serves the
// gRPC health service, reloads a changed config, keeps the old one when
// the new one is bad, and exits 0 when told to stop.
func TestServe(t *testing.T) {
	s := redistest.Standalone(t)
	dir := t.TempDir()
	file := filepath.Join(dir, "api.yaml")
	write := func(body string) {
		if err := os.WriteFile(file+".tmp", []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(file+".tmp", file); err != nil {
			t.Fatal(err)
		}
	}
	domain := "serve" + time.Now().Format("150405.000000")
	write("domain: " + domain + "\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: hour, requests_per_unit: 2}\n")
	ctx, cancel := context.WithCancel(context.Background())
	ready := make(chan string, 1)
	var code int
	var errOut logtest.Buffer // written by the server's goroutine, read here
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		code = run(ctx, []string{"-config", dir, "-redis", "redis://" + s.Addr, "-grpc", "127.0.0.1:0", "-http", "", "-reload", "20ms"}, &errOut, &errOut, ready)
	}()
	var addr string
	select {
	case addr = <-ready:
	case <-time.After(10 * time.Second):
		cancel()
		wg.Wait()
		t.Fatalf("never ready:\n%s", errOut.String())
	}
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client := rlsv3.NewRateLimitServiceClient(conn)
	ask := func(tenant string) rlsv3.RateLimitResponse_Code {
		resp, err := client.ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: domain,
			Descriptors: []*ratelimit.RateLimitDescriptor{{Entries: []*ratelimit.RateLimitDescriptor_Entry{{Key: "tenant", Value: tenant}}}}})
		if err != nil {
			t.Fatal(err)
		}
		return resp.GetOverallCode()
	}
	if h, err := healthpb.NewHealthClient(conn).Check(context.Background(), &healthpb.HealthCheckRequest{}); err != nil || h.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health: %v %v", h, err)
	}
	// admits is how many of 5 requests a fresh tenant gets.
	round := 0
	admits := func() int {
		round++
		n := 0
		for range 5 {
			if ask(fmt.Sprint("tenant-", round)) == rlsv3.RateLimitResponse_OK {
				n++
			}
		}
		return n
	}
	if n := admits(); n != 2 {
		t.Fatalf("2 an hour: %d of 5 admitted", n)
	}
	// A reload to 3 an hour: a new bucket for each tenant.
	write("domain: " + domain + "\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: hour, requests_per_unit: 3}\n")
	deadline := time.Now().Add(5 * time.Second)
	for admits() != 3 {
		if time.Now().After(deadline) {
			t.Fatal("the reload was never served")
		}
		time.Sleep(30 * time.Millisecond) // polling the reload with a deadline
	}
	write("domain: " + domain + "\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: fortnight, requests_per_unit: 3}\n")
	deadline = time.Now().Add(5 * time.Second)
	for !strings.Contains(errOut.String(), "config not reloaded") {
		if time.Now().After(deadline) {
			t.Fatalf("a bad config was not reported:\n%s", errOut.String())
		}
		time.Sleep(20 * time.Millisecond) // polling the log with a deadline
	}
	if n := admits(); n != 3 {
		t.Fatalf("after a bad reload: %d of 5 admitted, want the old config's 3", n)
	}
	cancel()
	wg.Wait()
	if code != 0 || !strings.Contains(errOut.String(), "draining") || !strings.Contains(errOut.String(), "fortnight") {
		t.Fatalf("exit %d:\n%s", code, errOut.String())
	}
}
