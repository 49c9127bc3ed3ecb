package benchmarks

import (
	"context"
	"flag"
	"fmt"
	"math"
	"math/rand"
	"runtime"
	"runtime/metrics"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"github.com/leasehold/leasehold/internal/testkit/spawn"
	"github.com/redis/go-redis/v9"
)

// workload is a key distribution and the limit every key gets.
type workload struct {
	name  string
	keys  int
	zipf  bool
	rate  float64 // tokens per second per key
	burst int64
}

// Hot and uniform keys get a limit far above what a benchmark reaches, so
// every decision is an admission and the figure is the cost of one. Zipf
// keys get 10/s each, as a multi-tenant API would: the head of the
// distribution is refused, the long tail is cold.
var workloads = []workload{
	{name: "hot", keys: 1, rate: 1e9, burst: 1e10},
	{name: "uniform-1024", keys: 1024, rate: 1e9, burst: 1e10},
	{name: "zipf-100000", keys: 100_000, zipf: true, rate: 10, burst: 10},
}

// keySet builds n distinct keys.
func keySet(n int) []string {
	keys := make([]string, n)
	for i := range keys {
		keys[i] = "user-" + strconv.Itoa(100_000+i)
	}
	return keys
}

// sequence is the order in which keys are visited: a fixed pseudo-random
// sequence (so every implementation sees the same one) that goroutines
// walk from different offsets.
func (w workload) sequence() []int32 {
	const n = 1 << 20
	seq := make([]int32, n)
	r := rand.New(rand.NewSource(1))
	var z *rand.Zipf
	if w.zipf {
		z = rand.NewZipf(r, 1.1, 1, uint64(w.keys-1))
	}
	for i := range seq {
		switch {
		case z != nil:
			seq[i] = int32(z.Uint64())
		default:
			seq[i] = int32(r.Intn(w.keys))
		}
	}
	return seq
}

// idleFloor is, per 1 000 decisions of walk made at rate per second by
// one process, those on a key the process had not seen for Burst/Rate: by
// then the bucket has refilled anything it granted, so no lease that
// keeps the bound in every window can still hold a token for the key, and
// the decision needs a store call, whatever the limiter. walk is the
// decisions a run made, in the order it made them (runWalk); seen says
// how long before the walk's first decision a key was last decided (the
// warm-up's decision, warmUp.before), nil for a walk on keys never seen.
//
// The walk, not the whole sequence: a run of about Burst/Rate meets most
// of its keys for the first time in it, each a call, where the sequence's
// steady state, a million decisions long, had seen most of them within
// the last Burst/Rate. Counted on the whole sequence, the floor of a
// 1-goroutine run (about one second) read 152–171 per 1 000 where its
// walk's is 218–227.
func (w workload) idleFloor(walk []int32, rate float64, seen func(k int32) time.Duration) float64 {
	idleFor := float64(w.burst) / w.rate
	last := make([]float64, w.keys)
	for k := range last {
		last[k] = math.Inf(-1)
		if seen != nil {
			last[k] = -seen(int32(k)).Seconds()
		}
	}
	idle := 0
	for i, k := range walk {
		t := float64(i) / rate
		if t-last[k] > idleFor {
			idle++
		}
		last[k] = t
	}
	return 1000 * float64(idle) / float64(len(walk))
}

// walkStart is where in the sequence drive's goroutine g (from 0) starts.
func walkStart(g int) int { return (g + 1) * 7919 }

// runWalk is the n decisions drive makes on seq from par goroutines as one
// stream: a step of each goroutine in turn, as goroutines deciding at the
// same pace interleave.
func runWalk(seq []int32, par, n int) []int32 {
	per := (n + par - 1) / par
	walk := make([]int32, 0, n)
	for i := range per {
		for g := range par {
			if g*per+i < n {
				walk = append(walk, seq[(walkStart(g)+i)&(len(seq)-1)])
			}
		}
	}
	return walk
}

