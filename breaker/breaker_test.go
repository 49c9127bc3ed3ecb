package breaker

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/internal/hooks"
	"github.com/leasehold/leasehold/local"
	"github.com/leasehold/leasehold/remote"
	"github.com/sony/gobreaker/v2"
)

// fake fails with ErrUnavailable while down, and sleeps delay per call.
type fake struct {
	remote.Store
	down  atomic.Bool
	full  atomic.Bool // down says out of memory
	delay atomic.Int64
	calls atomic.Int64
}

func (f *fake) Lease(ctx context.Context, r remote.Request) (remote.Result, error) {
	f.calls.Add(1)
	time.Sleep(time.Duration(f.delay.Load())) // simulated store latency
	if f.down.Load() {
		if f.full.Load() {
			return remote.Result{}, fmt.Errorf("%w: %w: %w", remote.ErrUnavailable, remote.ErrUnreachable, hooks.ErrFull)
		}
		return remote.Result{}, remote.ErrUnavailable
	}
	return f.Store.Lease(ctx, r)
}

var req = remote.Request{Policy: "p", Key: "k", Limit: local.PerSecond(1e6), N: 1}

func newFake() (*fake, *Store) {
	f := &fake{Store: remote.NewMemory(clock.Real())}
	s := NewStore(f, Settings{Latency: 20 * time.Millisecond, MaxBackoff: 400 * time.Millisecond,
		Breaker: gobreaker.Settings{Timeout: 50 * time.Millisecond}})
	return f, s
}

func waitState(t *testing.T, s *Store, want gobreaker.State, within time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	for s.State() != want {
		if time.Since(start) > within {
			t.Fatalf("state %v after %v, want %v", s.State(), within, want)
		}
		time.Sleep(time.Millisecond) // polling with a deadline
	}
	return time.Since(start)
}

func TestOpensOnErrorsAndFailsFast(t *testing.T) {
	t.Parallel()
	f := &fake{Store: remote.NewMemory(clock.Real())}
	var changes atomic.Int64
	s := NewStore(f, Settings{Latency: 20 * time.Millisecond, MaxBackoff: 400 * time.Millisecond,
		Breaker: gobreaker.Settings{Timeout: 50 * time.Millisecond,
			OnStateChange: func(string, gobreaker.State, gobreaker.State) { changes.Add(1) }}})
	ctx := context.Background()
	f.down.Store(true)
	for i := 0; i < 3; i++ {
		if _, err := s.Lease(ctx, req); !errors.Is(err, remote.ErrUnavailable) {
			t.Fatalf("call %d: %v, want ErrUnavailable", i, err)
		}
	}
	if got := s.State(); got != gobreaker.StateOpen {
		t.Fatalf("after 3 failures state = %v, want open", got)
	}
	if changes.Load() == 0 {
		t.Fatal("OnStateChange did not hear of the state change")
	}
	before := f.calls.Load()
	_, err := s.Lease(ctx, req)
	if !errors.Is(err, ErrOpen) || !errors.Is(err, remote.ErrUnavailable) {
		t.Fatalf("call on open breaker: %v, want ErrOpen and ErrUnavailable", err)
	}
	if f.calls.Load() != before {
		t.Fatal("open breaker called the store")
	}
	// Recovery: the half-open probe succeeds and the breaker closes.
	f.down.Store(false)
	waitState(t, s, gobreaker.StateHalfOpen, time.Second)
	if _, err := s.Lease(ctx, req); err != nil {
		t.Fatalf("probe: %v", err)
	}
	if got := s.State(); got != gobreaker.StateClosed {
		t.Fatalf("after a good probe state = %v, want closed", got)
	}
}

func TestBadInputDoesNotTrip(t *testing.T) {
	t.Parallel()
	_, s := newFake()
	bad := req
	bad.Key = ""
	for i := 0; i < 10; i++ {
		if _, err := s.Lease(context.Background(), bad); !errors.Is(err, remote.ErrInvalidKey) {
			t.Fatalf("bad input: %v", err)
		}
	}
	if got := s.State(); got != gobreaker.StateClosed {
		t.Fatalf("state after bad input = %v, want closed", got)
	}
}

