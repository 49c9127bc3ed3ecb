package hybrid

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"github.com/stretchr/testify/require"
)

// soakDuration is how long each case of TestSoak runs: 9 s in make test,
// LEASEHOLD_SOAK_DURATION (make soak: 10m) otherwise.
func soakDuration(t *testing.T) time.Duration {
	if s := os.Getenv("LEASEHOLD_SOAK_DURATION"); s != "" {
		d, err := time.ParseDuration(s)
		require.NoError(t, err)
		return d
	}
	return 7 * time.Second
}

// TestSoak runs 4 limiters on 8 keys of one real Redis under random
// faults (hang, crash with data loss, SCRIPT FLUSH, slow periods) and
// checks the end state: no errors but corrupt-free decisions, every key's
// books balance (tokens leased = spent + given back or expired + still
// held, and spent = the lease admissions callers saw), no goroutine left
// after Close, and a heap that did not grow with time.
func TestSoak(t *testing.T) {
	if testing.Short() {
		t.Skip("soak")
	}
	srv := redistest.NewServer(t)
	lims := newFleet(t, 4, Policy{Name: "soak", Limit: Limit{Rate: 2000, Period: time.Second, Burst: 400}}, dial(srv),
		WithHeartbeat(100*time.Millisecond, 300*time.Millisecond))
	keys := make([]string, 8)
	for i := range keys {
		keys[i] = fmt.Sprintf("soak:%d", i)
	}
	goroutinesBefore := runtime.NumGoroutine()
	d := soakDuration(t)
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	// spent[l][k]: tokens callers saw admitted from leases (n = 1 each).
	spent := make([][]atomic.Int64, len(lims))
	for i := range spent {
		spent[i] = make([]atomic.Int64, len(keys))
	}
	// seen[l][k]: every entry key k had in limiter l, so that the books
	// still add up if one is replaced (the key forgotten and tracked
	// again); a key in use should not be, and the log says if it was.
	seen := make([][]entrySet, len(lims))
	for i := range seen {
		seen[i] = make([]entrySet, len(keys))
	}
	var errs atomic.Int64
	var wg sync.WaitGroup
	for li, l := range lims {
		for g := 0; g < 4; g++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				r := rand.New(rand.NewPCG(uint64(li), uint64(g)))
				for ctx.Err() == nil {
					k := r.IntN(len(keys))
					dec, err := l.AllowN(context.Background(), keys[k], 1)
					switch {
					case err != nil:
						errs.Add(1)
					case dec.Allowed && (dec.Source == SourceLease || dec.Source == SourceRemote):
						spent[li][k].Add(1)
					}
					seen[li][k].note(l.keys.load(keys[k]))
					if r.IntN(8) == 0 {
						time.Sleep(time.Duration(r.IntN(2000)) * time.Microsecond) // uneven demand
					}
				}
			}()
		}
	}
	heapAt := func() uint64 {
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return m.HeapAlloc
	}
	var heapEarly uint64
	faults := injectFaults(ctx, t, srv, d, func() { heapEarly = heapAt() })
	wg.Wait()
	faults.Wait()
	heapLate := heapAt()
	eventually(t, "the fleet healthy after the last fault", func() bool {
		for _, l := range lims {
			l.Allow(context.Background(), keys[0])
		}
		return allHealthy(lims)
	})
	replaced := 0
	for li, l := range lims {
		quiesce(t, l)
		for k, key := range keys {
			e := l.keys.load(key)
			if e == nil {
				continue
			}
			kept, held := e.inflow.Load(), e.lease.Tokens()
			if admits := leaseAdmits(e); kept != admits+held {
				t.Errorf("limiter %d key %s: leased less returned or expired %d != spent %d + held %d", li, key, kept, admits, held)
			}
			seen[li][k].note(e)
			entries, admits := seen[li][k].admits()
			replaced += entries - 1
			if got := spent[li][k].Load(); got > admits {
				t.Errorf("limiter %d key %s: callers saw %d lease admissions, the books of its %d entries %d (%d evictions in the limiter)",
					li, key, got, entries, admits, l.Stats().Evictions)
			}
		}
	}
	for _, l := range lims {
		require.NoError(t, l.Close(context.Background()))
	}
	s := fleetStats(lims)
	t.Logf("soak %v: %d decisions, %d admitted, %d store calls, %d errors, %d keys tracked again; heap %d KiB early, %d KiB late; goroutines %d before, %d after Close",
		d, s.Admitted+s.Rejected, s.Admitted, s.StoreCalls, errs.Load(), replaced, heapEarly>>10, heapLate>>10, goroutinesBefore, runtime.NumGoroutine())
	if errs.Load() != 0 {
		t.Errorf("%d decisions returned errors", errs.Load())
	}
	if heapEarly > 0 && heapLate > 2*heapEarly+(4<<20) {
		t.Errorf("heap grew from %d to %d bytes over the soak", heapEarly, heapLate)
	}
	eventually(t, "goroutines back to where they were", func() bool { return runtime.NumGoroutine() <= goroutinesBefore+2 })
}

// injectFaults applies a random fault every 1–2 s until ctx ends: a hang
// (SIGSTOP) of 0.2–1 s, a crash with data loss and restart, a SCRIPT
// FLUSH, or a slow period (a hang of 100 ms every 300 ms). early is called
// once, after the first fault.
func injectFaults(ctx context.Context, t *testing.T, srv *redistest.Server, d time.Duration, early func()) *sync.WaitGroup {
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		r := rand.New(rand.NewPCG(uint64(d), 7))
		c := srv.Client(t)
		pause := func(p time.Duration) {
			if srv.Pause() == nil {
				time.Sleep(p)
				_ = srv.Resume()
			}
		}
		for i := 0; ; i++ {
			select {
			case <-ctx.Done():
				return
			case <-time.After(time.Duration(1000+r.IntN(1000)) * time.Millisecond):
			}
			switch r.IntN(4) {
			case 0:
				pause(time.Duration(200+r.IntN(800)) * time.Millisecond)
			case 1:
				if srv.Kill() == nil {
					time.Sleep(time.Duration(200+r.IntN(800)) * time.Millisecond)
					if err := srv.Restart(); err != nil {
						t.Errorf("restart: %v", err)
						return
					}
				}
			case 2:
				_ = c.ScriptFlush(context.Background()).Err()
			case 3:
				for j := 0; j < 3; j++ {
					pause(100 * time.Millisecond)
					time.Sleep(200 * time.Millisecond)
				}
			}
			if i == 0 {
				early()
			}
		}
	}()
	return &wg
}

// entrySet is the entries one key had in one limiter, in the order seen.
type entrySet struct {
	last atomic.Pointer[account]
	mu   sync.Mutex
	all  []*account
}

// note adds e (nil: none) if it is not the last entry noted.
func (s *entrySet) note(e *account) {
	if e == nil || s.last.Load() == e {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if !slices.Contains(s.all, e) {
		s.all = append(s.all, e)
	}
	s.last.Store(e)
}

// admits returns how many entries were noted and their admissions.
func (s *entrySet) admits() (entries int, admits int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, e := range s.all {
		admits += leaseAdmits(e)
	}
	return len(s.all), admits
}

// leaseAdmits is what e's lease admitted: its admissions less its grants'.
func leaseAdmits(e *account) int64 {
	granted, _ := e.granted()
	return e.admits.Load() - granted
}
