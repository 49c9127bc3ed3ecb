package main

import (
	"context"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"sort"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/leasehold/leasehold/breaker"
	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/hybrid"
	"github.com/leasehold/leasehold/inflight"
	"github.com/leasehold/leasehold/remote"
	"github.com/leasehold/leasehold/remote/tiered"
)

// refillTimeout mirrors hybrid's background store deadline: a modeled call
// slower than this fails as a timeout, as it would against real Redis.
const refillTimeout = 500 * time.Millisecond

var start = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// skewClock is a process clock that reads the shared virtual clock plus an
// offset that skew events change. Timers run on the shared clock.
type skewClock struct {
	*clock.Manual
	offset atomic.Int64
}

func (c *skewClock) Now() time.Time { return c.Manual.Now().Add(time.Duration(c.offset.Load())) }

// process is one simulated service instance.
type process struct {
	id     int
	region int // index in the world's regions; 0 without regions
	lim    *hybrid.Limiter
	slots  *inflight.Limiter // in-flight traffic only
	clk    *skewClock
	store  *faultStore
	tiered *tiered.Store // the process's store in a tiered world
	alive  bool
	// crashed: stopped without Close (a crash event); closed only when
	// the run ends, its store cut meanwhile so nothing it does reaches it.
	crashed bool
}

// world is one scenario run: a manual clock, a MemoryStore, a fault layer
// per process, and the fleet.
type world struct {
	sc      *Scenario
	clk     *clock.Manual
	mem     *remote.MemoryStore
	procs   []*process
	rng     *rand.Rand
	dt      time.Duration
	policy  hybrid.Policy
	rec     *recorder
	zipfs   []*rand.Zipf
	keys    [][]string
	nextID  int
	ctx     context.Context
	pending []timedAction
	seed    uint64
	tier    atomic.Value // string: the tier every key is under
	// incarnations counts limiters created, to seed each one apart.
	incarnations uint64
	// A tiered world's regions, and what replays their calls exactly.
	regions []*region
	sched   *sched
	// settles are the costed charges in flight (see costs.go).
	settles dueQueue[settling]
	// releases are the requests holding slots (see inflight.go).
	releases dueQueue[releasing]
}

type timedAction struct {
	at time.Duration
	do func()
}

// run plays a scenario and returns what it recorded.
func run(sc *Scenario, seed uint64, progress func(done, total time.Duration)) (*recorder, error) {
	w := &world{
		sc:     sc,
		clk:    clock.NewManual(start),
		rng:    rand.New(rand.NewPCG(seed, 0x1ea5e401d)),
		dt:     ms(sc.StepMS),
		seed:   seed,
		ctx:    context.Background(),
		policy: sc.Policy.policy(),
	}
	w.mem = remote.NewMemory(w.clk)
	if len(sc.Regions) > 0 {
		w.newRegions()
	}
	w.tier.Store(sc.Policy.Tier)
	w.rec = newRecorder(sc, w)
	for i, t := range sc.Traffic {
		keys := make([]string, t.Keys)
		for k := range keys {
			keys[k] = t.KeyPrefix + strconv.Itoa(k)
		}
		w.keys = append(w.keys, keys)
		var z *rand.Zipf
		if t.KeyDist == "zipf" && t.Keys > 1 {
			z = rand.NewZipf(rand.New(rand.NewPCG(seed, uint64(i)+1)), t.ZipfS, 1, uint64(t.Keys-1))
		}
		w.zipfs = append(w.zipfs, z)
	}
	for i := 0; i < sc.Processes; i++ {
		if err := w.spawn(); err != nil {
			return nil, err
		}
	}
	w.schedule()
	total := sec(sc.DurationS)
	steps := int(total / w.dt)
	for step := 0; step < steps; step++ {
		now := time.Duration(step) * w.dt
		w.runActions(now)
		w.rec.beginStep(now)
		w.settleDue(now)
		w.releaseDue(now)
		w.offer(now)
		w.slotStep(now, w.dt)
		w.clk.Advance(w.dt)
		w.rec.endStep(now + w.dt)
		if progress != nil && step%1000 == 0 {
			progress(now, total)
		}
	}
	w.close()
	return w.rec, nil
}

