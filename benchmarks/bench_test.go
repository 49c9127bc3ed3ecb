package benchmarks

import (
	"context"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/go-redis/redis_rate/v10"
	"github.com/leasehold/leasehold/hybrid"
	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"github.com/leasehold/leasehold/remote"
	"github.com/redis/go-redis/v9"
	"golang.org/x/time/rate"
)

func TestMain(m *testing.M) {
	if helperMain() {
		return
	}
	// The outage figures kill Redis under load, and go-redis logs every
	// failed dial of its pools: keep the results files readable.
	redis.SetLogger(quietRedis{})
	redistest.Main(m)
}

// quietRedis drops go-redis's internal log.
type quietRedis struct{}

func (quietRedis) Printf(context.Context, string, ...any) {}

// goroutines are the concurrency levels every workload runs at.
var goroutines = []int{1, 16, 256}

// BenchmarkLimiters runs every implementation on every workload at every
// concurrency level, on one real Redis. Names read
// impl=X/workload=Y/goroutines=G; besides ns/op and allocs each reports
// Redis commands and Redis CPU per 1 000 decisions (read from INFO, so
// they count everything the implementation sends: leases, returns,
// heartbeats, policy reads), decision latency percentiles (one decision in
// 16 timed), the share admitted, the heap each tracked key holds, and the
// p99 and p99.9 of the time goroutines waited for a core meanwhile
// (sched-p99-ns: at 256 goroutines on 2 cores a wait of milliseconds is
// common, and a decision's latency carries its goroutine's waits).
func BenchmarkLimiters(b *testing.B) {
	srv := redistest.Standalone(b)
	for _, w := range workloads {
		keys := keySet(w.keys)
		seq := w.sequence()
		for _, par := range goroutines {
			b.Run(benchName("hybrid", w, par), func(b *testing.B) {
				benchHybrid(b, srv, w, keys, seq, par, hybridSetup{})
			})
			if w.zipf { // where store calls dominate: is pipelining them worth it?
				b.Run(benchName("hybrid+autopipeline", w, par), func(b *testing.B) {
					benchHybrid(b, srv, w, keys, seq, par, hybridSetup{store: []remote.RedisOption{remote.WithAutoPipeline(true)}})
				})
				// Every call on the pool, none pipelined when the pool's
				// connections are all taken (the default before calls
				// beyond the pool were pipelined).
				b.Run(benchName("hybrid+pool", w, par), func(b *testing.B) {
					benchHybrid(b, srv, w, keys, seq, par, hybridSetup{store: []remote.RedisOption{remote.WithAutoPipeline(false)}})
				})
				// One pipeline per short tick: the pipeliner waits 100 µs
				// after each flush for more commands (go-redis's
				// recommended MaxFlushDelay) rather than flushing at once.
				b.Run(benchName("hybrid+autopipeline-tick", w, par), func(b *testing.B) {
					benchHybrid(b, srv, w, keys, seq, par, hybridSetup{store: []remote.RedisOption{remote.WithAutoPipeline(true)},
						client: func(o *redis.Options) {
							o.AutoPipelineOptions = &redis.AutoPipelineOptions{MaxFlushDelay: 100 * time.Microsecond}
						}})
				})
			}
			b.Run(benchName("redis_rate", w, par), func(b *testing.B) {
				benchRedisRate(b, srv, w, keys, seq, par)
			})
			b.Run(benchName("x-time-rate", w, par), func(b *testing.B) {
				benchLocal(b, w, keys, seq, par)
			})
		}
	}
}

// client returns a client of srv that counts its commands, with its pool
// already open so that the pool's buffers are not charged to the keys.
func client(b *testing.B, srv *redistest.Server, opts ...func(*redis.Options)) (*redis.Client, *counter) {
	c := srv.Client(b, append([]func(*redis.Options){func(o *redis.Options) { o.PoolSize = 64 }}, opts...)...)
	ctx := context.Background()
	var wg sync.WaitGroup
	for range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 4 {
				c.Ping(ctx)
			}
		}()
	}
	wg.Wait()
	calls := &counter{}
	c.AddHook(calls)
	return c, calls
}

// hybridSetup is how a hybrid row builds its limiter: options of the
// limiter, of its RedisStore, and of its go-redis client (nil: none).
type hybridSetup struct {
	limiter []hybrid.Option
	store   []remote.RedisOption
	client  func(*redis.Options)
}

