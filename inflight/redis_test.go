package inflight

import (
	"context"
	"math/rand/v2"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"github.com/leasehold/leasehold/remote"
	"github.com/redis/go-redis/v9"
)

// flight is one request's time in flight: from Acquire's return to the
// Release call.
type flight struct{ from, to time.Time }

// mostAtOnce is the most flights that overlap at any instant.
func mostAtOnce(fs []flight) int {
	type edge struct {
		at time.Time
		d  int
	}
	es := make([]edge, 0, 2*len(fs))
	for _, f := range fs {
		es = append(es, edge{f.from, 1}, edge{f.to, -1})
	}
	// At one instant a release counts before an acquire.
	slices.SortFunc(es, func(a, b edge) int {
		if c := a.at.Compare(b.at); c != 0 {
			return c
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

// TestInFlightOnRealRedis: 4 limiters with their own clients, 8 workers
// each, on one key, for 2 s, recording every request's time in flight.
// At a limit of 10 (32 workers want more) no instant has more than 10 in
// flight and the fleet keeps at least 8 in flight on average; under a
// limit of 50 (a steady load below it) they cost at most 10 store calls
// per 1 000 acquire/release pairs. Standalone and Cluster.
func TestInFlightOnRealRedis(t *testing.T) {
	if testing.Short() {
		t.Skip("2 s of load per case")
	}
	for _, be := range []struct {
		name string
		dial func(t *testing.T) redis.UniversalClient
	}{
		{"standalone", func(t *testing.T) redis.UniversalClient { return redistest.Standalone(t).Client(t) }},
		{"cluster", func(t *testing.T) redis.UniversalClient { return redistest.SharedCluster(t).Client(t) }},
	} {
		for _, tc := range []struct {
			name  string
			slots int64
		}{{"at the limit", 10}, {"below the limit", 50}} {
			t.Run(be.name+"/"+tc.name, func(t *testing.T) {
				name := "in-flight-" + strconv.FormatInt(time.Now().UnixNano(), 36)
				lims := make([]*Limiter, 4)
				for i := range lims {
					l, err := New(remote.NewRedis(be.dial(t)), name, tc.slots)
					if err != nil {
						t.Fatal(err)
					}
					lims[i] = l
				}
				var mu sync.Mutex
				var flights []flight
				ctx := context.Background()
				start := time.Now()
				stop := start.Add(2 * time.Second)
				var wg sync.WaitGroup
				for i, l := range lims {
					for w := range 8 {
						wg.Add(1)
						go func() {
							defer wg.Done()
							rng := rand.New(rand.NewPCG(uint64(i), uint64(w)))
							for time.Now().Before(stop) {
								actx, cancel := context.WithDeadline(ctx, stop)
								err := l.Acquire(actx, "tenant:{1}", 1)
								cancel()
								if err != nil {
									return // the run ended while it waited
								}
								from := time.Now()
								time.Sleep(time.Duration(rng.IntN(4000)) * time.Microsecond) // the request
								to := time.Now()
								mu.Lock()
								flights = append(flights, flight{from, to})
								mu.Unlock()
								l.Release("tenant:{1}", 1)
							}
						}()
					}
				}
				wg.Wait()
				elapsed := time.Since(start)
				var calls int64
				for _, l := range lims {
					calls += l.Stats().StoreCalls
					if err := l.Close(ctx); err != nil {
						t.Error(err)
					}
				}
				var busy time.Duration
				for _, f := range flights {
					busy += f.to.Sub(f.from)
				}
				most, avg := mostAtOnce(flights), busy.Seconds()/elapsed.Seconds()
				perK := 1000 * float64(calls) / float64(max(len(flights), 1))
				t.Logf("%s, limit %d: %d requests, at most %d in flight at once, %.1f on average; %d store calls = %.1f per 1 000 acquire/release pairs",
					be.name, tc.slots, len(flights), most, avg, calls, perK)
				if most > int(tc.slots) {
					t.Fatalf("%d requests in flight at once under a limit of %d", most, tc.slots)
				}
				switch {
				case tc.slots == 10 && avg < 8:
					t.Errorf("%.1f in flight on average at a limit of 10 with 32 workers waiting, want ≥ 8", avg)
				case tc.slots == 50 && perK > 10:
					t.Errorf("%.1f store calls per 1 000 pairs under the limit, want ≤ 10", perK)
				}
			})
		}
	}
}
