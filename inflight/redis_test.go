package inflight

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/leasehold/leasehold/internal/testkit/helperproc"
	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"github.com/leasehold/leasehold/remote"
	"github.com/redis/go-redis/v9"
)

// flight is one request's time in flight, in Unix nanoseconds: from
// Acquire's return to the Release call.
type flight struct{ From, To int64 }

// mostAtOnce is the most flights that overlap at any instant.
func mostAtOnce(fs []flight) int {
	type edge struct {
		at int64
		d  int
	}
	es := make([]edge, 0, 2*len(fs))
	for _, f := range fs {
		es = append(es, edge{f.From, 1}, edge{f.To, -1})
	}
	// At one instant a release counts before an acquire.
	slices.SortFunc(es, func(a, b edge) int {
		if a.at != b.at {
			return int(a.at - b.at)
		}
		return a.d - b.d
	})
	n, most := 0, 0
	for _, e := range es {
		n += e.d
		most = max(most, n)
	}
	return most
}

// helperEnv turns the test binary into one process of the fleet (see
// TestMain); its value is the Redis address(es), comma-separated for a
// cluster.
const helperEnv = "INFLIGHT_HELPER_REDIS"

// report is what one process of the fleet measured.
type report struct {
	Flights []flight
	Calls   int64
}

// TestInFlightOnRealRedis: 4 OS processes, each with its own limiter and
// client, 8 workers each, on one key, for 2 s from a common start,
// recording every request's time in flight. At a limit of 10 (32 workers
// want more) no instant has more than 10 in flight and the fleet keeps at
// least 8 in flight on average; under a limit of 50 (a steady load below
// it) they cost at most 10 store calls per 1 000 acquire/release pairs.
// Standalone and Cluster.
func TestInFlightOnRealRedis(t *testing.T) {
	if testing.Short() {
		t.Skip("2 s of load per case")
	}
	for _, be := range []struct {
		name  string
		addrs func(t *testing.T) string
	}{
		{"standalone", func(t *testing.T) string { return redistest.Standalone(t).Addr }},
		{"cluster", func(t *testing.T) string { return strings.Join(redistest.SharedCluster(t).Addrs(), ",") }},
	} {
		for _, slots := range []int64{10, 50} {
			t.Run(fmt.Sprintf("%s/limit=%d", be.name, slots), func(t *testing.T) {
				name := "in-flight-" + strconv.FormatInt(time.Now().UnixNano(), 36)
				// The servers are up before the common start is set: a
				// cluster takes seconds to form, and a start already past
				// would let each process run its own 2 s, so the fleet's
				// windows would not overlap and fewer would be in flight.
				addrs := be.addrs(t)
				start := time.Now().Add(time.Second) // every process starts and stops together
				reports := make([]report, 4)
				errs := make([]error, 4)
				var wg sync.WaitGroup
				for p := range reports {
					wg.Add(1)
					go func() {
						defer wg.Done()
						if err := helperproc.Run([]string{helperEnv + "=" + addrs, "INFLIGHT_NAME=" + name,
							"INFLIGHT_SLOTS=" + strconv.FormatInt(slots, 10), "INFLIGHT_START=" + strconv.FormatInt(start.UnixNano(), 10),
							"INFLIGHT_SEED=" + strconv.Itoa(p)}, &reports[p]); err != nil {
							errs[p] = fmt.Errorf("process %d: %w", p, err)
						}
					}()
				}
				wg.Wait()
				var flights []flight
				var calls int64
				for p, r := range reports {
					if errs[p] != nil {
						t.Fatal(errs[p])
					}
					flights = append(flights, r.Flights...)
					calls += r.Calls
				}
				var busy int64
				for _, f := range flights {
					busy += f.To - f.From
				}
				most, avg := mostAtOnce(flights), float64(busy)/float64(helperRun)
				perK := 1000 * float64(calls) / float64(max(len(flights), 1))
				t.Logf("%s, limit %d, 4 OS processes: %d requests, at most %d in flight at once, %.1f on average; %d store calls = %.1f per 1 000 acquire/release pairs",
					be.name, slots, len(flights), most, avg, calls, perK)
				if most > int(slots) {
					t.Fatalf("%d requests in flight at once under a limit of %d", most, slots)
				}
				switch {
				case slots == 10 && avg < 8:
					t.Errorf("%.1f in flight on average at a limit of 10 with 32 workers waiting, want ≥ 8", avg)
				case slots == 50 && perK > 10:
					t.Errorf("%.1f store calls per 1 000 pairs under the limit, want ≤ 10", perK)
				}
			})
		}
	}
}

// helperRun is how long each process of the fleet runs.
const helperRun = 2 * time.Second

// runHelper is one process of TestInFlightOnRealRedis: 8 workers acquire
// a slot, hold it 0–4 ms and release it, for helperRun from the common
// start; it writes its report to stdout.
func runHelper(addrs string) error {
	var c redis.UniversalClient
	if as := strings.Split(addrs, ","); len(as) > 1 {
		c = redis.NewClusterClient(&redis.ClusterOptions{Addrs: as, ContextTimeoutEnabled: true})
	} else {
		c = redis.NewClient(&redis.Options{Addr: addrs, ContextTimeoutEnabled: true})
	}
	defer c.Close()
	slots, _ := strconv.ParseInt(os.Getenv("INFLIGHT_SLOTS"), 10, 64)
	startNs, _ := strconv.ParseInt(os.Getenv("INFLIGHT_START"), 10, 64)
	seed, _ := strconv.ParseUint(os.Getenv("INFLIGHT_SEED"), 10, 64)
	l, err := New(remote.NewRedis(c), os.Getenv("INFLIGHT_NAME"), slots, WithFleetSize(4))
	if err != nil {
		return err
	}
	ctx := context.Background()
	// The fleet starts and stops together. A process that starts late,
	// on a loaded machine, still stops with the rest: the others' waiting
	// workers fill the slots it does not take.
	start := time.Unix(0, startNs)
	time.Sleep(time.Until(start))
	stop := start.Add(helperRun)
	var mu sync.Mutex
	var rep report
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(seed, uint64(w)))
			for time.Now().Before(stop) {
				actx, cancel := context.WithDeadline(ctx, stop)
				err := l.Acquire(actx, "tenant:{1}", 1)
				cancel()
				if err != nil {
					return // the run ended while it waited
				}
				from := time.Now().UnixNano()
				time.Sleep(time.Duration(rng.IntN(4000)) * time.Microsecond) // the request
				to := time.Now().UnixNano()
				mu.Lock()
				rep.Flights = append(rep.Flights, flight{from, to})
				mu.Unlock()
				l.Release("tenant:{1}", 1)
			}
		}()
	}
	wg.Wait()
	rep.Calls = l.Stats().StoreCalls
	if err := l.Close(ctx); err != nil {
		return err
	}
	return json.NewEncoder(os.Stdout).Encode(rep)
}
