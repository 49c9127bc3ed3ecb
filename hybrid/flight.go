package hybrid

import (
	"runtime"
	"sync"
)

// One store flight per key: concurrent callers that need the store for a
// key join the flight under way instead of making a call of their own.
// A caller that must answer within the store timeout leaves the flight to
// a worker and waits at most that long; the flight goes on without it,
// so that a slow answer still deposits its tokens. Workers are few and
// long-lived: a goroutine per flight (singleflight.DoChan's) cost a cold
// decision its creation, a fresh stack grown again in every store call,
// and several allocations.

// flight is one store call for a key, and its outcome once done closes.
type flight struct {
	done chan struct{}
	out  fetchOutcome
	err  error
}

// flightTable is the flights under way, by user key.
type flightTable struct {
	mu sync.Mutex
	m  map[string]*flight
}

// join returns key's flight under way, or a new one the caller leads.
func (t *flightTable) join(key string) (f *flight, lead bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if f = t.m[key]; f != nil {
		return f, false
	}
	if t.m == nil {
		t.m = map[string]*flight{}
	}
	f = &flight{done: make(chan struct{})}
	t.m[key] = f
	return f, true
}

// finish records f's outcome and releases those who joined it; a caller
// arriving after it starts a flight of its own.
func (t *flightTable) finish(key string, f *flight, out fetchOutcome, err error) {
	t.mu.Lock()
	delete(t.m, key)
	t.mu.Unlock()
	f.out, f.err = out, err
	close(f.done)
}

// workers runs flights handed over by callers that wait with a deadline.
type workers struct {
	bg    *background
	start sync.Once
	work  chan func()
}

// run runs f on an idle worker, or on a goroutine of its own when every
// worker is busy (a flight never waits for a worker).
func (w *workers) run(f func()) {
	w.start.Do(w.launch)
	select {
	case w.work <- f:
	default:
		go f()
	}
}

// launch starts the workers, two per CPU, which end when Close begins.
func (w *workers) launch() {
	w.work = make(chan func())
	for range 2 * runtime.GOMAXPROCS(0) {
		if !w.bg.enter() {
			return
		}
		go func() {
			defer w.bg.exit()
			for {
				select {
				case f := <-w.work:
					f()
				case <-w.bg.stop:
					return
				}
			}
		}()
	}
}