func TestOpensOnLatencyAlone(t *testing.T) {
	t.Parallel()
	f, s := newFake()
	f.delay.Store(int64(30 * time.Millisecond)) // above the 20 ms threshold
	for i := 0; i < 3; i++ {
		res, err := s.Lease(context.Background(), req)
		if err != nil || res.Granted != 1 {
			t.Fatalf("slow call %d = %+v, %v; want a good answer", i, res, err)
		}
	}
	if got := s.State(); got != gobreaker.StateOpen {
		t.Fatalf("after 3 slow calls state = %v, want open", got)
	}
}

func TestProbeBackoffDoubles(t *testing.T) {
	t.Parallel()
	f, s := newFake()
	f.down.Store(true)
	for i := 0; i < 3; i++ {
		_, _ = s.Lease(context.Background(), req)
	}
	// Each failed probe doubles the wait: 50, 100, 200 ms, then capped 400.
	var waits []time.Duration
	for i := 0; i < 4; i++ {
		waits = append(waits, waitState(t, s, gobreaker.StateHalfOpen, 2*time.Second))
		if _, err := s.Lease(context.Background(), req); err == nil {
			t.Fatal("probe succeeded against a down store")
		}
	}
	for i, want := range []time.Duration{40, 90, 190, 390} {
		if waits[i] < want*time.Millisecond {
			t.Fatalf("wait before probe %d = %v, want ≥ %vms (all: %v)", i, waits[i], want, waits)
		}
	}
}

func TestFleetPassThrough(t *testing.T) {
	t.Parallel()
	s := NewStore(remote.NewMemory(clock.Real()), Settings{})
	if _, ok := s.Unwrap().(remote.Fleet); !ok {
		t.Fatal("MemoryStore behind a breaker cannot count its fleet")
	}
	n, err := s.Heartbeat(context.Background(), "", "p", "a", time.Second)
	if err != nil || n != 1 {
		t.Fatalf("Heartbeat = %d, %v", n, err)
	}
	if err := s.Leave(context.Background(), "", "p", "a"); err != nil {
		t.Fatal(err)
	}
}

// TestOpenPeriodFollowsTheClock: on a manual clock the breaker stays open
// until the clock, not the wall, passes the open period.
func TestOpenPeriodFollowsTheClock(t *testing.T) {
	t.Parallel()
	s, clk := openOnManualClock()
	time.Sleep(20 * time.Millisecond) // wall time passes; the breaker must not care
	if got := s.State(); got != gobreaker.StateOpen {
		t.Fatalf("state = %v before the clock moved, want open", got)
	}
	clk.Advance(999 * time.Millisecond)
	if got := s.State(); got != gobreaker.StateOpen {
		t.Fatalf("state = %v at 999ms, want open", got)
	}
	clk.Advance(time.Millisecond)
	if got := s.State(); got != gobreaker.StateHalfOpen {
		t.Fatalf("state = %v at 1s, want half-open", got)
	}
}

// TestOnStateChangeMayCallBack: the user's callback runs outside
// gobreaker's lock, so one that asks for the state or calls the store
// again does not deadlock (it did when it ran inside gobreaker's mutex,
// on the third failure), and it hears every change in order.
func TestOnStateChangeMayCallBack(t *testing.T) {
	t.Parallel()
	f := &fake{Store: remote.NewMemory(clock.Real())}
	var s *Store
	var seen []gobreaker.State
	s = NewStore(f, Settings{Breaker: gobreaker.Settings{Timeout: 10 * time.Millisecond,
		OnStateChange: func(_ string, from, to gobreaker.State) {
			seen = append(seen, to)
			_ = s.State()
			_, _ = s.Lease(context.Background(), req) // refused or a probe: either way no deadlock
		}}})
	f.down.Store(true)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := 0; i < 3; i++ {
			_, _ = s.Lease(context.Background(), req)
		}
	}()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("a callback calling back into the breaker deadlocked")
	}
	if len(seen) == 0 || seen[0] != gobreaker.StateOpen {
		t.Fatalf("callback saw %v, want open first", seen)
	}
}

// unreachable fails with remote.ErrUnreachable (a refused connection)
// while down.
type unreachable struct {
	remote.Store
	down atomic.Bool
}

func (u *unreachable) Lease(ctx context.Context, r remote.Request) (remote.Result, error) {
	if u.down.Load() {
		return remote.Result{}, errors.Join(remote.ErrUnavailable, remote.ErrUnreachable)
	}
	return u.Store.Lease(ctx, r)
}

