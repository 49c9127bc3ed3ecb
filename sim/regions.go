package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/remote"
	"github.com/leasehold/leasehold/remote/tiered"
)

// RegionSpec is one region of a tiered world: its processes share the
// region's store (a remote.Tiered over a MemoryStore per process) and
// lease from the world's store across a link.
type RegionSpec struct {
	Name      string `json:"name"`
	Processes int    `json:"processes"`
	// LinkMS is the one-way latency between the region and the world's
	// store, uniform in [link_ms, link_ms + link_jitter_ms].
	LinkMS       float64 `json:"link_ms"`
	LinkJitterMS float64 `json:"link_jitter_ms"`
}

// sched makes a tiered world's background calls replay exactly. Tiered
// stores start them through spawn, and every call to the world's store
// waits on the virtual clock in a link. After anything that may have
// started or woken a call, the simulation waits until every running call
// has blocked on the virtual clock again or ended (settle), so no call
// ever runs alongside the simulation loop.
//
// Only the stores' background calls wait: they carry a context value
// (background, through tiered.WithBaseContext). A call a process makes on
// its own (a debit after an outage, a policy write) runs inside the
// simulation loop, which cannot wait on the clock it drives, so it takes
// no virtual time.
type sched struct {
	mu      sync.Mutex
	changed sync.Cond // signalled whenever running or waiting changes
	running int       // calls started and not ended
	waiting int       // of them, blocked on the virtual clock
}

// background marks the context of a tiered store's background calls.
type background struct{}

// baseContext is the base context of every tiered store of the world.
var baseContext = context.WithValue(context.Background(), background{}, true)

func newSched() *sched {
	s := &sched{}
	s.changed.L = &s.mu
	return s
}

// add changes the counts and wakes settle.
func (s *sched) add(running, waiting int) {
	s.mu.Lock()
	s.running += running
	s.waiting += waiting
	s.mu.Unlock()
	s.changed.Broadcast()
}

func (s *sched) spawn(run func()) {
	s.add(1, 0)
	go func() {
		defer s.add(-1, 0)
		run()
	}()
	s.settle()
}

// settle returns once every running call is waiting or ended.
func (s *sched) settle() {
	s.mu.Lock()
	for s.running != s.waiting {
		s.changed.Wait()
	}
	s.mu.Unlock()
}

// link is a region's view of the world's store: every call takes the
// link's latency there and back in virtual time, or fails at once while
// the link is cut.
type link struct {
	world *remote.MemoryStore
	clk   *clock.Manual
	sched *sched
	spec  RegionSpec
	mu    sync.Mutex // guards rng
	rng   *rand.Rand
	cut   atomic.Bool
	calls atomic.Int64
}

var (
	_ tiered.Parent  = (*link)(nil)
	_ remote.Granter = (*link)(nil)
)

var errLinkCut = fmt.Errorf("sim: link to the world's store: %w: %w", remote.ErrUnavailable, remote.ErrUnreachable)

// cross waits one round trip on the virtual clock (for calls of spawned
// goroutines); an error if the link is cut or ctx ended first.
func (l *link) cross(ctx context.Context) error {
	l.calls.Add(1)
	if l.cut.Load() {
		return errLinkCut
	}
	if ctx.Value(background{}) == nil {
		return nil // a process's own call: no virtual time (see sched)
	}
	l.mu.Lock()
	rtt := 2 * ms(l.spec.LinkMS+l.spec.LinkJitterMS*l.rng.Float64())
	l.mu.Unlock()
	done := make(chan struct{})
	var once sync.Once
	wake := func() { once.Do(func() { l.sched.add(0, -1); close(done) }) }
	tm := l.clk.AfterFunc(rtt, func() {
		wake()
		l.sched.settle() // the call runs to its end before time moves on
	})
	// Counted as waiting only once the timer is set: until then settle
	// holds the simulation (and its clock) back.
	l.sched.add(0, 1)
	select {
	case <-done:
	case <-ctx.Done():
		tm.Stop()
		wake()
		return ctx.Err()
	}
	if l.cut.Load() {
		return errLinkCut // cut while the call was on its way
	}
	return nil
}

func (l *link) Lease(ctx context.Context, r remote.Request) (remote.Result, error) {
	if err := l.cross(ctx); err != nil {
		return remote.Result{}, err
	}
	return l.world.Lease(context.Background(), r)
}

