package peers

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/go-redis/redis_rate/v10"
	guber "github.com/gubernator-io/gubernator/v2"
	"github.com/leasehold/leasehold/hybrid"
	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"github.com/leasehold/leasehold/remote"
	"github.com/redis/go-redis/v9"
	"github.com/sirupsen/logrus"
)

func TestMain(m *testing.M) { redistest.Main(m) }

// daemons is how many gubernator daemons run, and how many leasehold
// limiters stand beside them: one per process of a fleet of 4.
const daemons = 4

// The accuracy run: a token bucket of 1 000/s holding 1 000, offered
// twice its rate by 4 clients, one per daemon (or limiter), for 6 s.
const (
	accRate     = 1000
	accDemand   = 2 * accRate
	accDuration = 6 * time.Second
)

// A workload of the throughput runs: its keys and their limit.
type workload struct {
	name string
	rate int64 // per second, burst the same
	pick func(r *rand.Rand) string
}

var workloads = []workload{
	{name: "hot key, 10⁹/s", rate: 1e9, pick: func(*rand.Rand) string { return "hot" }},
	{name: "100 000 Zipf keys (s 1.1), 10/s each", rate: 10, pick: zipfPick(100_000)},
}

// zipfPick draws keys 0..n−1 by a Zipf law of exponent 1.1, one generator
// per goroutine (rand.Zipf is not safe for concurrent use).
func zipfPick(n uint64) func(r *rand.Rand) string {
	var zs sync.Map // *rand.Rand → *rand.Zipf
	return func(r *rand.Rand) string {
		z, ok := zs.Load(r)
		if !ok {
			z, _ = zs.LoadOrStore(r, rand.NewZipf(r, 1.1, 1, n-1))
		}
		return "k" + strconv.FormatUint(z.(*rand.Zipf).Uint64(), 10)
	}
}

// goroutines are the concurrency levels of the throughput runs.
var goroutines = []int{1, 16, 256}

// runFor is how long each throughput run lasts.
const runFor = 2 * time.Second

// A peer decides one request on key through client c (of daemons), under
// a token bucket of rate per second holding rate.
type peer struct {
	decide func(ctx context.Context, c int, key string) (bool, error)
	close  func()
}

// newPeer builds the implementation name for a limit of rate per second,
// with its keys under a prefix of its own.
type newPeer func(t *testing.T, prefix string, rate int64) peer

// TestPeers prints the table: accuracy at twice the limit, then
// decisions per second, latency, CPU and allocations per decision on
// each workload and concurrency level, for every implementation in one
// run. It runs only under LEASEHOLD_PEERS=1 (make bench-peers, about 2
// minutes, and the first compile of gubernator's dependencies).
func TestPeers(t *testing.T) {
	if os.Getenv("LEASEHOLD_PEERS") == "" {
		t.Skip("make bench-peers runs it (LEASEHOLD_PEERS=1)")
	}
	srv := redistest.Standalone(t)
	clients := startGubernator(t)
	impls := []struct {
		name string
		make newPeer
	}{
		{"gubernator (default: the key's owner decides)", gubernatorPeer(clients, guber.Behavior_BATCHING)},
		{"gubernator GLOBAL (local cache, 100 ms sync)", gubernatorPeer(clients, guber.Behavior_GLOBAL)},
		{"leasehold (4 limiters, one Redis)", leaseholdPeer(srv)},
		{"redis_rate (a round trip each)", redisRatePeer(srv)},
	}
	var b strings.Builder
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "accuracy: %d clients, one per daemon or limiter, on one key of %d/s holding %d, %v: at %d/s (2×), and as fast as 4 goroutines each go (flood)\tadmitted of Burst + Rate·t\tworst 1 s window (bound %d)\n",
		daemons, accRate, accRate, accDuration, accDemand, 2*accRate)
	for _, im := range impls {
		if strings.HasPrefix(im.name, "redis_rate") {
			continue // exact by construction: one script per decision
		}
		for _, flood := range []bool{false, true} {
			var shares, worsts []string
			for range accRuns {
				p := im.make(t, fmt.Sprintf("acc-%d:", time.Now().UnixNano()), accRate)
				share, worst := accuracy(p, flood)
				p.close()
				shares, worsts = append(shares, fmt.Sprintf("%.3f", share)), append(worsts, strconv.Itoa(worst))
			}
			how := "2×"
			if flood {
				how = "flood"
			}
			fmt.Fprintf(tw, "  %s, %s\t%s\t%s\n", im.name, how, strings.Join(shares, ", "), strings.Join(worsts, ", "))
		}
	}
	fmt.Fprintf(tw, "\nthroughput (%v a run; this process's CPU and allocations: gubernator's daemons run in it, Redis does not and has its own column)\tdecisions/s\tp50 / p99 / p99.9\tCPU µs/decision\tRedis CPU µs/decision\tallocs/decision\tadmitted\n", runFor)
	for _, w := range workloads {
		for _, g := range goroutines {
			fmt.Fprintf(tw, "%s, %d goroutines\t\t\t\t\t\t\n", w.name, g)
			for _, im := range impls {
				p := im.make(t, fmt.Sprintf("tp-%d:", time.Now().UnixNano()), w.rate)
				before := redisCPU(t, srv)
				r := throughput(p, w, g)
				rc := (redisCPU(t, srv) - before).Seconds() * 1e6 / (r.perSec * runFor.Seconds())
				p.close()
				fmt.Fprintf(tw, "  %s\t%.0f\t%v / %v / %v\t%.1f\t%.1f\t%.1f\t%.3f\n", im.name, r.perSec,
					r.p50.Round(time.Microsecond), r.p99.Round(time.Microsecond), r.p999.Round(time.Microsecond), r.cpuMicros, rc, r.allocs, r.admitted)
			}
		}
	}
	_ = tw.Flush()
	fmt.Print("\n" + b.String())
}