// sampleEvery is how often a decision's latency is timed: timing each one
// would cost more than a leased decision itself.
const sampleEvery = 16

// result is what one benchmark run measured besides ns/op.
type result struct {
	admitted atomic.Int64
	mu       sync.Mutex
	samples  []time.Duration
	// sched is how long goroutines waited to run while the benchmark
	// ran (runtime/metrics' /sched/latencies:seconds, after less
	// before): a decision's latency includes its goroutine's wait for a
	// core, whatever the limiter.
	sched *metrics.Float64Histogram
}

// schedLatencies reads the runtime's histogram of the time goroutines
// spent runnable before running.
func schedLatencies() *metrics.Float64Histogram {
	s := []metrics.Sample{{Name: "/sched/latencies:seconds"}}
	metrics.Read(s)
	if s[0].Value.Kind() != metrics.KindFloat64Histogram {
		return nil
	}
	return s[0].Value.Float64Histogram()
}

// histQuantile is the q quantile of h (the upper bound of its bucket),
// or 0 for an empty h.
func histQuantile(h *metrics.Float64Histogram, q float64) float64 {
	if h == nil {
		return 0
	}
	var total uint64
	for _, c := range h.Counts {
		total += c
	}
	if total == 0 {
		return 0
	}
	want := uint64(math.Ceil(q * float64(total)))
	var seen uint64
	for i, c := range h.Counts {
		seen += c
		if seen >= want {
			return h.Buckets[i+1]
		}
	}
	return h.Buckets[len(h.Buckets)-1]
}

// drive calls decide b.N times from par goroutines, timing one decision in
// sampleEvery, and reports admissions and latency percentiles.
func drive(b *testing.B, par int, seq []int32, decide func(i int32) bool) *result {
	res := &result{}
	schedBefore := schedLatencies()
	per := (b.N + par - 1) / par
	var wg sync.WaitGroup
	b.ReportAllocs()
	b.ResetTimer()
	for g := range par {
		n := min(per, b.N-g*per)
		if n <= 0 {
			break
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			pos := walkStart(g)
			var admitted int64
			samples := make([]time.Duration, 0, n/sampleEvery+1)
			for i := range n {
				k := seq[(pos+i)&(len(seq)-1)]
				if i%sampleEvery == 0 {
					start := time.Now()
					ok := decide(k)
					samples = append(samples, time.Since(start))
					if ok {
						admitted++
					}
					continue
				}
				if decide(k) {
					admitted++
				}
			}
			res.admitted.Add(admitted)
			res.mu.Lock()
			res.samples = append(res.samples, samples...)
			res.mu.Unlock()
		}()
	}
	wg.Wait()
	b.StopTimer()
	if after := schedLatencies(); schedBefore != nil && after != nil {
		res.sched = &metrics.Float64Histogram{Counts: diffCounts(schedBefore.Counts, after.Counts), Buckets: after.Buckets}
	}
	return res
}

// diffCounts is after less before, bucket by bucket.
func diffCounts(before, after []uint64) []uint64 {
	d := make([]uint64, len(after))
	for i := range after {
		d[i] = after[i]
		if i < len(before) {
			d[i] -= before[i]
		}
	}
	return d
}

// report adds admissions and latency percentiles to b's metrics.
func (r *result) report(b *testing.B) {
	b.ReportMetric(float64(r.admitted.Load())/float64(b.N)*100, "%admitted")
	if len(r.samples) == 0 {
		return
	}
	reportQuantiles(b, r.samples)
	if r.sched != nil {
		b.ReportMetric(histQuantile(r.sched, 0.99)*1e9, "sched-p99-ns")
		b.ReportMetric(histQuantile(r.sched, 0.999)*1e9, "sched-p99.9-ns")
	}
}

// counter is a go-redis hook that counts the commands a client sends,
// pipelined or not: the store calls an implementation makes, on the wire.
type counter struct{ n atomic.Int64 }