// TestOpensOnFirstUnreachable: a refused or dropped connection means the
// store is down, not slow: one such failure opens the breaker.
func TestOpensOnFirstUnreachable(t *testing.T) {
	t.Parallel()
	u := &unreachable{Store: remote.NewMemory(clock.Real())}
	s := NewStore(u, Settings{})
	u.down.Store(true)
	_, _ = s.Lease(context.Background(), req)
	if got := s.State(); got != gobreaker.StateOpen {
		t.Fatalf("after one unreachable failure state = %v, want open", got)
	}
}

// TestReadsDoNotProbe: while the breaker is not closed, policy reads are
// refused without a call, so a store that answers reads but fails writes
// (Redis out of memory) cannot close the breaker through them.
func TestReadsDoNotProbe(t *testing.T) {
	t.Parallel()
	s, clk := openOnManualClock()
	clk.Advance(time.Second)
	if got := s.State(); got != gobreaker.StateHalfOpen {
		t.Fatalf("state = %v, want half-open", got)
	}
	for i := 0; i < 5; i++ {
		if _, _, err := s.GetPolicy(context.Background(), "", "p"); !errors.Is(err, ErrOpen) {
			t.Fatalf("GetPolicy on a half-open breaker: %v, want ErrOpen", err)
		}
	}
	if got := s.State(); got != gobreaker.StateHalfOpen {
		t.Fatalf("state after reads = %v, want still half-open", got)
	}
}

// downMemory is a MemoryStore (policies included) whose leases fail while
// down, as writes do on a Redis out of memory.
type downMemory struct {
	*remote.MemoryStore
	down atomic.Bool
}

func (d *downMemory) Lease(ctx context.Context, r remote.Request) (remote.Result, error) {
	if d.down.Load() {
		return remote.Result{}, remote.ErrUnavailable
	}
	return d.MemoryStore.Lease(ctx, r)
}

// openOnManualClock returns a breaker on a manual clock, with a 1 s open
// period, opened by three failed leases.
func openOnManualClock() (*Store, *clock.Manual) {
	clk := clock.NewManual(time.Unix(0, 0))
	f := &downMemory{MemoryStore: remote.NewMemory(clk)}
	s := NewStore(f, Settings{Clock: clk, Breaker: gobreaker.Settings{Timeout: time.Second}})
	f.down.Store(true)
	for i := 0; i < 3; i++ {
		_, _ = s.Lease(context.Background(), req)
	}
	return s, clk
}

// hung blocks every Lease until release is closed, ignoring the context,
// as a go-redis client without ContextTimeoutEnabled does on a paused
// Redis.
type hung struct {
	remote.Store
	release chan struct{}
}

func (h *hung) Lease(ctx context.Context, r remote.Request) (remote.Result, error) {
	<-h.release
	return h.Store.Lease(ctx, r)
}

// TestOpensOnACallThatHangs: one call outstanding past the latency
// threshold opens the breaker before it returns (timed on the real clock,
// whatever clock the breaker is given), and once the store answers again
// the breaker closes.
func TestOpensOnACallThatHangs(t *testing.T) {
	t.Parallel()
	clk := clock.NewManual(time.Unix(1_700_000_000, 0))
	h := &hung{Store: remote.NewMemory(clk), release: make(chan struct{})}
	s := NewStore(h, Settings{Latency: 50 * time.Millisecond, Clock: clk})
	done := make(chan error)
	began := time.Now()
	go func() { _, err := s.Lease(context.Background(), req); done <- err }()
	clk.Advance(time.Hour) // a jump of a manual clock is not a hung call
	if got := s.State(); got != gobreaker.StateClosed && time.Since(began) < 50*time.Millisecond {
		t.Fatalf("a call out for under 50 ms of real time: state %v, want closed", got)
	}
	waitState(t, s, gobreaker.StateOpen, 2*time.Second)
	close(h.release)
	<-done
	clk.Advance(300 * time.Millisecond) // past the open period: the next call probes
	if _, err := s.Lease(context.Background(), req); err != nil {
		t.Fatalf("probe after the store came back: %v", err)
	}
	if got := s.State(); got != gobreaker.StateClosed {
		t.Fatalf("after a good probe: state %v, want closed", got)
	}
}

// hungPolicies blocks every GetPolicy until release is closed, as a read
// of a policy record on a Cluster node still failing over does.
type hungPolicies struct {
	*remote.MemoryStore
	release chan struct{}
}

