package benchmarks

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-redis/redis_rate/v10"
	"github.com/leasehold/leasehold/hybrid"
	"github.com/leasehold/leasehold/internal/testkit/helperproc"
	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"github.com/leasehold/leasehold/remote"
	"github.com/redis/go-redis/v9"
)

// The key-at-its-limit workload: several OS processes, each with its own
// limiter and client, hammer one key whose limit they exceed many times
// over. What matters there is what each admission costs in store calls,
// and whether the fleet gets its limit (utilization), no more.
const (
	atLimitProcs      = 4
	atLimitGoroutines = 16
	atLimitRate       = 2000 // per second
	atLimitBurst      = 200
	atLimitDuration   = 5 * time.Second
)

// helperEnv names the environment variable that turns the test binary into
// one process of the fleet; its value is the implementation to run.
const helperEnv = "LEASEHOLD_BENCH_HELPER"

// helperReport is what one process of the fleet measured.
type helperReport struct {
	Decisions int64
	Admitted  int64
	Calls     int64           // commands sent to Redis
	Leases    int64           // hybrid only: bucket calls (Stats.StoreCalls), without heartbeats and policy reads
	Elapsed   time.Duration   // from the common start to this process's last decision
	Samples   []time.Duration // one decision in sampleEvery
}

// BenchmarkAtLimit runs the key-at-its-limit workload for hybrid (with
// its defaults, and with capacity leases of a 15 s term) and redis_rate
// (x/time/rate has no shared state to be at a limit of). Each
// run lasts atLimitDuration whatever b.N. Besides the Redis figures per
// 1 000 decisions it reports Redis commands per 1 000 admitted and the
// fleet's utilization of its exact bound Burst + Rate·t.
func BenchmarkAtLimit(b *testing.B) {
	srv := redistest.Standalone(b)
	for _, impl := range []string{"hybrid", "hybrid-grants", "redis_rate"} {
		name := fmt.Sprintf("impl=%s/workload=at-limit-%dprocs/goroutines=%d", impl, atLimitProcs, atLimitProcs*atLimitGoroutines)
		b.Run(name, func(b *testing.B) { benchAtLimit(b, srv, impl) })
	}
}

func benchAtLimit(b *testing.B, srv *redistest.Server, impl string) {
	c := srv.Client(b)
	key := "at-limit-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	m := startMeter(b, c, nil, 0)
	start := time.Now().Add(500 * time.Millisecond) // every process starts together
	reports := make([]helperReport, atLimitProcs)
	var wg sync.WaitGroup
	errs := make([]error, atLimitProcs)
	for p := range atLimitProcs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := helperproc.Run([]string{helperEnv + "=" + impl, "BENCH_ADDR=" + srv.Addr, "BENCH_KEY=" + key,
				"BENCH_START=" + strconv.FormatInt(start.UnixNano(), 10)}, &reports[p]); err != nil {
				errs[p] = fmt.Errorf("process %d: %w", p, err)
			}
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			b.Fatal(err)
		}
	}
	var all result
	var decisions, calls, leases int64
	var elapsed time.Duration
	for _, r := range reports {
		decisions += r.Decisions
		calls += r.Calls
		leases += r.Leases
		elapsed = max(elapsed, r.Elapsed)
		all.admitted.Add(r.Admitted)
		all.samples = append(all.samples, r.Samples...)
	}
	m.report(b, decisions)
	admitted := all.admitted.Load()
	b.ReportMetric(float64(calls)/float64(decisions)*1000, "storecalls/1000")
	b.ReportMetric(float64(calls)/float64(max(admitted, 1))*1000, "storecalls/1000admitted")
	if leases > 0 {
		b.ReportMetric(float64(leases)/float64(max(admitted, 1))*1000, "bucketcalls/1000admitted")
	}
	bound := atLimitBurst + atLimitRate*elapsed.Seconds()
	b.ReportMetric(float64(admitted)/bound*100, "%utilization")
	all.report(b)
	// b.N is not the number of decisions here: per-decision figures are
	// over the decisions the fleet made.
	b.ReportMetric(float64(elapsed.Nanoseconds())/float64(decisions)*atLimitProcs*atLimitGoroutines, "ns/op")
	b.ReportMetric(float64(admitted)/float64(decisions)*100, "%admitted")
}

// helperMain runs this process as one member of the at-limit fleet when
// the environment says so, writing its report to stdout; it returns false
// in a normal test run.
func helperMain() bool {
	impl := os.Getenv(helperEnv)
	if impl == "" {
		return false
	}
	run := func() error { return runHelper(impl) }
	if impl == "util" || impl == "util-redis_rate" {
		run = func() error { return runUtilHelper(impl == "util-redis_rate") }
	}
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	return true
}

func runHelper(impl string) error {
	ctx := context.Background()
	startNs, err := strconv.ParseInt(os.Getenv("BENCH_START"), 10, 64)
	if err != nil {
		return err
	}
	key := os.Getenv("BENCH_KEY")
	c := redis.NewClient(&redis.Options{Addr: os.Getenv("BENCH_ADDR"), ContextTimeoutEnabled: true})
	defer c.Close()
	calls := &counter{}
	c.AddHook(calls)
	var decide func() bool
	var leases func() int64
	switch impl {
	case "hybrid", "hybrid-grants":
		opts := []hybrid.Option{hybrid.WithLogger(slog.New(slog.DiscardHandler))}
		if impl == "hybrid-grants" {
			opts = append(opts, hybrid.WithCapacityLeases(15*time.Second))
		}
		opts = append(opts, variantOptions()...) // make figures's variant
		lim, err := hybrid.New(remote.NewRedis(c),
			hybrid.Policy{Name: "at-limit", Limit: hybrid.Limit{Rate: atLimitRate, Period: time.Second, Burst: atLimitBurst}},
			opts...)
		if err != nil {
			return err
		}
		defer lim.Close(ctx)
		decide = func() bool { return lim.Allow(ctx, key) }
		leases = func() int64 { return lim.Stats().StoreCalls }
	case "redis_rate":
		lim := redis_rate.NewLimiter(c)
		l := redis_rate.Limit{Rate: atLimitRate, Period: time.Second, Burst: atLimitBurst}
		decide = func() bool {
			res, err := lim.Allow(ctx, key, l)
			return err == nil && res.Allowed > 0
		}
	default:
		return fmt.Errorf("unknown implementation %q", impl)
	}
	time.Sleep(time.Until(time.Unix(0, startNs)))
	end := time.Now().Add(atLimitDuration)
	var rep helperReport
	var mu sync.Mutex
	var decisions, admitted atomic.Int64
	var wg sync.WaitGroup
	for range atLimitGoroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var samples []time.Duration
			var n, ok int64
			for ; ; n++ {
				if n%sampleEvery == 0 {
					if time.Now().After(end) {
						break
					}
					t := time.Now()
					if decide() {
						ok++
					}
					samples = append(samples, time.Since(t))
					continue
				}
				if decide() {
					ok++
				}
			}
			decisions.Add(n)
			admitted.Add(ok)
			mu.Lock()
			rep.Samples = append(rep.Samples, samples...)
			mu.Unlock()
		}()
	}
	wg.Wait()
	rep.Calls = calls.n.Load()
	if leases != nil {
		rep.Leases = leases()
	}
	rep.Elapsed = time.Since(time.Unix(0, startNs))
	rep.Decisions, rep.Admitted = decisions.Load(), admitted.Load()
	return json.NewEncoder(os.Stdout).Encode(rep)
}