func (c *counter) DialHook(next redis.DialHook) redis.DialHook { return next }

func (c *counter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		c.n.Add(1)
		return next(ctx, cmd)
	}
}

func (c *counter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		c.n.Add(int64(len(cmds)))
		return next(ctx, cmds)
	}
}

// redisCounters reads the server-side figures a benchmark charges to its
// decisions: CPU seconds, and the time Redis spent running scripts (EVAL
// and EVALSHA, the script's own commands included), which the CPU figure
// mixes with the event loop's reads, writes and expiry.
type redisCounters struct {
	cpu         float64 // seconds, user + sys
	scripts     int64   // EVAL and EVALSHA calls
	scriptMicro int64   // µs Redis spent in them
}

func readRedis(ctx context.Context, c *redis.Client) (redisCounters, error) {
	info, err := c.Info(ctx, "cpu", "commandstats").Result()
	if err != nil {
		return redisCounters{}, err
	}
	return parseInfo(info), nil
}

// parseInfo reads the counters from the text of INFO cpu and
// commandstats.
func parseInfo(info string) redisCounters {
	var rc redisCounters
	for line := range strings.SplitSeq(info, "\r\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		switch k {
		case "used_cpu_user", "used_cpu_sys":
			f, _ := strconv.ParseFloat(v, 64)
			rc.cpu += f
		case "cmdstat_eval", "cmdstat_evalsha":
			// calls=N,usec=U,usec_per_call=…
			for field := range strings.SplitSeq(v, ",") {
				name, n, _ := strings.Cut(field, "=")
				switch name {
				case "calls":
					i, _ := strconv.ParseInt(n, 10, 64)
					rc.scripts += i
				case "usec":
					i, _ := strconv.ParseInt(n, 10, 64)
					rc.scriptMicro += i
				}
			}
		}
	}
	return rc
}

// meter charges the commands counted by calls (nil: none) and Redis CPU
// to the decisions between start and report.
type meter struct {
	info   *redis.Client
	calls  *counter
	before redisCounters
	sent   int64
	cpu    time.Duration // this process's CPU (the client's side) at the start
	// goroutines started by the process, and by the benchmark's own
	// driver (par), which report leaves out.
	goroutines uint64
	par        int
}

// processCPU is the user and system CPU this process has used: the
// client's side of every limiter, Redis being another process.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func startMeter(b *testing.B, info *redis.Client, calls *counter, par int) *meter {
	rc, err := readRedis(context.Background(), info)
	if err != nil {
		b.Fatalf("INFO: %v", err)
	}
	m := &meter{info: info, calls: calls, before: rc, cpu: processCPU(), goroutines: spawn.Count(), par: par}
	if calls != nil {
		m.sent = calls.n.Load()
	}
	return m
}

// report reports Redis calls, Redis's CPU and the client's CPU per 1 000
// decisions, and the client's CPU and the goroutines started per store
// call (redis_rate makes one per decision, so its per-call cost is its
// per-decision cost), and returns the calls.
func (m *meter) report(b *testing.B, decisions int64) int64 {
	client := processCPU() - m.cpu
	// The runtime's count may lag by a few: never below 0.
	started := max(int64(spawn.Count()-m.goroutines)-int64(m.par), 0)
	after, err := readRedis(context.Background(), m.info)
	if err != nil {
		b.Fatalf("INFO: %v", err)
	}
	b.ReportMetric((after.cpu-m.before.cpu)*1e6/float64(decisions)*1000, "redis-cpu-us/1000")
	if n := after.scripts - m.before.scripts; n > 0 {
		// What one script call costs Redis to run, apart from reading
		// and answering it: the part of redis-cpu a script's design sets.
		b.ReportMetric(float64(after.scriptMicro-m.before.scriptMicro)/float64(n), "redis-script-us/call")
	}
	b.ReportMetric(float64(client.Microseconds())/float64(decisions)*1000, "client-cpu-us/1000")
	if m.calls == nil {
		return 0
	}
	calls := m.calls.n.Load() - m.sent
	b.ReportMetric(float64(calls)/float64(decisions)*1000, "storecalls/1000")
	if calls > 0 {
		b.ReportMetric(float64(client.Nanoseconds())/float64(calls)/1000, "client-cpu-us/call")
		b.ReportMetric(float64(started)/float64(calls), "goroutines/call")
	}
	return calls
}

