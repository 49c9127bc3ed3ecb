package inflight

import (
	"context"
	"math/rand/v2"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"github.com/leasehold/leasehold/remote"
)

// TestInFlightThroughRedisDown: 4 limiters (fleet size 4, a 1 s term)
// with 8 workers each under a limit of 20; Redis is killed for 2 s, longer
// than the term, and started again. Every request's time in flight is
// recorded: never more than 20 at once, before, during (the held slots
// until their term, then each process's share of 5) and after; requests
// go on while Redis is down.
func TestInFlightThroughRedisDown(t *testing.T) {
	if testing.Short() {
		t.Skip("4 s of load")
	}
	srv := redistest.NewServer(t)
	name := "in-flight-down-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	lims := make([]*Limiter, 4)
	for i := range lims {
		l, err := New(remote.NewRedis(srv.Client(t)), name, 20, WithFleetSize(4), WithTerm(time.Second),
			WithStoreTimeout(50*time.Millisecond))
		if err != nil {
			t.Fatal(err)
		}
		lims[i] = l
		t.Cleanup(func() { _ = l.Close(context.Background()) })
	}
	var mu sync.Mutex
	var flights []flight
	ctx := context.Background()
	start := time.Now()
	stop := start.Add(4 * time.Second)
	var wg sync.WaitGroup
	for i, l := range lims {
		for w := range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				rng := rand.New(rand.NewPCG(uint64(i), uint64(w)))
				for time.Now().Before(stop) {
					actx, cancel := context.WithDeadline(ctx, stop)
					err := l.Acquire(actx, "k", 1)
					cancel()
					if err != nil {
						return
					}
					from := time.Now().UnixNano()
					time.Sleep(time.Duration(rng.IntN(4000)) * time.Microsecond) // the request
					mu.Lock()
					flights = append(flights, flight{from, time.Now().UnixNano()})
					mu.Unlock()
					l.Release("k", 1)
				}
			}()
		}
	}
	time.Sleep(time.Second) // load runs in real time
	if err := srv.Kill(); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	time.Sleep(2 * time.Second)
	if err := srv.Restart(); err != nil {
		t.Fatal(err)
	}
	back := time.Now()
	wg.Wait()
	var during []flight
	for _, f := range flights {
		if f.From >= killed.UnixNano() && f.To <= back.UnixNano() {
			during = append(during, f)
		}
	}
	most, mostDown := mostAtOnce(flights), mostAtOnce(during)
	t.Logf("%d requests, %d while Redis was down; at most %d in flight at once over the run, %d while down", len(flights), len(during), most, mostDown)
	if most > 20 {
		t.Fatalf("%d requests in flight at once under a limit of 20", most)
	}
	if len(during) < 100 {
		t.Fatalf("%d requests while Redis was down: the shares did not serve", len(during))
	}
}