// close closes every process's limiters, then the tiers of stores under
// them, counting the in-flight limiters' store calls.
func (w *world) close() {
	for _, p := range w.procs {
		if p.alive || p.crashed {
			_ = p.lim.Close(w.ctx)
		}
		if p.slots != nil {
			w.rec.slots.calls += p.slots.Stats().StoreCalls
			_ = p.slots.Close(w.ctx)
		}
	}
	for _, p := range w.procs {
		if p.tiered != nil {
			_ = p.tiered.Close()
		}
	}
}

func (w *world) options(c clock.Clock) []hybrid.Option {
	l := w.sc.Limiter
	opts := []hybrid.Option{hybrid.WithClock(c), hybrid.WithLogger(slog.New(slog.DiscardHandler))}
	if len(w.sc.Policy.Tiers) > 0 {
		opts = append(opts, hybrid.WithTier(func(string) string { return w.tier.Load().(string) }))
	}
	if l.LeaseTTLMS > 0 {
		opts = append(opts, hybrid.WithLeaseTTL(ms(l.LeaseTTLMS)))
	}
	if l.StoreTimeoutMS > 0 {
		opts = append(opts, hybrid.WithStoreTimeout(ms(l.StoreTimeoutMS)))
	}
	if l.FleetSize > 0 {
		opts = append(opts, hybrid.WithFleetSize(l.FleetSize))
	}
	if l.MaxKeys > 0 {
		opts = append(opts, hybrid.WithMaxKeys(l.MaxKeys))
	}
	if l.CapacityLeaseS != 0 {
		opts = append(opts, hybrid.WithCapacityLeases(sec(max(l.CapacityLeaseS, 0))))
	}
	switch l.OutageMode {
	case "fail-open":
		opts = append(opts, hybrid.WithOutageMode(hybrid.OutageFailOpen))
	case "fail-closed":
		opts = append(opts, hybrid.WithOutageMode(hybrid.OutageFailClosed))
	}
	return opts
}

func (w *world) storeTimeout() time.Duration {
	if w.sc.Limiter.StoreTimeoutMS > 0 {
		return ms(w.sc.Limiter.StoreTimeoutMS)
	}
	return 50 * time.Millisecond
}

func (w *world) leaseTTL() time.Duration {
	if w.sc.Limiter.LeaseTTLMS > 0 {
		return ms(w.sc.Limiter.LeaseTTLMS)
	}
	return time.Second
}

// spawn adds a process with a fresh limiter.
func (w *world) spawn() error {
	id := w.nextID
	w.nextID++
	p := &process{id: id, clk: &skewClock{Manual: w.clk}, alive: true}
	var next simStore = w.mem
	if len(w.regions) > 0 {
		p.region = w.regionOf(id)
		ts, err := w.tiered(p.region)
		if err != nil {
			return err
		}
		p.tiered, next = ts, ts
	}
	p.store = &faultStore{next: next, rng: rand.New(rand.NewPCG(w.seed, uint64(id)+1000)), lat: w.sc.LatencyMS, rec: w.rec}
	if err := w.start(p); err != nil {
		return err
	}
	w.procs = append(w.procs, p)
	return nil
}

func (w *world) start(p *process) error {
	// One breaker per process, on the virtual clock.
	bs := breaker.NewStore(p.store, breaker.Settings{Clock: p.clk})
	// Seeded per process and incarnation: a run replays exactly.
	w.incarnations++
	opts := append(w.options(p.clk), hybrid.WithSeed(w.seed*1_000_003+uint64(w.incarnations)))
	lim, err := hybrid.New(bs, w.policy, opts...)
	if err != nil {
		return fmt.Errorf("process %d: %w", p.id, err)
	}
	p.lim, p.alive = lim, true
	return w.slotLimiter(p)
}