// heapInUse is the live heap after a full collection.
func heapInUse() uint64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// warmUp is what warm did: the heap it left behind, and when it began and
// ended.
type warmUp struct {
	heap       float64
	start, end time.Time
	keys       int
}

// warm makes one decision on every key from several goroutines, in the
// keys' order.
func warm(keys int, decide func(i int32) bool) warmUp {
	before := heapInUse()
	var next atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1) - 1
				if i >= int64(keys) {
					return
				}
				decide(int32(i))
			}
		}()
	}
	wg.Wait()
	end := time.Now()
	after := heapInUse()
	return warmUp{heap: float64(after) - float64(before), start: start, end: end, keys: keys}
}

// before returns, for idleFloor, how long before at warm decided each key:
// the keys went out in order at a steady pace.
func (u warmUp) before(at time.Time) func(k int32) time.Duration {
	span := u.end.Sub(u.start)
	return func(k int32) time.Duration {
		return at.Sub(u.start.Add(time.Duration(float64(span) * float64(k) / float64(u.keys))))
	}
}

func benchName(impl string, w workload, par int) string {
	return fmt.Sprintf("impl=%s/workload=%s/goroutines=%d", impl, w.name, par)
}

// leaseCapFloor is, per 1 000 decisions of seq made at rate per second by
// one process, the fewest store calls any limiter can make whose lease on
// a key holds at most spare tokens besides those its call hands to the
// callers waiting on it, each kept at most ttl. The default holds at most
// 10% of Burst (1 token at burst 10): that is what keeps its edge of the
// every-window bound small, so no limiter with the same edge does better.
// It is a lower bound, counted with every advantage to the limiter: each
// key admits exactly as its bucket allows (one stream at the fleet's
// rate, as idleFloor counts), a refusal costs nothing, every call takes
// the whole spare, an unspent token costs nothing, and a decision within
// join of a call rides on it. The idle floor is part of it.
func (w workload) leaseCapFloor(seq []int32, rate float64, spare int64, ttl, join time.Duration) float64 {
	type state struct {
		level, at   float64 // the key's bucket: tokens, when
		left        int64   // spare tokens the process holds
		until, join float64 // when the spare ends; when joining the call ends
		seen        bool
	}
	keys := make([]state, w.keys)
	calls := 0
	for i, k := range seq {
		t := float64(i) / rate
		s := &keys[k]
		if !s.seen {
			s.seen, s.level, s.at = true, float64(w.burst), t
		}
		s.level = min(float64(w.burst), s.level+(t-s.at)*w.rate)
		s.at = t
		if s.level < 1 {
			continue // refused, for free
		}
		s.level--
		switch {
		case t < s.join:
		case s.left > 0 && t < s.until:
			s.left--
		default:
			calls++
			s.left, s.until, s.join = spare, t+ttl.Seconds(), t+join.Seconds()
		}
	}
	return 1000 * float64(calls) / float64(len(seq))
}

