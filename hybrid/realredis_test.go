package hybrid

import (
	"context"
	"fmt"
	"math/rand/v2"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"github.com/leasehold/leasehold/remote"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// newFleet builds n limiters of p, each with its own client from dial (so
// each has its own connection pool and breaker, as separate processes
// would).
func newFleet(t *testing.T, n int, p Policy, dial func(t *testing.T) redis.UniversalClient, opts ...Option) []*Limiter {
	t.Helper()
	lims := make([]*Limiter, n)
	for i := range lims {
		l, err := New(remote.NewRedis(dial(t)), p, append([]Option{quiet}, opts...)...)
		require.NoError(t, err)
		lims[i] = l
		t.Cleanup(func() { _ = l.Close(context.Background()) })
	}
	return lims
}

func fleetStats(lims []*Limiter) (s Stats) {
	for _, l := range lims {
		x := l.Stats()
		s.Admitted += x.Admitted
		s.Rejected += x.Rejected
		s.StoreCalls += x.StoreCalls
		s.StoreErrors += x.StoreErrors
		s.TokensDebited += x.TokensDebited
		s.TokensReturned += x.TokensReturned
		for i := range s.bySource {
			s.bySource[i].Admitted += x.bySource[i].Admitted
			s.bySource[i].Rejected += x.bySource[i].Rejected
		}
	}
	return s
}

// hammer runs g goroutines per limiter calling Allow on keys from pick as
// fast as they can for d, and returns admitted and offered counts per key
// and the wall time the load spanned.
func hammer(lims []*Limiter, g int, d time.Duration, pick func(r *rand.Rand) string) (admitted, offered map[string]int64, elapsed time.Duration) {
	var mu sync.Mutex
	admitted, offered = map[string]int64{}, map[string]int64{}
	var stop atomic.Bool
	var wg sync.WaitGroup
	start := time.Now()
	for li, l := range lims {
		for j := 0; j < g; j++ {
			wg.Add(1)
			go func(seed uint64) {
				defer wg.Done()
				r := rand.New(rand.NewPCG(seed, 7))
				adm, off := map[string]int64{}, map[string]int64{}
				ctx := context.Background()
				for !stop.Load() {
					k := pick(r)
					off[k]++
					if l.Allow(ctx, k) {
						adm[k]++
					} else {
						// A rejected client goes away; yield so that 256
						// spinning load goroutines do not starve the
						// limiter's own refills of CPU.
						runtime.Gosched()
					}
				}
				mu.Lock()
				for k, v := range adm {
					admitted[k] += v
				}
				for k, v := range off {
					offered[k] += v
				}
				mu.Unlock()
			}(uint64(li*1000 + j))
		}
	}
	time.Sleep(d) // the load runs for a fixed real duration
	stop.Store(true)
	wg.Wait()
	return admitted, offered, time.Since(start)
}

// paced runs g goroutines per limiter, each offering perGoroutine
// decisions per second on key at a steady pace (catching up with ticker
// jitter) until ctx ends, and hands every decision to record. The returned
// WaitGroup ends with the goroutines.
func paced(ctx context.Context, lims []*Limiter, g int, perGoroutine float64, key string,
	record func(at time.Time, d Decision, err error, took time.Duration)) *sync.WaitGroup {
	return pacedFrom(ctx, lims, g, perGoroutine, key, false, record)
}

// spread is paced with the goroutines' schedules spread evenly over one
// interval between decisions, as independent clients arrive, instead of
// all deciding at the same instants.
func spread(ctx context.Context, lims []*Limiter, g int, perGoroutine float64, key string,
	record func(at time.Time, d Decision, err error, took time.Duration)) *sync.WaitGroup {
	return pacedFrom(ctx, lims, g, perGoroutine, key, true, record)
}

func pacedFrom(ctx context.Context, lims []*Limiter, g int, perGoroutine float64, key string, phased bool,
	record func(at time.Time, d Decision, err error, took time.Duration)) *sync.WaitGroup {
	var wg sync.WaitGroup
	base := time.Now()
	total := len(lims) * g
	for li, l := range lims {
		for j := 0; j < g; j++ {
			start := base
			if phased {
				// Decision k of this goroutine is due at start + k/perGoroutine.
				start = base.Add(-time.Duration(float64(li*g+j) / float64(total) / perGoroutine * float64(time.Second)))
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				tk := time.NewTicker(time.Millisecond)
				defer tk.Stop()
				sent := int64(0)
				for {
					select {
					case <-ctx.Done():
						return
					case now := <-tk.C:
						for due := int64(now.Sub(start).Seconds() * perGoroutine); sent < due && ctx.Err() == nil; sent++ {
							at := time.Now()
							d, err := l.AllowN(context.Background(), key, 1)
							record(at, d, err, time.Since(at))
						}
					}
				}
			}()
		}
	}
	return &wg
}

// steady offers each limiter g goroutines × perGoroutine requests per
// second on key for d, and returns offered and admitted counts and the wall
// time spanned.
func steady(lims []*Limiter, g int, perGoroutine float64, d time.Duration, key string) (offered, admitted int64, elapsed time.Duration) {
	var off, adm atomic.Int64
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	paced(ctx, lims, g, perGoroutine, key, func(_ time.Time, d Decision, _ error, _ time.Duration) {
		off.Add(1)
		if d.Allowed {
			adm.Add(1)
		}
	}).Wait()
	return off.Load(), adm.Load(), time.Since(start)
}

func sum(m map[string]int64) (n int64) {
	for _, v := range m {
		n += v
	}
	return n
}

func standaloneDial(t *testing.T) redis.UniversalClient { return redistest.Standalone(t).Client(t) }

// dial returns a newFleet dialer of srv: a new client per limiter.
func dial(srv *redistest.Server) func(*testing.T) redis.UniversalClient {
	return func(t *testing.T) redis.UniversalClient { return srv.Client(t) }
}
func clusterDial(t *testing.T) redis.UniversalClient { return redistest.SharedCluster(t).Client(t) }

// backend is a real Redis for a load test, and the key to load on it.
type backend struct {
	name string
	dial func(*testing.T) redis.UniversalClient
	key  string
	// opts and firstMost are a test's own, per case (firstMost: a
	// threshold of the test's).
	opts      []Option
	firstMost float64
}

// backends are the shared standalone server and the shared cluster, with
// their keys (a cluster key with a hash tag, to check its slot is kept).
func backends(standaloneKey, clusterKey string) []backend {
	return []backend{{name: "standalone", dial: standaloneDial, key: standaloneKey}, {name: "cluster", dial: clusterDial, key: clusterKey}}
}

// runPolicy is a policy of lim named for this run only: runs never share
// buckets on the shared servers.
func runPolicy(name string, lim Limit) Policy {
	return Policy{Name: name + strconv.FormatInt(time.Now().UnixNano(), 36), Limit: lim}
}

// TestExactBoundUnderLoad: 8 limiters with separate clients on one Redis,
// 32 goroutines each, Rate 5 000/s Burst 500, 5 s: admitted ≤ Burst +
// Rate·elapsed exactly and ≥ 92% of it (99.3–99.7% idle; beside make
// test's parallel load the default measured 93.98% once, decaying leases
// 95% and more), and at most 50 store calls per 1 000
// admitted.
func TestExactBoundUnderLoad(t *testing.T) {
	if testing.Short() {
		t.Skip("5 s of load per case")
	}
	lim := Limit{Rate: 5000, Period: time.Second, Burst: 500}
	for _, tc := range backends("hot", "tenant:{7}:}{") {
		t.Run(tc.name, func(t *testing.T) {
			lims := newFleet(t, 8, runPolicy("exact-"+tc.name, lim), tc.dial)
			admitted, offered, elapsed := hammer(lims, 32, 5*time.Second, func(*rand.Rand) string { return tc.key })
			got, bound := admitted[tc.key], lim.Burst+lim.TokensIn(elapsed)
			s := fleetStats(lims)
			perK := 1000 * float64(s.StoreCalls) / float64(got)
			t.Logf("%s: offered %d (%.1f× the bound), admitted %d, bound %d (%.2f%%), %d store calls = %.1f per 1000 admitted, %d store errors, %d decided by the degraded share",
				tc.name, offered[tc.key], float64(offered[tc.key])/float64(bound), got, bound, 100*float64(got)/float64(bound), s.StoreCalls, perK, s.StoreErrors,
				s.Source(SourceDegraded).Admitted)
			if offered[tc.key] < 3*bound {
				t.Fatalf("offered %d < 3× bound %d: the test did not load the key enough", offered[tc.key], bound)
			}
			// The bound is strict even when the store looks slow (a
			// CPU-starved run under -race): a key at its limit refuses what
			// the store is too slow to answer instead of admitting by the
			// degraded share on top of the bucket.
			if got > bound {
				t.Fatalf("admitted %d (%d of them by the degraded share) > exact bound %d", got, s.Source(SourceDegraded).Admitted, bound)
			}
			if float64(got) < 0.92*float64(bound) {
				t.Fatalf("admitted %d < 92%% of bound %d", got, bound)
			}
			if perK > 50 {
				t.Fatalf("%.1f store calls per 1000 admitted, want ≤ 50", perK)
			}
		})
	}
}

// TestExactBoundManyKeys: the same fleet on 1 000 keys chosen at random per
// request. Each key must stay within its own exact bound; demand per key
// is below the limit here, so nearly all of it must be admitted.
func TestExactBoundManyKeys(t *testing.T) {
	if testing.Short() {
		t.Skip("5 s of load")
	}
	lim := Limit{Rate: 5000, Period: time.Second, Burst: 500}
	p := Policy{Name: "many-" + strconv.FormatInt(time.Now().UnixNano(), 36), Limit: lim}
	// Each key sees a few requests a second per process here, so nearly
	// every decision is a synchronous store call (a slow key's lease is one
	// token). 256 goroutines doing that under the race detector can take
	// longer than the 50 ms default store timeout, and a decision the store
	// did not answer in time is refused: give them time, this test is
	// about the bound.
	lims := newFleet(t, 8, p, standaloneDial, WithStoreTimeout(time.Second))
	keys := make([]string, 1000)
	for i := range keys {
		keys[i] = fmt.Sprintf("k%04d", i)
	}
	admitted, offered, elapsed := hammer(lims, 32, 5*time.Second, func(r *rand.Rand) string { return keys[r.IntN(len(keys))] })
	if len(offered) != len(keys) {
		t.Fatalf("load touched %d keys, want %d", len(offered), len(keys))
	}
	bound := lim.Burst + lim.TokensIn(elapsed)
	var servable int64
	for _, k := range keys {
		if admitted[k] > bound {
			t.Fatalf("key %s: admitted %d > exact bound %d", k, admitted[k], bound)
		}
		servable += min(offered[k], bound)
	}
	got := sum(admitted)
	s := fleetStats(lims)
	t.Logf("1000 keys: offered %d, admitted %d of %d servable (%.2f%%), per-key bound %d, %d store calls (%.1f per 1000 admitted)",
		sum(offered), got, servable, 100*float64(got)/float64(servable), bound, s.StoreCalls, 1000*float64(s.StoreCalls)/float64(got))
	if float64(got) < 0.95*float64(servable) {
		t.Fatalf("admitted %d < 95%% of servable %d", got, servable)
	}
}

// TestRoundTripsUnderLimit: Rate 100 000/s Burst 10 000, 8 limiters each
// offered a steady 5 000/s on one key: at most 5 store calls per 1 000
// decisions, counted by Stats and by Redis INFO commandstats.
func TestRoundTripsUnderLimit(t *testing.T) {
	if testing.Short() {
		t.Skip("3 s of load")
	}
	srv := redistest.NewServer(t)
	admin := srv.Client(t)
	lim := Limit{Rate: 100_000, Period: time.Second, Burst: 10_000}
	lims := newFleet(t, 8, Policy{Name: "steady", Limit: lim}, dial(srv))
	require.NoError(t, admin.ConfigResetStat(context.Background()).Err())
	const perProcess = 5000
	d, admitted, _ := steady(lims, 1, perProcess, 3*time.Second, "steady")
	s := fleetStats(lims)
	redisCalls := scriptCalls(t, admin)
	t.Logf("%d decisions (%d admitted), Stats: %d store calls (%.2f per 1000), Redis commandstats: %d script calls (%.2f per 1000)",
		d, admitted, s.StoreCalls, 1000*float64(s.StoreCalls)/float64(d), redisCalls, 1000*float64(redisCalls)/float64(d))
	if d < 8*perProcess*2 {
		t.Fatalf("only %d decisions offered", d)
	}
	// Under the limit everything should pass; a decision may still be
	// refused if a store call outlives the 50 ms store timeout on a busy
	// machine, so allow one in a thousand.
	if admitted < d-d/1000 {
		t.Fatalf("admitted %d of %d under the limit", admitted, d)
	}
	for name, calls := range map[string]int64{"Stats": s.StoreCalls, "commandstats": redisCalls} {
		if per := 1000 * float64(calls) / float64(d); per > 5 {
			t.Fatalf("%s: %.2f store calls per 1000 decisions, want ≤ 5", name, per)
		}
	}
}

// TestRejectionsCostNoRoundTrips: at the limit, quadrupling the demand
// leaves the number of store calls where it was: rejections are decided
// locally.
func TestRejectionsCostNoRoundTrips(t *testing.T) {
	if testing.Short() {
		t.Skip("6 s of load")
	}
	srv := redistest.NewServer(t)
	admin := srv.Client(t)
	lim := Limit{Rate: 5000, Period: time.Second, Burst: 500}
	var calls [2]int64
	var offered [2]int64
	for i, g := range []int{4, 16} {
		lims := newFleet(t, 8, Policy{Name: fmt.Sprintf("double-%d", i), Limit: lim}, dial(srv))
		require.NoError(t, admin.ConfigResetStat(context.Background()).Err())
		off, adm, elapsed := steady(lims, g, 1000, 3*time.Second, "k")
		calls[i] = scriptCalls(t, admin)
		offered[i] = off
		bound := lim.Burst + lim.TokensIn(elapsed)
		degraded := fleetStats(lims).Source(SourceDegraded).Admitted
		t.Logf("%d goroutines per limiter: offered %d, admitted %d (bound %d), %d of them by the degraded share, %d script calls in Redis",
			g, off, adm, bound, degraded, calls[i])
		// 128 goroutines spinning on 2 cores starve the limiters: calls
		// that take longer than the breaker's latency threshold open it,
		// and the degraded share then decides on top of the bucket the
		// others still draw, as in a partition (RELIABILITY's known
		// limits; measured 6 828 by the share, 17 223 against 16 404). The
		// bound checked here is for what the store granted.
		if adm-degraded > bound {
			t.Fatalf("admitted %d (%d by the degraded share) > bound %d", adm, degraded, bound)
		}
		for _, l := range lims {
			require.NoError(t, l.Close(context.Background()))
		}
	}
	if offered[1] < offered[0]*3 {
		// A CPU-starved machine (make test beside a hog) cannot quadruple
		// the demand, so there is nothing to compare: the bound was checked.
		t.Skipf("4× the goroutines raised demand only from %d to %d: the machine is too busy to compare store calls", offered[0], offered[1])
	}
	// Call counts move with scheduling: with 8 and 16 goroutines the ratio
	// was 0.93–1.52 alone on this 2-core machine and 1.74 in CI beside the
	// rest of the suite, too close to the 2 that calls following demand
	// would give; with 4 and 16 those would give 4.
	if float64(calls[1]) > 2.5*float64(calls[0]) {
		t.Fatalf("store calls went from %d to %d when demand quadrupled", calls[0], calls[1])
	}
}

// scriptCalls reads EVAL + EVALSHA calls from INFO commandstats.
func scriptCalls(t *testing.T, c *redis.Client) int64 {
	t.Helper()
	info, err := c.Info(context.Background(), "commandstats").Result()
	require.NoError(t, err)
	var n int64
	for _, line := range strings.Split(info, "\n") {
		if !strings.HasPrefix(line, "cmdstat_evalsha:") && !strings.HasPrefix(line, "cmdstat_eval:") {
			continue
		}
		_, rest, _ := strings.Cut(line, "calls=")
		v, _, _ := strings.Cut(rest, ",")
		x, err := strconv.ParseInt(v, 10, 64)
		require.NoError(t, err)
		n += x
	}
	return n
}