func (w *world) alive() []*process {
	var out []*process
	for _, p := range w.procs {
		if p.alive {
			out = append(out, p)
		}
	}
	return out
}

// schedule turns events into timed actions.
func (w *world) schedule() {
	for _, e := range w.sc.Events {
		switch e.Kind {
		case "outage", "hang", "latency", "partition":
			w.at(e.AtS, func() { w.setFault(e, true) })
			w.at(e.UntilS, func() { w.setFault(e, false) })
		case "link":
			w.at(e.AtS, func() { w.cutLinks(e.Region, true) })
			w.at(e.UntilS, func() { w.cutLinks(e.Region, false) })
		case "skew":
			w.at(e.AtS, func() { w.skew(ms(e.SkewMS)) })
		case "policy":
			w.at(e.AtS, func() { w.changePolicy(e) })
		case "tier":
			w.at(e.AtS, func() {
				w.tier.Store(e.Tier)
				w.rec.tierChanged(sec(e.AtS), e.Tier)
			})
		case "restart":
			every := sec(e.EveryS)
			for i := 0; i < w.sc.Processes; i++ {
				w.pending = append(w.pending, timedAction{sec(e.AtS) + time.Duration(i)*every, func() { w.restart(i) }})
			}
		case "crash":
			w.at(e.AtS, func() {
				ps := w.alive()
				for _, p := range ps[max(len(ps)-max(e.Count, 1), 1):] {
					p.store.down.Store(true)
					p.alive, p.crashed = false, true
				}
			})
		case "join":
			w.at(e.AtS, func() {
				for i := 0; i < max(e.Count, 1); i++ {
					_ = w.spawn()
				}
			})
		case "leave":
			w.at(e.AtS, func() {
				ps := w.alive()
				for _, p := range ps[max(len(ps)-max(e.Count, 1), 1):] {
					_ = p.lim.Close(w.ctx)
					p.alive = false
				}
			})
		}
	}
	sort.SliceStable(w.pending, func(i, j int) bool { return w.pending[i].at < w.pending[j].at })
}

// at schedules f at virtual second s.
func (w *world) at(s float64, f func()) { w.pending = append(w.pending, timedAction{sec(s), f}) }

// setFault turns a store fault on or off for the processes it touches.
func (w *world) setFault(e EventSpec, on bool) {
	ps := w.alive()
	n := len(ps)
	if e.Kind == "partition" {
		n = int(math.Ceil(e.Fraction * float64(len(ps))))
	}
	for _, p := range ps[:n] {
		switch e.Kind {
		case "outage", "partition":
			p.store.down.Store(on)
		case "hang":
			p.store.hang.Store(on)
		case "latency":
			extra := int64(0)
			if on {
				extra = int64(ms(e.LatencyMS))
			}
			p.store.extra.Store(extra)
		}
	}
}

// skew moves every other process's clock ahead by d and the rest back.
func (w *world) skew(d time.Duration) {
	for i, p := range w.alive() {
		if i%2 == 1 {
			p.clk.offset.Store(int64(-d))
		} else {
			p.clk.offset.Store(int64(d))
		}
	}
}

// changePolicy rolls out the event's limit from the first live process.
func (w *world) changePolicy(e EventSpec) {
	p := w.policy
	p.Limit.Rate, p.Limit.Burst = e.Rate, e.Burst
	p.Version++
	if err := w.alive()[0].lim.SetPolicy(w.ctx, p); err == nil {
		w.policy = p
		w.rec.policyChanged(sec(e.AtS), p.Limit)
	}
}

// restart closes process i and starts it again, if it is alive.
func (w *world) restart(i int) {
	p := w.procs[i]
	if !p.alive {
		return
	}
	_ = p.lim.Close(w.ctx)
	p.alive = false
	_ = w.start(p)
}

func (w *world) runActions(now time.Duration) {
	for len(w.pending) > 0 && w.pending[0].at <= now {
		w.pending[0].do()
		w.pending = w.pending[1:]
	}
}