// accRuns is how many times each accuracy run is repeated: gubernator's
// GLOBAL overshoot varies from run to run.
const accRuns = 3

// redisCPU is the CPU time srv's Redis has used (INFO cpu).
func redisCPU(t *testing.T, srv *redistest.Server) time.Duration {
	info, err := srv.Client(t).Info(context.Background(), "cpu").Result()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	for _, line := range strings.Split(info, "\n") {
		k, v, ok := strings.Cut(strings.TrimSpace(line), ":")
		if ok && (k == "used_cpu_sys" || k == "used_cpu_user") {
			f, _ := strconv.ParseFloat(v, 64)
			sum += f
		}
	}
	return time.Duration(sum * float64(time.Second))
}

// startGubernator starts the daemons on loopback, each told of the
// others, and returns a client of each.
func startGubernator(t *testing.T) []guber.V1Client {
	quiet := logrus.New()
	quiet.SetOutput(io.Discard)
	var ds []*guber.Daemon
	var infos []guber.PeerInfo
	for i := range daemons {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		d, err := guber.SpawnDaemon(ctx, guber.DaemonConfig{
			Logger:            quiet.WithField("daemon", i),
			InstanceID:        "d" + strconv.Itoa(i),
			GRPCListenAddress: "127.0.0.1:0",
			HTTPListenAddress: "127.0.0.1:0",
			Behaviors:         guber.BehaviorConfig{GlobalSyncWait: 100 * time.Millisecond},
		})
		cancel()
		if err != nil {
			t.Fatalf("gubernator daemon %d: %v", i, err)
		}
		t.Cleanup(d.Close)
		addr := d.GRPCListeners[0].Addr().String()
		if _, _, err := net.SplitHostPort(addr); err != nil {
			t.Fatal(err)
		}
		d.PeerInfo = guber.PeerInfo{GRPCAddress: addr, HTTPAddress: d.HTTPListener.Addr().String()}
		ds = append(ds, d)
		infos = append(infos, d.PeerInfo)
	}
	clients := make([]guber.V1Client, len(ds))
	for i, d := range ds {
		d.SetPeers(infos)
		c, err := guber.DialV1Server(d.PeerInfo.GRPCAddress, nil)
		if err != nil {
			t.Fatal(err)
		}
		clients[i] = c
	}
	return clients
}

// gubernatorPeer decides through the daemons' clients with behaviour b,
// a token bucket of rate a second holding rate.
func gubernatorPeer(clients []guber.V1Client, b guber.Behavior) newPeer {
	return func(_ *testing.T, prefix string, rate int64) peer {
		return peer{decide: func(ctx context.Context, c int, key string) (bool, error) {
			resp, err := clients[c%len(clients)].GetRateLimits(ctx, &guber.GetRateLimitsReq{Requests: []*guber.RateLimitReq{{
				Name: "bench", UniqueKey: prefix + key, Hits: 1, Limit: rate, Burst: rate, Duration: 1000,
				Algorithm: guber.Algorithm_TOKEN_BUCKET, Behavior: b,
			}}})
			if err != nil {
				return false, err
			}
			r := resp.Responses[0]
			if r.Error != "" {
				return false, fmt.Errorf("gubernator: %s", r.Error)
			}
			return r.Status == guber.Status_UNDER_LIMIT, nil
		}, close: func() {}}
	}
}

// leaseholdPeer decides on one of daemons limiters sharing srv, each on a
// client of its own, as processes would.
func leaseholdPeer(srv *redistest.Server) newPeer {
	return func(t *testing.T, prefix string, rate int64) peer {
		lims := make([]*hybrid.Limiter, daemons)
		for i := range lims {
			l, err := hybrid.New(remote.NewRedis(srv.Client(t)), hybrid.Policy{Name: "bench", Limit: hybrid.Limit{Rate: rate, Period: time.Second, Burst: rate}},
				hybrid.WithPrefix(prefix), hybrid.WithLogger(slog.New(slog.DiscardHandler)))
			if err != nil {
				t.Fatal(err)
			}
			lims[i] = l
		}
		return peer{decide: func(ctx context.Context, c int, key string) (bool, error) {
			return lims[c%len(lims)].Allow(ctx, key), nil
		}, close: func() {
			for _, l := range lims {
				_ = l.Close(context.Background())
			}
		}}
	}
}

