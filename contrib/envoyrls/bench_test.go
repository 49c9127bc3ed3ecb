package envoyrls

import (
	"bufio"
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	ratelimit "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/leasehold/leasehold/hybrid"
	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"github.com/leasehold/leasehold/remote"
)

// benchServerEnv makes the test binary a server for the benchmark: it
// serves the config in $LEASEHOLD_RLS_BENCH_CONFIG on the Redis at the
// env's address, prints its gRPC address, then "calls N" each time a line
// arrives on stdin, and exits when stdin closes.
const benchServerEnv = "LEASEHOLD_RLS_BENCH_SERVER"

func benchServer() int {
	c := redis.NewClient(&redis.Options{Addr: os.Getenv(benchServerEnv), ContextTimeoutEnabled: true})
	var n calls
	c.AddHook(&n)
	var rls rlsv3.RateLimitServiceServer = nullServer{}
	if conf := os.Getenv("LEASEHOLD_RLS_BENCH_CONFIG"); conf != "null" {
		cfg, err := Parse(map[string][]byte{"bench.yaml": []byte(conf)})
		if err != nil {
			fmt.Println("error", err)
			return 1
		}
		srv, err := NewServer(remote.NewRedis(c), cfg, WithLimiterOptions(hybrid.WithPrefix(fmt.Sprintf("bench-%d:", time.Now().UnixNano())),
			hybrid.WithLogger(slog.New(slog.DiscardHandler))))
		if err != nil {
			fmt.Println("error", err)
			return 1
		}
		defer srv.Close()
		rls = srv
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	gs := grpc.NewServer()
	rlsv3.RegisterRateLimitServiceServer(gs, rls)
	go gs.Serve(ln)
	defer gs.Stop()
	fmt.Println(ln.Addr().String())
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		fmt.Println("calls", n.n.Load())
	}
	return 0
}

// nullServer answers OK to every descriptor without deciding anything:
// the gRPC ceiling the service is measured against.
type nullServer struct {
	rlsv3.UnimplementedRateLimitServiceServer
}

func (nullServer) ShouldRateLimit(_ context.Context, req *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, error) {
	resp := &rlsv3.RateLimitResponse{OverallCode: rlsv3.RateLimitResponse_OK}
	for range req.GetDescriptors() {
		resp.Statuses = append(resp.Statuses, &rlsv3.RateLimitResponse_DescriptorStatus{Code: rlsv3.RateLimitResponse_OK})
	}
	return resp, nil
}

// calls is a go-redis hook that counts the commands sent, pipelined or
// not.
type calls struct{ n atomic.Int64 }

func (c *calls) DialHook(next redis.DialHook) redis.DialHook { return next }
func (c *calls) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error { c.n.Add(1); return next(ctx, cmd) }
}
func (c *calls) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error { c.n.Add(int64(len(cmds))); return next(ctx, cmds) }
}

// cpuSeconds reads a process's user + system CPU from /proc.
func cpuSeconds(pid int) (float64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+2:]))
	utime, _ := strconv.ParseFloat(f[11], 64)
	stime, _ := strconv.ParseFloat(f[12], 64)
	return (utime + stime) / 100, nil // USER_HZ: 100 on Linux
}