// offer generates this step's requests, process by process.
func (w *world) offer(now time.Duration) {
	ps := w.alive()
	stepS := w.dt.Seconds()
	tS := now.Seconds()
	for ti, t := range w.sc.Traffic {
		if tS < t.FromS || tS >= t.UntilS {
			continue
		}
		for i, p := range ps {
			if t.Region != "" && w.sc.Regions[p.region].Name != t.Region {
				continue
			}
			rate := t.rateAt(tS)
			if t.ProcessSkew > 0 && len(ps) > 1 {
				rate *= 1 - t.ProcessSkew/2 + t.ProcessSkew*float64(i)/float64(len(ps)-1)
			}
			var n int
			switch t.Pattern {
			case "constant", "diurnal":
				n = int(math.Floor((tS+stepS)*rate) - math.Floor(tS*rate))
			case "poisson":
				n = poisson(w.rng, rate*stepS)
			case "bursty":
				cycle := t.OnS + t.OffS
				if math.Mod(tS-t.FromS, cycle) < t.OnS {
					n = int(math.Floor((tS+stepS)*rate) - math.Floor(tS*rate))
				}
			}
			for j := 0; j < n; j++ {
				key := w.keys[ti][0]
				if t.Keys > 1 {
					if z := w.zipfs[ti]; z != nil {
						key = w.keys[ti][z.Uint64()]
					} else {
						key = w.keys[ti][w.rng.IntN(t.Keys)]
					}
				}
				if t.InFlight != nil {
					w.acquire(now, p, key, t.InFlight)
					continue
				}
				p.store.lastLatency = 0
				var d hybrid.Decision
				var err error
				n := int64(1)
				if t.Cost != nil {
					n = t.Cost.Estimate
					d, err = w.charge(now, p, key, t.Cost)
				} else {
					d, err = p.lim.AllowN(w.ctx, key, 1)
				}
				var lat time.Duration
				if err == nil && d.Source == hybrid.SourceRemote {
					lat = min(p.store.lastLatency, w.storeTimeout())
				}
				w.rec.decision(now, p.id, key, n, d, err, lat)
			}
		}
	}
}

// poisson draws from a Poisson distribution of mean m (Knuth; m is small,
// one step's worth of requests).
func poisson(r *rand.Rand, m float64) int {
	if m > 30 {
		return int(math.Max(0, math.Round(m+math.Sqrt(m)*r.NormFloat64())))
	}
	l, k, p := math.Exp(-m), 0, 1.0
	for {
		p *= r.Float64()
		if p <= l {
			return k
		}
		k++
	}
}

// simStore is what a process's faultStore forwards to: the world's
// MemoryStore, or the process's Tiered store in a tiered world.
type simStore interface {
	remote.Store
	remote.Fleet
	remote.Policies
}

// faultStore is one process's view of the shared store: calls can fail
// (outage, partition), time out (hang, or latency above the refill
// timeout) or succeed after a modeled latency. Calls take no virtual time:
// a call the limiter would have waited for longer than its store timeout
// is recorded with the timeout as its latency.
type faultStore struct {
	next        simStore
	rng         *rand.Rand
	lat         LatencySpec
	rec         *recorder
	down, hang  atomic.Bool
	extra       atomic.Int64
	lastLatency time.Duration
}

// Unwrap returns the store behind the faults, through which hybrid.New
// finds a tiered world's store (its leases are plain, not stock).
func (f *faultStore) Unwrap() remote.Store { return f.next }

var errTimeout = fmt.Errorf("sim: %w: %w", remote.ErrUnavailable, context.DeadlineExceeded)
var errRefused = fmt.Errorf("sim: %w: connection refused", remote.ErrUnavailable)

func (f *faultStore) gate(kind callKind) error {
	f.rec.storeCall(kind)
	lat := ms(f.lat.Base+f.lat.Jitter*f.rng.Float64()) + time.Duration(f.extra.Load())
	f.lastLatency = lat
	switch {
	case f.down.Load():
		return errRefused
	case f.hang.Load() || lat > refillTimeout:
		return errTimeout
	}
	return nil
}

