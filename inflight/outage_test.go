package inflight

import (
	"context"
	"errors"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
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
	flightsOf := load(lims, time.Now().Add(4*time.Second), 0, 4*time.Millisecond)
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
	flights := flightsOf()
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

// cutStore is a RedisStore whose slot and policy calls fail while off is
// set: one process cut off from a Redis the others still reach.
type cutStore struct {
	*remote.RedisStore
	b   backend
	off atomic.Bool
}

func (c *cutStore) slots(ctx context.Context, r slotRequest) (slotReply, error) {
	if c.off.Load() {
		return slotReply{}, errors.Join(remote.ErrUnavailable, errors.New("cut off"))
	}
	return c.b.slots(ctx, r)
}

func (c *cutStore) policy(ctx context.Context, key, rec string, version uint64) (string, error) {
	if c.off.Load() {
		return "", errors.Join(remote.ErrUnavailable, errors.New("cut off"))
	}
	return c.b.policy(ctx, key, rec, version)
}

// TestInFlightPartitionLongerThanTheTerm: 4 limiters (fleet size 4, a 1 s
// term) with 8 workers each under a limit of 20 on one real Redis; one is
// cut off for 3 s while the others keep Redis. The cut-off one uses its
// held slots until their term, then its share of 5 a term after its first
// failed call; the store gives its slots to the others once its term
// ends. Every request's time in flight is recorded: never more than 20 at
// once before the cut; at most 20 + 5 (the limit plus the cut-off
// process's share, the stated bound) during it and until the cut-off
// process's requests under its share have ended after the heal; never more
// than 20 a term after the heal.
func TestInFlightPartitionLongerThanTheTerm(t *testing.T) {
	if testing.Short() {
		t.Skip("6.5 s of load")
	}
	srv := redistest.Standalone(t)
	name := "in-flight-cut-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	const term = time.Second
	lims := make([]*Limiter, 4)
	var cut *cutStore
	for i := range lims {
		var store remote.Store = remote.NewRedis(srv.Client(t))
		if i == 0 {
			b, err := backendOf(store)
			if err != nil {
				t.Fatal(err)
			}
			cut = &cutStore{RedisStore: store.(*remote.RedisStore), b: b}
			store = cut
		}
		l, err := New(store, name, 20, WithFleetSize(4), WithTerm(term), WithStoreTimeout(50*time.Millisecond))
		if err != nil {
			t.Fatal(err)
		}
		lims[i] = l
		t.Cleanup(func() { _ = l.Close(context.Background()) })
	}
	flightsOf := load(lims, time.Now().Add(6500*time.Millisecond), time.Millisecond, 4*time.Millisecond)
	time.Sleep(time.Second) // load runs in real time
	cut.off.Store(true)
	cutAt := time.Now()
	time.Sleep(3 * time.Second)
	cut.off.Store(false)
	healed := time.Now()
	flights := flightsOf()
	var before, during, after []flight
	for _, f := range flights {
		switch {
		case f.To < cutAt.UnixNano():
			before = append(before, f)
		case f.From > healed.Add(term).UnixNano():
			after = append(after, f)
		default:
			during = append(during, f)
		}
	}
	t.Logf("%d requests; at most in flight at once: %d before the cut, %d from the cut to a term after the heal (%d requests), %d after (%d requests)",
		len(flights), mostAtOnce(before), mostAtOnce(during), len(during), mostAtOnce(after), len(after))
	if got := mostAtOnce(before); got > 20 {
		t.Errorf("%d in flight at once before the cut, limit 20", got)
	}
	if got := mostAtOnce(during); got > 25 {
		t.Errorf("%d in flight at once around the cut, stated bound 20 + 5", got)
	}
	if got := mostAtOnce(after); got > 20 {
		t.Errorf("%d in flight at once a term after the heal, limit 20", got)
	}
	if len(after) < 100 || len(during) < 100 {
		t.Errorf("%d requests around the cut, %d after: the fleet stalled", len(during), len(after))
	}
}

// load runs 8 workers on each limiter, acquiring a slot of "k" for a
// request of least plus up to spread of work, until stop; the function it
// returns waits for them and gives every request's time in flight.
func load(lims []*Limiter, stop time.Time, least, spread time.Duration) func() []flight {
	var mu sync.Mutex
	var flights []flight
	var wg sync.WaitGroup
	for i, l := range lims {
		for w := range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				rng := rand.New(rand.NewPCG(uint64(i), uint64(w)))
				for time.Now().Before(stop) {
					actx, cancel := context.WithDeadline(context.Background(), stop)
					err := l.Acquire(actx, "k", 1)
					cancel()
					if err != nil {
						return
					}
					from := time.Now().UnixNano()
					time.Sleep(least + time.Duration(rng.Int64N(int64(spread)))) // the request
					mu.Lock()
					flights = append(flights, flight{from, time.Now().UnixNano()})
					mu.Unlock()
					l.Release("k", 1)
				}
			}()
		}
	}
	return func() []flight {
		wg.Wait()
		return flights
	}
}