func (h *hungPolicies) GetPolicy(ctx context.Context, prefix, name string) (remote.PolicyRecord, bool, error) {
	<-h.release
	return h.MemoryStore.GetPolicy(ctx, prefix, name)
}

// TestSideCallsDoNotJudgeTheBuckets: a policy read outstanding far past
// the latency threshold leaves the breaker closed (it reopened limiters
// whose buckets were back in TestClusterFailover/kill), and bucket calls
// still go through meanwhile.
func TestSideCallsDoNotJudgeTheBuckets(t *testing.T) {
	t.Parallel()
	h := &hungPolicies{MemoryStore: remote.NewMemory(clock.Real()), release: make(chan struct{})}
	s := NewStore(h, Settings{Latency: 20 * time.Millisecond})
	done := make(chan error)
	go func() { _, _, err := s.GetPolicy(context.Background(), "", "p"); done <- err }()
	deadline := time.Now().Add(200 * time.Millisecond)
	for time.Now().Before(deadline) {
		if got := s.State(); got != gobreaker.StateClosed {
			t.Fatalf("a policy read outstanding for %v: state %v, want closed", time.Since(deadline.Add(-200*time.Millisecond)), got)
		}
		if _, err := s.Lease(context.Background(), req); err != nil {
			t.Fatalf("Lease beside a hung policy read: %v", err)
		}
		time.Sleep(5 * time.Millisecond) // real time must pass the 20 ms threshold
	}
	close(h.release)
	if err := <-done; err != nil {
		t.Fatalf("GetPolicy: %v", err)
	}
}

// TestInflightOldest: the oldest call in flight is found among the slots
// and beyond them (more calls than slots, as a slow store with many
// callers makes), and forgotten when it ends.
func TestInflightOldest(t *testing.T) {
	var f inflight
	t0 := time.Now()
	const calls = inflightSlots + 6
	ids := make([]uint64, calls)
	for i := range ids {
		ids[i] = f.begin(t0.Add(time.Duration(i) * time.Millisecond))
	}
	now := t0.Add(time.Second)
	for i, id := range ids {
		age, ok := f.oldest(now)
		if want := time.Second - time.Duration(i)*time.Millisecond; !ok || age != want {
			t.Fatalf("after %d ended: oldest %v, %v; want %v", i, age, ok, want)
		}
		f.end(id)
	}
	if age, ok := f.oldest(now); ok {
		t.Fatalf("nothing in flight, oldest %v", age)
	}
	// The slots are free again, and the overflow is empty.
	if id := f.begin(t0); id >= inflightSlots {
		t.Fatalf("a call after all ended took ticket %d, beyond the slots", id)
	}
	if f.over.Load() != 0 || len(f.starts) != 0 {
		t.Fatalf("overflow holds %d (%d starts) with nothing beyond the slots", f.over.Load(), len(f.starts))
	}
}

// TestInflightConcurrent: callers beginning and ending at once, more than
// the slots, leave nothing in flight.
func TestInflightConcurrent(t *testing.T) {
	var f inflight
	var wg sync.WaitGroup
	for range 4 * inflightSlots {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 200 {
				id := f.begin(time.Now())
				if _, ok := f.oldest(time.Now()); !ok {
					t.Error("a call in flight, oldest finds none")
					return
				}
				f.end(id)
			}
		}()
	}
	wg.Wait()
	for i := range f.slots {
		if v := f.slots[i].Load(); v != 0 {
			t.Fatalf("slot %d still holds a call", i)
		}
	}
	if n := f.over.Load(); n != 0 {
		t.Fatalf("%d calls left in flight beyond the slots", n)
	}
	if _, ok := f.oldest(time.Now()); ok {
		t.Fatal("nothing in flight, oldest finds a call")
	}
}

