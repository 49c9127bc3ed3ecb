package benchmarks

import (
	"context"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-redis/redis_rate/v10"
	"github.com/redis/go-redis/v9"

	"github.com/leasehold/leasehold/hybrid"
	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"github.com/leasehold/leasehold/remote"
)

// BenchmarkEvalShaFloor is the least a decision that needs the store can
// allocate with go-redis, the field's client: one EVALSHA of a script that
// does nothing with one key and eleven numbers, as the bucket script takes
// them, and returns five numbers, as it answers. Issue 23 asks a cold
// decision for at most 4 allocations; this floor is what the client alone
// costs per call. BenchmarkColdDecisions measures whole cold decisions.
func BenchmarkEvalShaFloor(b *testing.B) {
	srv := redistest.Standalone(b)
	c := srv.Client(b)
	ctx := context.Background()
	script := redis.NewScript(`return {1, 2, 3, 4, 5}`)
	keys := []string{"leasehold:{floor:k}"}
	if err := script.Load(ctx, c).Err(); err != nil {
		b.Fatal(err)
	}
	b.Run("args=11-numbers", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := script.EvalSha(ctx, c, keys, "lease", 1, 1, 1, 100000, 10, 1, 0, -1000000, 1000, 1).Int64Slice(); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("args=none", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := script.EvalSha(ctx, c, keys).Int64Slice(); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// coldKeys is how many distinct keys BenchmarkColdDecisions walks: more
// than a run decides, so no key comes back within a run.
const coldKeys = 1 << 21

// BenchmarkColdDecisions is decisions that all need the store: every one
// on a key the process has not seen (a spread of new users, or keys back
// after the limiter forgot them), at 10/s burst 10, from 1, 16 and 256
// goroutines, hybrid beside redis_rate in the same run on one real Redis.
// It reports allocations per decision and the client's CPU per store
// call against redis_rate's per decision (issue 23 asks for at most 1.2×),
// and fails if fewer than 99% of hybrid's decisions were store calls: a
// benchmark of leased decisions would measure nothing cold.
//
// Each limiter's runs (testing.B runs a benchmark again with a larger N)
// walk on through its own keys from where the last stopped, so no run
// meets a key an earlier one decided; the two key sets are built once, so
// both limiters carry the same heap.
func BenchmarkColdDecisions(b *testing.B) {
	impls := coldLimiters(redistest.Standalone(b), coldKeySet())
	for _, par := range goroutines {
		for _, im := range impls {
			b.Run("limiter="+im.name+"/goroutines="+strconv.Itoa(par), func(b *testing.B) { im.run(b, par) })
		}
	}
}

// coldKeySet is the coldKeys keys the cold benchmarks walk.
func coldKeySet() []string {
	keys := make([]string, coldKeys)
	for i := range keys {
		keys[i] = "cold-" + strconv.Itoa(10_000_000+i)
	}
	return keys
}

// coldLimiters returns hybrid and redis_rate on srv, hybrid walking keys
// and redis_rate the same names under a prefix of its own: every decision
// on a key the limiter has not decided before.
func coldLimiters(srv *redistest.Server, keys []string) []benchImpl {
	run := strconv.FormatInt(time.Now().UnixNano(), 36)
	rkeys := make([]string, len(keys))
	for i := range keys {
		rkeys[i] = "cold-rr-" + run + ":" + keys[i]
	}
	var hybridAt, rrAt atomic.Int64
	w := workload{name: "cold", keys: coldKeys, rate: 10, burst: 10}
	return []benchImpl{
		{"hybrid", func(b *testing.B, par int) {
			ctx := context.Background()
			c, calls := client(b, srv)
			lim, err := hybrid.New(remote.NewRedis(c), hybrid.Policy{Name: "cold-" + run, Limit: limit(w)},
				hybrid.WithLogger(slog.New(slog.DiscardHandler)))
			if err != nil {
				b.Fatal(err)
			}
			defer lim.Close(ctx)
			coldRun(b, c, calls, par, keys, &hybridAt, func(k string) bool { return lim.Allow(ctx, k) })
		}},
		{"redis_rate", func(b *testing.B, par int) {
			ctx := context.Background()
			c, calls := client(b, srv)
			lim := redis_rate.NewLimiter(c)
			l := redis_rate.Limit{Rate: int(w.rate), Period: time.Second, Burst: int(w.burst)}
			coldRun(b, c, calls, par, rkeys, &rrAt, func(k string) bool {
				res, err := lim.Allow(ctx, k, l)
				return err == nil && res.Allowed > 0
			})
		}},
	}
}

// coldLayers returns, for TestColdRatios, the layers a cold decision of
// hybrid's passes through, each timed alone, walking keys under a name
// of its own: "store", hybrid's RedisStore answering a one-token lease,
// with no limiter, entry or breaker before it; "shape", go-redis sending the
// store's EVALSHA (its two keys and eleven arguments) to a script that
// only returns a reply of the bucket script's thirteen numbers; and
// "rr-shape", the same for redis_rate's command (one key, five
// arguments, four values). Beside hybrid and redis_rate in one run they
// split hybrid's client CPU per call: shape against rr-shape is what
// go-redis spends on the bigger command, each limiter against its shape
// is what its script's time in Redis and its own code add.
func coldLayers(srv *redistest.Server, keys []string) []benchImpl {
	run := strconv.FormatInt(time.Now().UnixNano(), 36)
	w := workload{name: "cold", keys: coldKeys, rate: 10, burst: 10}
	var storeAt, shapeAt, rrShapeAt atomic.Int64
	shape := func(at *atomic.Int64, reply string, cmd func(key string) ([]string, []any)) func(b *testing.B, par int) {
		return func(b *testing.B, par int) {
			ctx := context.Background()
			c, calls := client(b, srv)
			script := redis.NewScript("return " + reply)
			if err := script.Load(ctx, c).Err(); err != nil {
				b.Fatal(err)
			}
			coldRun(b, c, calls, par, keys, at, func(k string) bool {
				ks, args := cmd(k)
				v, err := script.EvalSha(ctx, c, ks, args...).Slice()
				return err == nil && len(v) > 0
			})
		}
	}
	return []benchImpl{
		{"store", func(b *testing.B, par int) {
			ctx := context.Background()
			c, calls := client(b, srv)
			st := remote.NewRedis(c)
			l := limit(w)
			coldRun(b, c, calls, par, keys, &storeAt, func(k string) bool {
				res, err := st.Lease(ctx, remote.Request{Prefix: remote.DefaultPrefix, Policy: "cold-s-" + run,
					Key: k, Limit: l, Version: 1, N: 1, Min: 1, Need: 1})
				return err == nil && res.Granted > 0
			})
		}},
		{"shape", shape(&shapeAt, "{1, 0, 9, 0, 100000, 1764979200000000, 1, 0, 1, 0, 0, 1764979200000000, 0}", func(k string) ([]string, []any) {
			bucket := remote.DefaultPrefix + "{cold-p-" + run + ":" + k + "}"
			return []string{bucket, bucket + ":grants"}, []any{"lease", 1, 1, 10, 1000000, 10, 1, 0, -(int64(1) << 51), 1000, 1}
		})},
		{"rr-shape", shape(&rrShapeAt, "{1, 9, '-1', '0.1'}", func(k string) ([]string, []any) {
			return []string{"cold-rr-p-" + run + ":" + k}, []any{10, 10, 1, 1, 1}
		})},
	}
}

// coldRun decides b.N times from par goroutines, each decision on the
// next of keys from at (which it moves on), and reports what the meter
// reads; it fails if fewer than 99% of the decisions were store calls.
func coldRun(b *testing.B, c *redis.Client, calls *counter, par int, keys []string, at *atomic.Int64, decide func(string) bool) {
	m := startMeter(b, c, calls, par)
	start := at.Add(int64(b.N)) - int64(b.N)
	var next atomic.Int64
	var wg sync.WaitGroup
	b.ReportAllocs()
	b.ResetTimer()
	for range par {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1) - 1
				if i >= int64(b.N) {
					return
				}
				decide(keys[(start+i)%int64(len(keys))])
			}
		}()
	}
	wg.Wait()
	b.StopTimer()
	if n := m.report(b, int64(b.N)); float64(n) < 0.99*float64(b.N) {
		b.Fatalf("%d store calls for %d decisions: not every decision was cold", n, b.N)
	}
}