func benchHybrid(b *testing.B, srv *redistest.Server, w workload, keys []string, seq []int32, par int, s hybridSetup) {
	ctx := context.Background()
	var copts []func(*redis.Options)
	if s.client != nil {
		copts = append(copts, s.client)
	}
	c, calls := client(b, srv, copts...)
	// A fresh policy name per run: no run inherits another's buckets.
	name := "bench-" + time.Now().Format("150405.000000")
	lim, err := hybrid.New(remote.NewRedis(c, s.store...), hybrid.Policy{Name: name, Limit: limit(w)},
		append([]hybrid.Option{hybrid.WithLogger(slog.New(slog.DiscardHandler))}, s.limiter...)...)
	if err != nil {
		b.Fatal(err)
	}
	defer lim.Close(ctx)
	decide := func(i int32) bool { return lim.Allow(ctx, keys[i]) }
	up := warm(w.keys, decide)
	// Per key the limiter tracks: idle keys may be forgotten during a
	// long warm-up.
	perKey := up.heap / float64(max(lim.Stats().KeysTracked, 1))
	m := startMeter(b, c, calls, par)
	start := time.Now()
	res := drive(b, par, seq, decide)
	elapsed := time.Since(start)
	m.report(b, int64(b.N))
	res.report(b)
	reportPerKey(b, w, perKey)
	if w.zipf {
		rate := float64(b.N) / elapsed.Seconds()
		walk := runWalk(seq, par, b.N)
		b.ReportMetric(w.idleFloor(walk, rate, up.before(start)), "floorcalls/1000")
		// A stock lease below the limit holds at most 10% of Burst,
		// spendable for a
		// lease TTL (1 s) or, future-dated, half a TTL more; joins within
		// 5 ms (above the store calls' median here) are free.
		b.ReportMetric(w.leaseCapFloor(walk, rate, max(1, w.burst/10), 1500*time.Millisecond, 5*time.Millisecond), "capfloorcalls/1000")
	}
}

func limit(w workload) hybrid.Limit {
	return hybrid.Limit{Rate: int64(w.rate), Period: time.Second, Burst: w.burst}
}

func benchRedisRate(b *testing.B, srv *redistest.Server, w workload, keys []string, seq []int32, par int) {
	c, calls := client(b, srv)
	decide := redisRateDecide(c, w, keys, "bench-rr-")
	up := warm(w.keys, decide)
	m := startMeter(b, c, calls, par)
	res := drive(b, par, seq, decide)
	m.report(b, int64(b.N))
	res.report(b)
	reportPerKey(b, w, up.heap/float64(w.keys))
}

// redisRateDecide returns a decision on keys[i] by redis_rate on c, at
// w's limit, under a fresh prefix (no run inherits another's buckets).
func redisRateDecide(c redis.UniversalClient, w workload, keys []string, prefix string) func(i int32) bool {
	ctx := context.Background()
	lim := redis_rate.NewLimiter(c)
	l := redis_rate.Limit{Rate: int(w.rate), Period: time.Second, Burst: int(w.burst)}
	prefix += time.Now().Format("150405.000000") + ":"
	rkeys := make([]string, len(keys))
	for i, k := range keys {
		rkeys[i] = prefix + k
	}
	return func(i int32) bool {
		res, err := lim.Allow(ctx, rkeys[i], l)
		return err == nil && res.Allowed > 0
	}
}

// benchLocal is the floor: golang.org/x/time/rate, one limiter per key in
// a sync.Map as a service tracking keys would hold them, shared by
// nothing outside the process.
func benchLocal(b *testing.B, w workload, keys []string, seq []int32, par int) {
	var m sync.Map
	decide := func(i int32) bool {
		v, ok := m.Load(keys[i])
		if !ok {
			v, _ = m.LoadOrStore(keys[i], rate.NewLimiter(rate.Limit(w.rate), int(min(w.burst, 1<<30))))
		}
		return v.(*rate.Limiter).Allow()
	}
	up := warm(w.keys, decide)
	res := drive(b, par, seq, decide)
	res.report(b)
	reportPerKey(b, w, up.heap/float64(w.keys))
}

// reportPerKey reports heap bytes per tracked key, after drive (ResetTimer
// drops metrics), for workloads with enough keys to drown the fixed
// costs (client buffers, pipeliner, histograms).
func reportPerKey(b *testing.B, w workload, perKey float64) {
	if w.keys >= 10_000 {
		b.ReportMetric(perKey, "B/key")
	}
}