// TestInflightOverdue: overdue skips its scan only while no call in
// flight can be past the limit, so a skip never hides one: a call that
// began before a scan found nothing, one that began after, and one that
// read its start before the scan but took its slot after it.
func TestInflightOverdue(t *testing.T) {
	const limit = 100 * time.Millisecond
	t0 := time.Now()
	at := func(d time.Duration) time.Time { return t0.Add(d) }
	tests := []struct {
		name  string
		scan  time.Duration // an overdue check before the call
		begin time.Duration // the start the call reads
	}{
		{"in flight at the scan", 10 * time.Millisecond, 0},
		{"begun after the scan", 0, 30 * time.Millisecond},
		{"slot taken after the scan", 20 * time.Millisecond, 0},
		{"no scan before", -1, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var f inflight
			var id uint64
			registered := tt.name != "slot taken after the scan"
			if registered {
				id = f.begin(at(tt.begin))
			}
			if tt.scan >= 0 && f.overdue(at(tt.scan), limit) {
				t.Fatalf("overdue at %v with a call begun at %v", tt.scan, tt.begin)
			}
			if !registered {
				id = f.begin(at(tt.begin))
			}
			if f.overdue(at(tt.begin+limit-time.Millisecond), limit) {
				t.Fatalf("overdue %v before the limit", time.Millisecond)
			}
			if !f.overdue(at(tt.begin+limit+time.Millisecond), limit) {
				t.Fatalf("a call begun at %v not overdue at %v", tt.begin, tt.begin+limit+time.Millisecond)
			}
			f.end(id)
			if f.overdue(at(tt.begin+2*limit), limit) {
				t.Fatal("overdue with nothing in flight")
			}
		})
	}
}

// TestOutOfMemoryNeedsAStreak: a store that failed out of memory closes
// the breaker only after probesToClose good probes in a row, probeSpacing
// apart on the breaker's clock; a failure among them starts the streak
// again. Each good probe's answer reaches its caller, and calls between
// probes are refused without reaching the store.
func TestOutOfMemoryNeedsAStreak(t *testing.T) {
	t.Parallel()
	clk := clock.NewManual(time.Unix(1_700_000_000, 0))
	f := &fake{Store: remote.NewMemory(clk)}
	s := NewStore(f, Settings{Clock: clk, Breaker: gobreaker.Settings{Timeout: 50 * time.Millisecond}})
	ctx := context.Background()
	f.full.Store(true)
	f.down.Store(true)
	if _, err := s.Lease(ctx, req); !errors.Is(err, hooks.ErrFull) {
		t.Fatalf("first failure: %v, want ErrFull", err)
	}
	if got := s.State(); got != gobreaker.StateOpen {
		t.Fatalf("after an out-of-memory failure: %v, want open", got)
	}
	clk.Advance(50 * time.Millisecond)
	f.down.Store(false)
	probe := func(want error) {
		t.Helper()
		calls := f.calls.Load()
		if _, err := s.Lease(ctx, req); !errors.Is(err, want) && !(want == nil && err == nil) {
			t.Fatalf("probe: %v, want %v", err, want)
		}
		if f.calls.Load() != calls+1 {
			t.Fatal("the probe did not reach the store")
		}
		if want == nil && s.State() != gobreaker.StateClosed {
			calls = f.calls.Load()
			clk.Advance(probeSpacing - time.Millisecond)
			if _, err := s.Lease(ctx, req); !errors.Is(err, ErrOpen) || f.calls.Load() != calls {
				t.Fatalf("a call within probeSpacing of a probe: %v, %d store calls; want ErrOpen and none", err, f.calls.Load()-calls)
			}
			clk.Advance(time.Millisecond)
		}
	}
	for range probesToClose - 1 {
		probe(nil)
		if got := s.State(); got == gobreaker.StateClosed {
			t.Fatal("closed before the streak was long enough")
		}
	}
	f.down.Store(true)
	probe(remote.ErrUnavailable)
	clk.Advance(time.Second)
	f.down.Store(false)
	for i := range probesToClose {
		if got := s.State(); got == gobreaker.StateClosed {
			t.Fatalf("closed after %d good probes since a failure, want %d", i, probesToClose)
		}
		probe(nil)
	}
	if got := s.State(); got != gobreaker.StateClosed {
		t.Fatalf("after %d good probes in a row: %v, want closed", probesToClose, got)
	}
	// Closed, the store is an ordinary one again: a later plain failure
	// and one good probe close it.
	f.full.Store(false)
	f.down.Store(true)
	for range 3 {
		_, _ = s.Lease(ctx, req)
	}
	clk.Advance(time.Second)
	f.down.Store(false)
	probe(nil)
	if got := s.State(); got != gobreaker.StateClosed {
		t.Fatalf("after a plain outage and a good probe: %v, want closed", got)
	}
}