// TestLeaseCapFloor checks the bound on sequences counted by hand, and
// its order against the idle floor on the Zipf sequence the benchmarks
// walk.
func TestLeaseCapFloor(t *testing.T) {
	w := workload{keys: 2, rate: 10, burst: 10}
	for _, c := range []struct {
		name   string
		seq    []int32
		rate   float64
		spare  int64
		join   time.Duration
		per1k  float64
		reason string
	}{
		{"spare", []int32{0, 0, 0, 1, 0}, 10, 1, 0, 600,
			"key 0 calls at 0 and 0.2 s and spends the spare at 0.1 and 0.4; key 1 calls"},
		{"no spare", []int32{0, 0, 0, 1, 0}, 10, 0, 0, 1000, "every admission is a call"},
		{"spare ends", []int32{0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0}, 10, 1, 0, 8000.0 / 13,
			"key 0's spare ended after 1 s: two calls; key 1 pairs 11 decisions into 6 calls"},
		{"refusals are free", make([]int32, 20), 1000, 1, 0, 250,
			"20 decisions in 20 ms admit 10, paired into 5 calls"},
		{"joins", make([]int32, 20), 1000, 1, time.Second, 50, "one call, 9 joins, 10 refused"},
	} {
		t.Run(c.name, func(t *testing.T) {
			got := w.leaseCapFloor(c.seq, c.rate, c.spare, time.Second, c.join)
			if math.Abs(got-c.per1k) > 1e-9 {
				t.Fatalf("%.2f calls/1000, want %.2f: %s", got, c.per1k, c.reason)
			}
		})
	}
	z := workloads[2]
	seq := z.sequence()
	for _, rate := range []float64{1e4, 3e4, 6e4} {
		idle := z.idleFloor(seq, rate, nil)
		none := z.leaseCapFloor(seq, rate, 0, time.Second, 0)
		one := z.leaseCapFloor(seq, rate, 1, time.Second, 0)
		whole := z.leaseCapFloor(seq, rate, z.burst, time.Second, 0)
		t.Logf("%.0f decisions/s: idle floor %.1f, lease holding 0 %.1f, 1 %.1f, Burst %.1f store calls/1000", rate, idle, none, one, whole)
		if !(idle <= whole && whole <= one && one <= none) {
			t.Fatalf("want idle floor ≤ whole Burst ≤ one spare ≤ none, got %.1f, %.1f, %.1f, %.1f", idle, whole, one, none)
		}
	}
}

// TestIdleFloor counts the idle floor on walks counted by hand: first
// visits, keys the warm-up decided shortly before, and returns within and
// past Burst/Rate (1 s here).
func TestIdleFloor(t *testing.T) {
	w := workload{keys: 3, rate: 10, burst: 10}
	warmed := func(ago ...time.Duration) func(int32) time.Duration {
		return func(k int32) time.Duration { return ago[k] }
	}
	for _, c := range []struct {
		name   string
		walk   []int32
		rate   float64
		seen   func(int32) time.Duration
		per1k  float64
		reason string
	}{
		{"first visits", []int32{0, 1, 2, 0, 1, 2}, 10, nil, 500, "three keys never seen, then back within 0.3 s"},
		{"back after a second", []int32{0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0}, 10, nil, 3000.0 / 13,
			"key 0 idle at 0 and 1.2 s, key 1 at 0.1 s only"},
		{"warmed shortly before", []int32{0, 1, 2}, 10, warmed(500*time.Millisecond, 2*time.Second, 750*time.Millisecond), 1000.0 / 3,
			"key 0 seen 0.5 s before its decision, key 2 0.95 s, key 1 2.1 s"},
		{"warmed a second before", []int32{2}, 10, warmed(0, 0, 1001*time.Millisecond), 1000, "key 2 seen 1.001 s before"},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got := w.idleFloor(c.walk, c.rate, c.seen); math.Abs(got-c.per1k) > 1e-9 {
				t.Fatalf("%s: got %.3f, want %.3f", c.reason, got, c.per1k)
			}
		})
	}
}