// redisRatePeer decides by go-redis/redis_rate on one client of srv.
func redisRatePeer(srv *redistest.Server) newPeer {
	return func(t *testing.T, prefix string, rate int64) peer {
		lim := redis_rate.NewLimiter(srv.Client(t, func(o *redis.Options) { o.PoolSize = 256 }))
		l := redis_rate.Limit{Rate: int(rate), Period: time.Second, Burst: int(rate)}
		return peer{decide: func(ctx context.Context, _ int, key string) (bool, error) {
			res, err := lim.Allow(ctx, prefix+key, l)
			if err != nil {
				return false, err
			}
			return res.Allowed > 0, nil
		}, close: func() {}}
	}
}

// accuracy offers p accDemand decisions a second on one key from daemons
// clients, 4 goroutines each at a steady pace (or as fast as they go,
// when flood), for accDuration, and returns what it admitted of
// Burst + Rate·t and the most it admitted in any 1 s window.
func accuracy(p peer, flood bool) (share float64, worst int) {
	var mu sync.Mutex
	var admitted []time.Duration
	var errCount atomic.Int64
	start := time.Now()
	var wg sync.WaitGroup
	const perClient = 4
	each := float64(accDemand) / (daemons * perClient)
	for c := range daemons {
		for j := range perClient {
			wg.Add(1)
			go func() {
				defer wg.Done()
				// Spread the goroutines over one interval.
				offset := time.Duration(float64(c*perClient+j) / (daemons * perClient) / each * float64(time.Second))
				for k := 0; ; k++ {
					at := offset + time.Duration(float64(k)/each*float64(time.Second))
					if flood {
						at = time.Since(start)
					}
					if at >= accDuration {
						return
					}
					if !flood {
						time.Sleep(time.Until(start.Add(at)))
					}
					ok, err := p.decide(context.Background(), c, "acc")
					if err != nil {
						errCount.Add(1)
						continue
					}
					if ok {
						mu.Lock()
						admitted = append(admitted, time.Since(start))
						mu.Unlock()
					}
				}
			}()
		}
	}
	wg.Wait()
	elapsed := time.Since(start)
	if n := errCount.Load(); n > 0 {
		fmt.Fprintf(os.Stderr, "accuracy: %d errors\n", n)
	}
	slices.Sort(admitted)
	for i, j := 0, 0; i < len(admitted); i++ {
		for admitted[i]-admitted[j] >= time.Second {
			j++
		}
		worst = max(worst, i-j+1)
	}
	return float64(len(admitted)) / (accRate + accRate*elapsed.Seconds()), worst
}

// result is one throughput run's figures.
type result struct {
	perSec, cpuMicros, allocs, admitted float64
	p50, p99, p999                      time.Duration
}

// throughput runs g goroutines deciding on w's keys through p as fast as
// they can for runFor (goroutine i on client i), timing one decision in
// 16.
func throughput(p peer, w workload, g int) result {
	var decided, allowed atomic.Int64
	var mu sync.Mutex
	var took []time.Duration
	var stop atomic.Bool
	var ms0, ms1 runtime.MemStats
	var ru0, ru1 syscall.Rusage
	runtime.GC()
	runtime.ReadMemStats(&ms0)
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru0)
	start := time.Now()
	var wg sync.WaitGroup
	for i := range g {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(i), 7))
			var mine []time.Duration
			for n := 0; !stop.Load(); n++ {
				key := w.pick(r)
				var t0 time.Time
				if n%16 == 0 {
					t0 = time.Now()
				}
				ok, err := p.decide(context.Background(), i, key)
				if n%16 == 0 {
					mine = append(mine, time.Since(t0))
				}
				if err == nil {
					decided.Add(1)
					if ok {
						allowed.Add(1)
					}
				}
			}
			mu.Lock()
			took = append(took, mine...)
			mu.Unlock()
		}()
	}
	time.Sleep(runFor)
	stop.Store(true)
	wg.Wait()
	elapsed := time.Since(start)
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru1)
	runtime.ReadMemStats(&ms1)
	n := float64(max(decided.Load(), 1))
	cpu := time.Duration(syscall.TimevalToNsec(ru1.Utime) - syscall.TimevalToNsec(ru0.Utime) + syscall.TimevalToNsec(ru1.Stime) - syscall.TimevalToNsec(ru0.Stime))
	slices.Sort(took)
	q := func(f float64) time.Duration {
		if len(took) == 0 {
			return 0
		}
		return took[min(int(f*float64(len(took))), len(took)-1)]
	}
	return result{perSec: n / elapsed.Seconds(), cpuMicros: float64(cpu.Microseconds()) / n, allocs: float64(ms1.Mallocs-ms0.Mallocs) / n,
		admitted: float64(allowed.Load()) / n, p50: q(0.5), p99: q(0.99), p999: q(0.999)}
}