func (f *faultStore) Lease(ctx context.Context, r remote.Request) (remote.Result, error) {
	if err := f.gate(callLease); err != nil {
		return remote.Result{}, err
	}
	res, err := f.next.Lease(ctx, r)
	if err == nil {
		f.rec.leaseAnswered(&r, &res)
	}
	return res, err
}

func (f *faultStore) Return(ctx context.Context, r remote.Request) (remote.Result, error) {
	if err := f.gate(callReturn); err != nil {
		return remote.Result{}, err
	}
	return f.next.Return(ctx, r)
}

func (f *faultStore) Debit(ctx context.Context, r remote.Request) (remote.Result, error) {
	if err := f.gate(callDebit); err != nil {
		return remote.Result{}, err
	}
	return f.next.Debit(ctx, r)
}

func (f *faultStore) Batch(ctx context.Context, op remote.Op, rs []remote.Request) []remote.Reply {
	if err := f.gate(kindOf(op)); err != nil {
		return remote.FailedReplies(len(rs), err)
	}
	out := f.next.Batch(ctx, op, rs)
	if op == remote.OpLease {
		for i := range out {
			if out[i].Err == nil {
				f.rec.leaseAnswered(&rs[i], &out[i].Result)
			}
		}
	}
	return out
}

func (f *faultStore) Heartbeat(ctx context.Context, prefix, policy, member string, expiry time.Duration) (int, error) {
	if err := f.gate(callFleet); err != nil {
		return 0, err
	}
	return f.next.Heartbeat(ctx, prefix, policy, member, expiry)
}

func (f *faultStore) Leave(ctx context.Context, prefix, policy, member string) error {
	if err := f.gate(callFleet); err != nil {
		return err
	}
	return f.next.Leave(ctx, prefix, policy, member)
}

func (f *faultStore) SetPolicy(ctx context.Context, prefix, name string, rec remote.PolicyRecord) (remote.PolicyRecord, bool, error) {
	if err := f.gate(callPolicy); err != nil {
		return remote.PolicyRecord{}, false, err
	}
	return f.next.SetPolicy(ctx, prefix, name, rec)
}

func (f *faultStore) GetPolicy(ctx context.Context, prefix, name string) (remote.PolicyRecord, bool, error) {
	if err := f.gate(callPolicy); err != nil {
		return remote.PolicyRecord{}, false, err
	}
	return f.next.GetPolicy(ctx, prefix, name)
}

// Grant passes a capacity grant call on when the store keeps grants.
func (f *faultStore) Grant(ctx context.Context, r remote.GrantRequest) (remote.Grant, error) {
	g, ok := f.next.(remote.Granter)
	if !ok {
		return remote.Grant{}, remote.ErrNoGrants
	}
	if err := f.gate(callGrant); err != nil {
		return remote.Grant{}, err
	}
	return g.Grant(ctx, r)
}

// Ungrant passes a grant's return on when the store keeps grants.
func (f *faultStore) Ungrant(ctx context.Context, r remote.GrantRequest, unspent int64) (remote.Result, error) {
	g, ok := f.next.(remote.Granter)
	if !ok {
		return remote.Result{}, remote.ErrNoGrants
	}
	if err := f.gate(callGrant); err != nil {
		return remote.Result{}, err
	}
	return g.Ungrant(ctx, r, unspent)
}

func (f *faultStore) WatchPolicy(ctx context.Context, prefix, name string, changed func()) (func(), error) {
	// Pushes are not modeled as failing: polling covers a lost push.
	return f.next.WatchPolicy(ctx, prefix, name, changed)
}

var (
	_ remote.Store    = (*faultStore)(nil)
	_ remote.Fleet    = (*faultStore)(nil)
	_ remote.Policies = (*faultStore)(nil)
	_ remote.Granter  = (*faultStore)(nil)
)