// TestRunWalk: the walk idleFloor counts is the decisions drive made,
// whatever b.N and the number of goroutines.
func TestRunWalk(t *testing.T) {
	seq := workloads[2].sequence()
	// A few thousand decisions, not a second's worth.
	bt := flag.Lookup("test.benchtime")
	was := bt.Value.String()
	if err := bt.Value.Set("5003x"); err != nil {
		t.Fatal(err)
	}
	defer bt.Value.Set(was)
	for _, par := range []int{1, 3, 16} {
		var mu sync.Mutex
		var got []int32
		var n int
		testing.Benchmark(func(b *testing.B) {
			mu.Lock()
			got, n = got[:0], b.N
			mu.Unlock()
			drive(b, par, seq, func(k int32) bool {
				mu.Lock()
				got = append(got, k)
				mu.Unlock()
				return true
			})
		})
		want := runWalk(seq, par, n)
		slices.Sort(got)
		slices.Sort(want)
		if n == 0 || !slices.Equal(got, want) {
			t.Fatalf("%d goroutines, b.N %d: drive decided %d keys, the walk has %d, or not the same ones", par, n, len(got), len(want))
		}
	}
}

// TestParseInfo: the counters a benchmark charges come from INFO as Redis
// 7 writes it; a format change shows here, not as a metric that silently
// stops appearing.
func TestParseInfo(t *testing.T) {
	for _, tt := range []struct {
		name string
		info string
		want redisCounters
	}{
		{"cpu and both script commands", "# CPU\r\nused_cpu_sys:1.500000\r\nused_cpu_user:2.250000\r\nused_cpu_sys_children:9.000000\r\n\r\n" +
			"# Commandstats\r\ncmdstat_evalsha:calls=1000,usec=15000,usec_per_call=15.00,rejected_calls=0,failed_calls=2\r\n" +
			"cmdstat_eval:calls=3,usec=90,usec_per_call=30.00,rejected_calls=0,failed_calls=0\r\n" +
			"cmdstat_get:calls=50,usec=40,usec_per_call=0.80,rejected_calls=0,failed_calls=0\r\n",
			redisCounters{cpu: 3.75, scripts: 1003, scriptMicro: 15090}},
		{"no script run yet", "# CPU\r\nused_cpu_sys:0.5\r\nused_cpu_user:0.25\r\n\r\n# Commandstats\r\ncmdstat_info:calls=1,usec=20,usec_per_call=20.00\r\n",
			redisCounters{cpu: 0.75}},
		{"empty", "", redisCounters{}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if got := parseInfo(tt.info); got != tt.want {
				t.Fatalf("parseInfo = %+v, want %+v", got, tt.want)
			}
		})
	}
}

// TestReadRedisCountsScripts: on a real server, the script calls a
// benchmark makes show in the counters it reads.
func TestReadRedisCountsScripts(t *testing.T) {
	srv := redistest.Standalone(t)
	c := srv.Client(t)
	ctx := context.Background()
	before, err := readRedis(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	script := redis.NewScript(`return redis.call('TIME')[1]`)
	for range 5 {
		if err := script.Run(ctx, c, nil).Err(); err != nil {
			t.Fatal(err)
		}
	}
	after, err := readRedis(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	// Other tests share the server: at least this test's calls.
	if n := after.scripts - before.scripts; n < 5 {
		t.Fatalf("%d script calls counted, want at least 5", n)
	}
	if after.scriptMicro < before.scriptMicro || after.cpu <= 0 {
		t.Fatalf("counters before %+v, after %+v", before, after)
	}
}

// reportQuantiles sorts samples and adds their median, p99 and p99.9 to
// b's metrics.
func reportQuantiles(b *testing.B, samples []time.Duration) {
	slices.Sort(samples)
	q := func(p float64) float64 {
		return float64(samples[min(int(p*float64(len(samples))), len(samples)-1)].Nanoseconds())
	}
	b.ReportMetric(q(0.50), "p50-ns")
	b.ReportMetric(q(0.99), "p99-ns")
	b.ReportMetric(q(0.999), "p99.9-ns")
}