// BenchmarkShouldRateLimit drives the service over real gRPC on loopback:
// the server is this test binary run again as a process of its own, so
// its CPU is measured apart from the load generator's (8 or 16
// goroutines). Workloads, against real Redis:
//   - null: a server that answers OK without deciding (gRPC's ceiling);
//   - hot: one descriptor under its limit (1 000 000/s);
//   - cold10k: 10 000 descriptors of 100/s each, in turn.
//
// It reports requests per second of the server's CPU (req/s/core), p50
// and p99 latency at the client, and the server's Redis commands per
// 1 000 requests.
func BenchmarkShouldRateLimit(b *testing.B) {
	type workload struct {
		name, yaml string
		keys       int
	}
	var cases []workload
	for _, g := range []int{8, 16} {
		for _, w := range []workload{
			{"null", "null", 1},
			{"hot", "domain: bench\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: second, requests_per_unit: 1000000}", 1},
			{"cold10k", "domain: bench\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: second, requests_per_unit: 100}", 10000},
		} {
			w.name = fmt.Sprintf("%s/goroutines=%d", w.name, g)
			cases = append(cases, w)
		}
	}
	for _, bc := range cases {
		goroutines := 8
		if strings.HasSuffix(bc.name, "=16") {
			goroutines = 16
		}
		b.Run(bc.name, func(b *testing.B) {
			rs := redistest.Standalone(b)
			cmd := exec.Command(os.Args[0], "-test.run", "^$")
			cmd.Env = append(os.Environ(), benchServerEnv+"="+rs.Addr, "LEASEHOLD_RLS_BENCH_CONFIG="+bc.yaml)
			stdin, _ := cmd.StdinPipe()
			stdout, _ := cmd.StdoutPipe()
			if err := cmd.Start(); err != nil {
				b.Fatal(err)
			}
			defer func() { stdin.Close(); _ = cmd.Wait() }()
			out := bufio.NewScanner(stdout)
			line := func() string {
				if !out.Scan() {
					b.Fatalf("the server process said nothing: %v", out.Err())
				}
				return out.Text()
			}
			addr := line()
			if strings.HasPrefix(addr, "error") {
				b.Fatal(addr)
			}
			redisCalls := func() int64 {
				fmt.Fprintln(stdin)
				n, _ := strconv.ParseInt(strings.TrimPrefix(line(), "calls "), 10, 64)
				return n
			}
			conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
			if err != nil {
				b.Fatal(err)
			}
			defer conn.Close()
			client := rlsv3.NewRateLimitServiceClient(conn)
			reqs := make([]*rlsv3.RateLimitRequest, bc.keys)
			for i := range reqs {
				reqs[i] = &rlsv3.RateLimitRequest{Domain: "bench", Descriptors: []*ratelimit.RateLimitDescriptor{desc("tenant", fmt.Sprintf("t%d", i))}}
			}
			if _, err := client.ShouldRateLimit(context.Background(), reqs[0]); err != nil { // connect
				b.Fatal(err)
			}
			var next, over atomic.Int64
			var mu sync.Mutex
			var lat []time.Duration
			callsBefore := redisCalls()
			cpuBefore, err := cpuSeconds(cmd.Process.Pid)
			if err != nil {
				b.Fatal(err)
			}
			b.SetParallelism(max(goroutines/runtime.GOMAXPROCS(0), 1))
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				mine := make([]time.Duration, 0, 1024)
				for pb.Next() {
					req := reqs[int(next.Add(1))%len(reqs)]
					t0 := time.Now()
					resp, err := client.ShouldRateLimit(context.Background(), req)
					mine = append(mine, time.Since(t0))
					if err != nil {
						b.Error(err)
						return
					}
					if resp.GetOverallCode() != rlsv3.RateLimitResponse_OK {
						over.Add(1)
					}
				}
				mu.Lock()
				lat = append(lat, mine...)
				mu.Unlock()
			})
			b.StopTimer()
			cpuAfter, _ := cpuSeconds(cmd.Process.Pid)
			callsAfter := redisCalls()
			slices.Sort(lat)
			q := func(f float64) float64 { return float64(lat[int(f*float64(len(lat)-1))].Microseconds()) }
			b.ReportMetric(float64(b.N)/max(cpuAfter-cpuBefore, 0.01), "req/s/core")
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "req/s")
			b.ReportMetric(q(0.5), "p50-µs")
			b.ReportMetric(q(0.99), "p99-µs")
			b.ReportMetric(1000*float64(callsAfter-callsBefore)/float64(b.N), "redis/1000req")
			b.ReportMetric(100*float64(over.Load())/float64(b.N), "%over")
		})
	}
}