func (l *link) Return(ctx context.Context, r remote.Request) (remote.Result, error) {
	if err := l.cross(ctx); err != nil {
		return remote.Result{}, err
	}
	return l.world.Return(context.Background(), r)
}

func (l *link) Debit(ctx context.Context, r remote.Request) (remote.Result, error) {
	if err := l.cross(ctx); err != nil {
		return remote.Result{}, err
	}
	return l.world.Debit(context.Background(), r)
}

func (l *link) Batch(ctx context.Context, op remote.Op, rs []remote.Request) []remote.Reply {
	if err := l.cross(ctx); err != nil {
		return remote.FailedReplies(len(rs), err)
	}
	return l.world.Batch(context.Background(), op, rs)
}

func (l *link) Grant(ctx context.Context, r remote.GrantRequest) (remote.Grant, error) {
	if err := l.cross(ctx); err != nil {
		return remote.Grant{}, err
	}
	return l.world.Grant(context.Background(), r)
}

func (l *link) Ungrant(ctx context.Context, r remote.GrantRequest, unspent int64) (remote.Result, error) {
	if err := l.cross(ctx); err != nil {
		return remote.Result{}, err
	}
	return l.world.Ungrant(context.Background(), r, unspent)
}

func (l *link) Weigh(ctx context.Context, prefix, policy, region string, weight int64, expiry time.Duration) (int64, error) {
	if err := l.cross(ctx); err != nil {
		return 0, err
	}
	return l.world.Weigh(context.Background(), prefix, policy, region, weight, expiry)
}

func (l *link) SetPolicy(ctx context.Context, prefix, name string, rec remote.PolicyRecord) (remote.PolicyRecord, bool, error) {
	if err := l.cross(ctx); err != nil {
		return remote.PolicyRecord{}, false, err
	}
	return l.world.SetPolicy(context.Background(), prefix, name, rec)
}

func (l *link) GetPolicy(ctx context.Context, prefix, name string) (remote.PolicyRecord, bool, error) {
	if err := l.cross(ctx); err != nil {
		return remote.PolicyRecord{}, false, err
	}
	return l.world.GetPolicy(context.Background(), prefix, name)
}

func (l *link) WatchPolicy(ctx context.Context, prefix, name string, changed func()) (func(), error) {
	// Pushes are not modeled as delayed or lost: polling and the pools'
	// versions cover both.
	return l.world.WatchPolicy(ctx, prefix, name, changed)
}

// region is one region of a running world.
type region struct {
	spec  RegionSpec
	store *remote.MemoryStore
	link  *link
}

// newRegions builds the world's regions, each with its own store and link.
func (w *world) newRegions() {
	w.sched = newSched()
	for i, spec := range w.sc.Regions {
		w.regions = append(w.regions, &region{spec: spec, store: remote.NewMemory(w.clk), link: &link{
			world: w.mem, clk: w.clk, sched: w.sched, spec: spec,
			rng: rand.New(rand.NewPCG(w.seed, uint64(i)+7000)),
		}})
	}
}

// tiered returns a new Tiered store for a process of region ri.
func (w *world) tiered(ri int) (*tiered.Store, error) {
	rg := w.regions[ri]
	w.incarnations++
	return tiered.New(rg.spec.Name, rg.store, rg.link, tiered.WithClock(w.clk), tiered.WithSpawn(w.sched.spawn),
		tiered.WithBaseContext(baseContext), tiered.WithSeed(w.seed*1_000_033+w.incarnations),
		tiered.WithCapacityLeases(sec(w.sc.RegionCapacityLeaseS)))
}

// regionOf returns the region index of the process with id (by spawn
// order: the first region's processes first).
func (w *world) regionOf(id int) int {
	for i, rg := range w.sc.Regions {
		if id < rg.Processes {
			return i
		}
		id -= rg.Processes
	}
	return len(w.sc.Regions) - 1
}

// cutLinks cuts (or mends) the link of the named region, or of every
// region for "".
func (w *world) cutLinks(name string, on bool) {
	for _, rg := range w.regions {
		if name == "" || rg.spec.Name == name {
			rg.link.cut.Store(on)
		}
	}
}
