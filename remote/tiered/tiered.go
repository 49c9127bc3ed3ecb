// Package tiered is tiers of stores, for a fleet that spans regions: a
// region's processes share a Store that answers from the region's own
// Redis and refills from a parent store (the world's) in the background,
// so one global limit holds across regions while no decision waits for
// the parent.
//
// The usual entry point is New:
//
//	world := remote.NewRedis(worldClient)
//	eu := remote.NewRedis(euClient)
//	store, err := tiered.New("eu", eu, world)
//	lim, err := hybrid.New(store, policy)
package tiered

import (
	"context"
	"fmt"
	"github.com/leasehold/leasehold/internal/errs"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/internal/keys"
	"github.com/leasehold/leasehold/local"
	"github.com/leasehold/leasehold/remote"
)

// Region is the store a region's processes share. Its pools need a store
// that can hold them: a *remote.RedisStore (or any Region whose
// Client() returns the go-redis client it runs on) or a
// *remote.MemoryStore; New refuses any other.
type Region interface {
	remote.Store
	remote.Policies
	remote.Fleet
}

// Parent is the store a tier leases from: the one that keeps the world's
// buckets, policies and region weights. A *remote.RedisStore, a
// *remote.MemoryStore, or another tier's *Store (tiers nest).
type Parent interface {
	remote.Store
	remote.Policies
	// Weigh records region's weight (its live limiters) until expiry and
	// returns the sum of the weights of every region heard from within
	// its expiry, so that a region cut off from the parent knows its
	// share.
	Weigh(ctx context.Context, prefix, policy, region string, weight int64, expiry time.Duration) (int64, error)
}

var (
	_ Region = (*Store)(nil)
	_ Parent = (*Store)(nil)
	_ Parent = (*remote.RedisStore)(nil)
	_ Parent = (*remote.MemoryStore)(nil)
)

// errConfig is what New and the options refuse with.
var errConfig = errs.New("tiered", "invalid configuration")

// Store is a remote.Store for the processes of one region. It answers from the
// region's own store (a pool per bucket, one round trip away) and refills
// each pool by leasing batches from a parent store, possibly across an
// ocean, in the background: a process's call never waits for the parent.
//
// Every token a pool hands out was granted by the parent's bucket, so the
// global bound Burst + Rate·t/Period holds across every region while the
// parent answers. A pool's batch is the region's recent demand over the
// refill horizon, at most half the parent's Burst (or the horizon's worth
// of its Rate, if more), so no region hoards; a bucket pool that no one
// refilled for the pool TTL gives what it holds back to the parent.
//
// With WithCapacityLeases a pool whose key has demand holds a capacity
// grant from the parent instead (see grant.go): it refills itself at the
// grant's rate until a margin before the term, so a region cut off for
// less than the term admits by its grant and the parent gives the other
// regions only what the grants leave.
//
// When the parent does not answer, takes go on from the pool; once it is
// dry, calls fail with remote.ErrUnavailable (and remote.ErrUnreachable) and the
// region's limiters run on their degraded shares, as for any store outage,
// with the world's size taken from the region weights (every region's live
// limiters, reported to the parent every beat). Their debits go to the
// parent when it is back.
//
// Debits and policy writes go to the parent; policy reads come from the
// region's copy, refreshed every beat, on every change the parent
// publishes, and whenever a refill meets a newer version. Fleet heartbeats
// count the region's limiters in the region's store and report the world's.
//
// Sliding windows: the parent counts a batch's tokens Period/10 after the
// refill, so pool tokens lapse unspent after Period/10 minus the process
// hold and minus the trip to the parent (and a batch is sized to what the
// region spends in that time); what lapses goes back to the parent's
// window. Windows shorter than about ten round trips to the parent get few
// tokens. Tokens a process gives back go back into the window pool's batch
// they came from, if it still holds it. No grant is future-dated
// (Request.MaxDelay is ignored).
//
// A Result from a Store is the pool's: Remaining is what the pool holds
// plus what the parent's bucket held at the last refill, ResetAfter the
// parent's time to full as of that refill, and Created is never set.
//
// Close the store after the limiters that use it.
type Store struct {
	region string
	local  Region
	recs   records
	parent Parent
	cfg    config

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	mu     sync.Mutex
	closed bool
	drains map[string]clock.Timer // pool key -> its give-back timer
	rng    *rand.Rand             // guarded by mu
	holder string                 // the region's name as a grant holder at the parent
	// noGrants: prefix and policy -> the version the parent refused
	// grants for (remote.ErrNoGrants); its pools lease batches.
	noGrants sync.Map

	parentCalls, refills, failures, givenBack, leased atomic.Int64
	rttMicros                                         atomic.Int64 // of the last refill's round trip
}

// Stats counts a Store's work since it was created.
type Stats struct {
	// ParentCalls is every call made to the parent store: refills, give
	// backs, debits, beats and policy reads and writes.
	ParentCalls int64
	// Refills is the refills that granted tokens; Failures the parent
	// calls that failed.
	Refills, Failures int64
	// Leased is tokens the parent granted to refills; GivenBack tokens
	// given back to it: of idle or lapsed pools, and of pools that held
	// tokens of an older policy version.
	Leased, GivenBack int64
}

// Option configures a Store.
type Option interface{ apply(*config) }

type config struct {
	gap, horizon, lead, poolTTL, beat, timeout, expiry time.Duration
	term                                               time.Duration // capacity leases; 0: off
	clk                                                clock.Clock
	spawn                                              func(run func())
	seed                                               uint64
	seeded                                             bool
	base                                               context.Context
}

// check names the first bad argument or option of New, and its value.
func (c *config) check(region string, local Region, parent Parent) error {
	durations := []struct {
		name string
		d    time.Duration
	}{{"WithRefillGap", c.gap}, {"WithBatchHorizon", c.horizon}, {"WithPoolTTL", c.poolTTL},
		{"WithRegionBeat", c.beat}, {"WithParentTimeout", c.timeout}, {"WithRegionExpiry", c.expiry}}
	for _, d := range durations {
		if d.d <= 0 {
			return fmt.Errorf("%w: %s(%v): must be positive", errConfig, d.name, d.d)
		}
	}
	switch {
	case region == "" || len(region) > remote.MaxKeyLen:
		return fmt.Errorf("%w: region %.40q: 1 to %d bytes", errConfig, region, remote.MaxKeyLen)
	case local == nil:
		return fmt.Errorf("%w: nil region store", errConfig)
	case parent == nil:
		return fmt.Errorf("%w: nil parent", errConfig)
	case c.term < 0 || (c.term > 0 && c.term < 8*c.gap):
		return fmt.Errorf("%w: WithCapacityLeases(%v): 0, or at least 8 refill gaps (%v)", errConfig, c.term, 8*c.gap)
	case c.expiry < c.beat:
		return fmt.Errorf("%w: WithRegionExpiry(%v): shorter than the beat, %v", errConfig, c.expiry, c.beat)
	case c.clk == nil:
		return fmt.Errorf("%w: WithClock(nil)", errConfig)
	case c.spawn == nil:
		return fmt.Errorf("%w: WithSpawn(nil)", errConfig)
	case c.base == nil:
		return fmt.Errorf("%w: WithBaseContext(nil)", errConfig)
	}
	return nil
}

type optionFunc func(*config)

func (f optionFunc) apply(c *config) { f(c) }

// WithRefillGap sets the least time between two refills of one pool (by
// any process of the region; each gap is drawn from [d, 1.25·d]), which
// bounds the calls a region makes to the parent per bucket. The default is
// 300 ms.
func WithRefillGap(d time.Duration) Option {
	return optionFunc(func(c *config) { c.gap = d })
}

// WithBatchHorizon sets how far ahead a refill provides: its batch is the
// region's recent demand over this time. A refill starts when the pool
// holds less than half of that. The default is 500 ms.
func WithBatchHorizon(d time.Duration) Option {
	return optionFunc(func(c *config) { c.horizon = d })
}

// WithPoolTTL sets how long a bucket pool keeps tokens after its last
// refill before giving them back to the parent. The default is 2 s.
func WithPoolTTL(d time.Duration) Option {
	return optionFunc(func(c *config) { c.poolTTL = d })
}

// WithRegionBeat sets how often the region reports its weight to the
// parent and reads the policy records from it. The default is 2 s.
func WithRegionBeat(d time.Duration) Option {
	return optionFunc(func(c *config) { c.beat = d })
}

// WithRegionExpiry sets how long the parent counts a region's weight
// after its last beat. It errs long: a region cut off from the parent
// cannot beat, and if its weight expired meanwhile the world would look
// smaller than it is when the link comes back, and every region's share
// in the next outage too big. A region that is gone for good keeps the
// others' shares small until then. The default is 5 minutes.
func WithRegionExpiry(d time.Duration) Option {
	return optionFunc(func(c *config) { c.expiry = d })
}

// WithParentTimeout bounds every background call to the parent. The
// default is 2 s.
func WithParentTimeout(d time.Duration) Option {
	return optionFunc(func(c *config) { c.timeout = d })
}

// WithClock sets the clock of the store's timers (give-backs); the
// stores' own clocks still decide. The default is the system clock.
func WithClock(c clock.Clock) Option {
	return optionFunc(func(t *config) { t.clk = c })
}

// WithSpawn sets how the store starts its background calls to the parent
// (refills, give-backs, beats); spawn must run run, at once or later. The
// default starts a goroutine. A simulation on a manual clock passes one
// that returns once run has blocked on its virtual clock or ended, so that
// its runs replay exactly.
func WithSpawn(spawn func(run func())) Option {
	return optionFunc(func(c *config) { c.spawn = spawn })
}

// WithBaseContext sets the context every background call to the parent
// (refills, give-backs, beats, policy copies) derives from; Close cancels
// them all. Its values reach the parent's methods, so a parent can tell
// these calls from a process's own (a simulation does, to let only them
// take virtual time). The default is context.Background().
func WithBaseContext(ctx context.Context) Option {
	return optionFunc(func(c *config) { c.base = ctx })
}

// WithSeed makes the store's jitter repeatable, for simulations and
// tests. By default it is seeded at random.
func WithSeed(seed uint64) Option {
	return optionFunc(func(c *config) { c.seed, c.seeded = seed, true })
}

// New returns the Store of region, which answers from local and leases
// from parent. Region names the region among the parent's (its weight's
// entry): 1 to remote.MaxKeyLen bytes.
func New(region string, local Region, parent Parent, opts ...Option) (*Store, error) {
	cfg := config{
		gap: 300 * time.Millisecond, horizon: 500 * time.Millisecond, poolTTL: 2 * time.Second,
		beat: 2 * time.Second, timeout: 2 * time.Second, expiry: 5 * time.Minute, clk: clock.Real(),
		spawn: func(run func()) { go run() }, base: context.Background(),
	}
	for _, o := range opts {
		o.apply(&cfg)
	}
	if err := cfg.check(region, local, parent); err != nil {
		return nil, err
	}
	recs, err := recordsOf(local)
	if err != nil {
		return nil, err
	}
	cfg.lead = cfg.horizon / 2
	if !cfg.seeded {
		cfg.seed = rand.Uint64()
	}
	t := &Store{region: region, local: local, recs: recs, parent: parent, cfg: cfg, drains: map[string]clock.Timer{},
		rng: rand.New(rand.NewPCG(cfg.seed, 0x7133ed)), holder: grantHolder(region)}
	t.rttMicros.Store(cfg.gap.Microseconds() / 3) // until a refill measures it
	t.ctx, t.cancel = context.WithCancel(cfg.base)
	return t, nil
}

// Region returns the region's name.
func (t *Store) Region() string { return t.region }

// Stats returns the store's counters.
func (t *Store) Stats() Stats {
	return Stats{ParentCalls: t.parentCalls.Load(), Refills: t.refills.Load(),
		Failures: t.failures.Load(), Leased: t.leased.Load(), GivenBack: t.givenBack.Load()}
}

// Close stops the store's timers and waits for its calls to the parent in
// flight, which it cancels. Tokens of a refill cancelled on its way are
// lost to everyone, never spent twice.
func (t *Store) Close() error {
	t.mu.Lock()
	t.closed = true
	for k, tm := range t.drains {
		tm.Stop()
		delete(t.drains, k)
	}
	t.mu.Unlock()
	t.cancel()
	t.wg.Wait()
	return nil
}

// rtt is the last refill's round trip to the parent.
func (t *Store) rtt() micros { return micros(t.rttMicros.Load()) }

// spawn runs f in a goroutine that Close waits for; false once closed.
func (t *Store) spawn(f func()) bool {
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return false
	}
	t.wg.Add(1)
	t.mu.Unlock() // a simulation's spawn waits for f, which may lock t.mu
	t.cfg.spawn(func() {
		defer t.wg.Done()
		f()
	})
	return true
}

// windowHold returns, for a sliding-window request, the hold the parent
// is asked for (a tenth of the shortest period) and true.
func windowHold(r *remote.Request) (time.Duration, bool) {
	if !r.Window {
		return 0, false
	}
	shortest := r.Limit.Period
	for _, l := range r.Also {
		shortest = min(shortest, l.Period)
	}
	return shortest / 10, true
}

// Lease implements Store: it takes from the region's pool, and starts a
// refill from the parent when the pool runs low.
func (t *Store) Lease(ctx context.Context, r remote.Request) (remote.Result, error) {
	if err := r.Validate(remote.OpLease); err != nil {
		return remote.Result{}, err
	}
	key := keys.Pool(r.Prefix, r.Policy, r.Tier, r.Key)
	// The gap is jittered up to +25%: regions that found the parent empty
	// would otherwise keep the same order, and the one right after a
	// refill of the parent would keep getting the most. Never shorter, so
	// that the gap bounds the calls a region makes.
	gap := microsOf(t.cfg.gap)
	t.mu.Lock()
	gap += micros(t.rng.Int64N(int64(gap)/4 + 1))
	t.mu.Unlock()
	take := poolTake{N: r.N, Need: r.Need, LowWater: 1, Claim: gap, Version: r.Version,
		// Refill early enough that the batch lands before the pool is
		// dry: half the horizon of demand ahead, or a round trip's
		// worth if the parent is farther than that.
		Lead: max(microsOf(t.cfg.lead), t.rtt())}
	if r.Window {
		// Window tokens lapse; a lease is refilled when dry, not before.
		take.Window, take.Hold, take.Lead = true, microsOf(r.Hold), 0
	}
	rep, err := t.recs.pool(ctx, key, take)
	if err != nil {
		return remote.Result{}, err
	}
	if rep.claimed {
		t.spawn(func() { t.refill(r, key, rep) })
	}
	res := poolResult(&r, rep)
	res.Granted, res.Stale = rep.granted, rep.st.ver > r.Version
	if rep.granted > 0 || res.Stale {
		return res, nil
	}
	if rep.st.live(rep.now) {
		// A grant pool refills itself: no refusal waits for the parent.
		res.RetryAfter = grantRetry(&rep.st, max(min(r.N, rep.st.gcap), r.Need))
		return res, nil
	}
	if rep.st.down != 0 {
		return remote.Result{}, t.parentDown(key, rep)
	}
	// Retry when the refill in flight should have landed: at most a
	// round trip to the parent (as this store last measured it), and
	// never after the claim runs out. A key new to the region is refused
	// this way until its first refill lands: leasing from the parent on
	// the caller's path instead would make a limiter whose store timeout
	// is shorter than the round trip decide by its share, over the bound.
	wait := min(rep.st.claim-rep.now, t.rtt(), microsOf(t.cfg.gap))
	res.RetryAfter = max(wait.duration(), time.Millisecond)
	return res, nil
}

// parentDown is the error of a call the region cannot serve while its
// refills find the parent down.
func (t *Store) parentDown(key string, rep poolReply) error {
	return errs.Errorf("tiered", "region %q: pool %q: parent %w: %w since %v", t.region, key,
		remote.ErrUnavailable, remote.ErrUnreachable, time.UnixMicro(int64(rep.st.down)).Format(time.RFC3339Nano))
}

// want is the batch a refill asks the parent for: the region's demand
// since the last refill over the horizon (or two round trips, if longer),
// at least n and the rate over two gaps, at most cap.
func (t *Store) want(r *remote.Request, rep poolReply) int64 {
	lim := r.Limit
	for _, l := range r.Also {
		if l.Burst*int64(lim.Period) < lim.Burst*int64(l.Period) { // the tightest by Burst/Period
			lim = l
		}
	}
	// A batch lasts the horizon, or two round trips to a parent farther
	// than that, so that the next one is back before it runs out.
	rtt := t.rtt().duration()
	horizon := max(t.cfg.horizon, 2*rtt)
	if hold, ok := windowHold(r); ok {
		// A window's batch lapses: no more than can be spent in the time
		// it may be handed out once it lands.
		horizon = min(horizon, max(hold-2*r.Hold-rtt, t.cfg.gap))
	}
	capN := max(lim.Burst/2, rateOver(lim, horizon))
	capN = max(min(capN, lim.Burst), 1)
	// At least the whole rate over two gaps: a region refused while its
	// pool was dry shows little of its demand (its limiters wait out the
	// refusal), and a slow limit would otherwise refill a token at a time.
	n := max(r.N, 1, rateOver(lim, 2*t.cfg.gap))
	if elapsed := rep.now - rep.st.at; rep.st.at > 0 && elapsed > 0 {
		n = max(n, rep.st.used*int64(microsOf(horizon))/int64(elapsed))
	} else {
		n = max(n, capN/4) // no demand seen yet
	}
	return min(n, capN)
}

// rateOver is the tokens lim grants over d, rounded down.
func rateOver(lim local.Limit, d time.Duration) int64 {
	return int64(float64(lim.Rate) * float64(d) / float64(lim.Period))
}

// refill leases a batch for the pool at key from the parent and deposits
// it; rep is the take that claimed the refill.
func (t *Store) refill(r remote.Request, key string, rep poolReply) {
	// A grant pool's take that found it empty before its grant call is
	// due claims a batch of what the grants leave (see poolTake).
	renewal := rep.st.renew == 0 || rep.now >= rep.st.renew || rep.granted > 0
	if g, ok := t.granter(&r, rep); ok && renewal && t.grantRefill(g, r, key, rep) {
		return
	}
	pctx, cancel := context.WithTimeout(t.ctx, t.cfg.timeout)
	defer cancel()
	pr := r
	pr.N, pr.Min, pr.Need, pr.MaxDelay, pr.Since = t.want(&r, rep), 1, 1, 0, time.Time{}
	hold, window := windowHold(&r)
	if window {
		pr.Hold = hold
	}
	t.parentCalls.Add(1)
	start := t.cfg.clk.Now()
	silent := t.markSilent(key)
	res, err := t.parent.Lease(pctx, pr)
	marked := silent()
	// The region's own store gets a timeout of its own: a parent call
	// that timed out (a silent link) must still mark the pool, or the
	// region never learns that its parent is away.
	ctx, cancelLocal := context.WithTimeout(t.ctx, t.cfg.timeout)
	defer cancelLocal()
	if err != nil {
		t.failures.Add(1)
		if !marked {
			_, _ = t.recs.pool(ctx, key, poolFail{})
		}
		return
	}
	t.rttMicros.Store(max(t.cfg.clk.Now().Sub(start).Microseconds(), 1))
	if res.Version > rep.st.ver {
		// Processes learn of the version from the pool: the region's
		// copy of the record must have it first.
		t.copyPolicy(ctx, r.Prefix, r.Policy)
	}
	t.deposit(ctx, r, key, rep, res, hold, window)
}

// deposit puts a refill's batch res into the pool at key; rep is the take
// that claimed the refill, hold a window pool's hold.
func (t *Store) deposit(ctx context.Context, r remote.Request, key string, rep poolReply, res remote.Result, hold time.Duration, window bool) {
	put := poolPut{N: res.Granted, Exp: rep.now + microsOf(t.cfg.poolTTL), Version: res.Version,
		Rem: res.Remaining, Reset: microsOf(res.ResetAfter)}
	if window {
		// The parent counts the batch at its own now + hold; rep.now was
		// read before the call, so the pool's tokens are spent in time.
		put.Window, put.Exp, put.Since = true, rep.now+microsOf(hold-r.Hold), micros(res.Now.UnixMicro())
	}
	got, err := t.recs.pool(ctx, key, put)
	if err != nil {
		return // the batch is lost to everyone: never spent twice
	}
	if got.granted > 0 {
		// A bucket pool's tokens of an older policy version go back, as
		// a limiter gives back its leases; so does what is left of a
		// window pool's previous batch, from the sub-window of its grant.
		t.returnToParent(ctx, r, key, got.granted, got.since)
	}
	if res.Granted > 0 {
		t.refills.Add(1)
		t.leased.Add(res.Granted)
		// A bucket pool goes back once no refill extended it for the pool
		// TTL; a window pool once its tokens lapse, so that the parent's
		// window counts no token that was never spent.
		after := t.cfg.poolTTL
		if window {
			after = (got.st.exp - got.now).duration()
		}
		t.giveBackAfter(r, key, after)
	}
}

// markSilent marks the pool at key as cut off from the parent if the
// refill about to start has no answer within a quarter of the parent
// timeout: a silent link (packets dropped, the connection kept) then
// sends the region's limiters to their degraded shares about as soon as a
// refused one does, not a whole timeout later. The returned function,
// called once the refill has its answer, cancels the mark and reports
// whether it was made; a put that follows clears it.
func (t *Store) markSilent(key string) (answered func() (marked bool)) {
	var mu sync.Mutex
	done, marked := false, false
	tm := t.cfg.clk.AfterFunc(t.cfg.timeout/4, func() {
		mu.Lock()
		if done {
			mu.Unlock()
			return
		}
		marked = true
		mu.Unlock()
		t.spawn(func() {
			ctx, cancel := context.WithTimeout(t.ctx, t.cfg.timeout)
			defer cancel()
			_, _ = t.recs.pool(ctx, key, poolFail{})
		})
	})
	return func() bool {
		tm.Stop()
		mu.Lock()
		defer mu.Unlock()
		done = true
		return marked
	}
}

// giveBackAfter gives the pool at key back to the parent after d, unless a
// later refill has extended it by then.
func (t *Store) giveBackAfter(r remote.Request, key string, d time.Duration) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return
	}
	if tm := t.drains[key]; tm != nil {
		tm.Stop()
	}
	var tm clock.Timer
	tm = t.cfg.clk.AfterFunc(max(d, 0)+time.Millisecond, func() {
		t.mu.Lock()
		if t.drains[key] == tm {
			delete(t.drains, key)
		}
		t.mu.Unlock()
		t.spawn(func() { t.giveBack(r, key) })
	})
	t.drains[key] = tm
}

func (t *Store) giveBack(r remote.Request, key string) {
	ctx, cancel := context.WithTimeout(t.ctx, t.cfg.timeout)
	defer cancel()
	rep, err := t.recs.pool(ctx, key, poolDrain{Idle: microsOf(t.cfg.poolTTL)})
	if err != nil {
		return
	}
	if rep.ended {
		t.ungrant(ctx, r, key, rep.granted)
		return
	}
	if rep.granted <= 0 {
		return
	}
	t.returnToParent(ctx, r, key, rep.granted, rep.since)
}

// returnToParent gives n tokens taken out of the pool at key back to the
// parent (a window's from the grant at since, the parent's µs), or to a
// bucket pool if the parent does not take them.
func (t *Store) returnToParent(ctx context.Context, r remote.Request, key string, n int64, since micros) {
	pr := r
	pr.N, pr.Min, pr.Need, pr.MaxDelay, pr.Since = n, 0, 0, 0, time.Time{}
	if hold, window := windowHold(&r); window {
		if since <= 0 {
			return // no grant to take them back from: they lapse
		}
		pr.Hold, pr.Since = hold, time.UnixMicro(int64(since))
	}
	t.parentCalls.Add(1)
	if _, err := t.parent.Return(ctx, pr); err != nil {
		t.failures.Add(1)
		if !r.Window {
			// Back into the pool, for the region or the next give-back.
			_, _ = t.recs.pool(ctx, key, poolGive{N: n})
		}
		return
	}
	t.givenBack.Add(n)
}

// Return implements Store: tokens go back to the region's pool. A window's
// go back only into the batch they came from (Request.Since no earlier than
// its deposit), while it has not lapsed; otherwise they lapse.
func (t *Store) Return(ctx context.Context, r remote.Request) (remote.Result, error) {
	if err := r.Validate(remote.OpReturn); err != nil {
		return remote.Result{}, err
	}
	give := poolGive{N: r.N}
	if r.Window {
		if r.Since.IsZero() {
			return remote.Result{Now: t.cfg.clk.Now(), Version: r.Version}, nil // nothing comes back
		}
		// Back into the pool if they came from the batch it holds, to
		// be handed out again before it lapses (or given back with it).
		give.Since = max(micros(r.Since.UnixMicro()), 1)
	}
	key := keys.Pool(r.Prefix, r.Policy, r.Tier, r.Key)
	rep, err := t.recs.pool(ctx, key, give)
	if err != nil {
		return remote.Result{}, err
	}
	return poolResult(&r, rep), nil
}

// poolResult is what a pool's reply tells a caller of r: the pool's tokens
// and the parent's as of the last refill, and for a bucket the parent's
// time to full as of then.
func poolResult(r *remote.Request, rep poolReply) remote.Result {
	res := remote.Result{Remaining: max(rep.st.level+rep.st.rem, 0), Now: time.UnixMicro(int64(rep.now)),
		Version: max(rep.st.ver, r.Version)}
	if !r.Window {
		res.ResetAfter = max(rep.st.full-rep.now, 0).duration()
	}
	return res
}

// Debit implements Store: tokens admitted without a lease (in an outage)
// are charged to the parent's bucket, which granted none of them.
func (t *Store) Debit(ctx context.Context, r remote.Request) (remote.Result, error) {
	if err := r.Validate(remote.OpDebit); err != nil {
		return remote.Result{}, err
	}
	// While the region's refills find the parent down, a debit would only
	// fail too: it waits for the next refill that gets through.
	key := keys.Pool(r.Prefix, r.Policy, r.Tier, r.Key)
	rep, err := t.recs.pool(ctx, key, poolRead{})
	if err != nil {
		return remote.Result{}, err
	}
	if rep.st.down != 0 {
		return remote.Result{}, t.parentDown(key, rep)
	}
	t.parentCalls.Add(1)
	res, err := t.parent.Debit(ctx, r)
	if err != nil {
		t.failures.Add(1)
		return remote.Result{}, errs.Errorf("tiered", "region %q: debit at the parent: %w", t.region, err)
	}
	return res, nil
}

// Batch implements Store, one call at a time.
func (t *Store) Batch(ctx context.Context, op remote.Op, rs []remote.Request) []remote.Reply {
	out := make([]remote.Reply, len(rs))
	for i, r := range rs {
		switch op {
		case remote.OpLease:
			out[i].Result, out[i].Err = t.Lease(ctx, r)
		case remote.OpReturn:
			out[i].Result, out[i].Err = t.Return(ctx, r)
		case remote.OpDebit:
			out[i].Result, out[i].Err = t.Debit(ctx, r)
		default:
			out[i].Err = errs.Errorf("tiered", "unknown op %v", op)
		}
	}
	return out
}

// Heartbeat implements Fleet: it counts the region's limiters in the
// region's store and returns the world's count (the sum of every region's
// weight, as the last beat read it), or the region's while that is not
// known yet. One process per region and beat reports the region's weight
// to the parent.
func (t *Store) Heartbeat(ctx context.Context, prefix, policy, member string, expiry time.Duration) (int, error) {
	n, err := t.local.Heartbeat(ctx, prefix, policy, member, expiry)
	if err != nil {
		return 0, err
	}
	rep, err := t.recs.region(ctx, keys.Region(prefix, policy), regionBeat{Claim: microsOf(t.cfg.beat)})
	if err != nil {
		return 0, err
	}
	if rep.claimed {
		weight := int64(n)
		if rep.st.down != 0 {
			// The last beat failed: the region's limiters may have
			// stopped heartbeating while they were cut off (degraded),
			// so this count is still filling up. Report at least what
			// the region reported before the cut.
			weight = max(weight, rep.st.own)
		}
		t.spawn(func() { t.beatOnce(prefix, policy, weight) })
	}
	return max(n, int(rep.st.world)), nil
}

// beatOnce reports the region's weight to the parent, keeps the world's,
// and refreshes the region's copy of the policy.
func (t *Store) beatOnce(prefix, policy string, weight int64) {
	pctx, cancel := context.WithTimeout(t.ctx, t.cfg.timeout)
	defer cancel()
	t.parentCalls.Add(1)
	world, err := t.parent.Weigh(pctx, prefix, policy, t.region, weight, t.cfg.expiry)
	ctx, cancelLocal := context.WithTimeout(t.ctx, t.cfg.timeout) // as in refill
	defer cancelLocal()
	if err != nil {
		t.failures.Add(1)
		// The region keeps the last weights it knew.
		_, _ = t.recs.region(ctx, keys.Region(prefix, policy), regionFail{})
		return
	}
	if _, err := t.recs.region(ctx, keys.Region(prefix, policy), regionWeigh{World: world, Own: weight}); err != nil {
		return
	}
	t.copyPolicy(ctx, prefix, policy)
}

// Leave implements Fleet.
func (t *Store) Leave(ctx context.Context, prefix, policy, member string) error {
	return t.local.Leave(ctx, prefix, policy, member)
}

// Weigh implements Regions for a tier below this one: it reports to the
// parent.
func (t *Store) Weigh(ctx context.Context, prefix, policy, region string, weight int64, expiry time.Duration) (int64, error) {
	t.parentCalls.Add(1)
	return t.parent.Weigh(ctx, prefix, policy, region, weight, expiry)
}

// copyPolicy copies the parent's policy record to the region's store.
func (t *Store) copyPolicy(ctx context.Context, prefix, name string) {
	t.parentCalls.Add(1)
	rec, ok, err := t.parent.GetPolicy(ctx, prefix, name)
	if err != nil {
		t.failures.Add(1)
		return
	}
	if ok {
		_, _, _ = t.local.SetPolicy(ctx, prefix, name, rec)
	}
}

// SetPolicy implements Policies: the record goes to the parent, for every
// region, and to the region's copy at once.
func (t *Store) SetPolicy(ctx context.Context, prefix, name string, rec remote.PolicyRecord) (remote.PolicyRecord, bool, error) {
	t.parentCalls.Add(1)
	cur, stored, err := t.parent.SetPolicy(ctx, prefix, name, rec)
	if err != nil {
		return remote.PolicyRecord{}, false, err
	}
	if _, _, err := t.local.SetPolicy(ctx, prefix, name, cur); err != nil {
		return remote.PolicyRecord{}, false, err
	}
	return cur, stored, nil
}

// GetPolicy implements Policies from the region's copy.
func (t *Store) GetPolicy(ctx context.Context, prefix, name string) (remote.PolicyRecord, bool, error) {
	return t.local.GetPolicy(ctx, prefix, name)
}

// WatchPolicy implements Policies: a change the parent publishes is
// copied to the region's store before changed is called. The copy runs on
// the goroutine that delivered the change and is cancelled by Close; it
// is not one of the store's background calls (WithBaseContext), as it
// does not start one.
func (t *Store) WatchPolicy(ctx context.Context, prefix, name string, changed func()) (func(), error) {
	return t.parent.WatchPolicy(ctx, prefix, name, func() {
		ctx, cancel := context.WithTimeout(context.Background(), t.cfg.timeout)
		defer cancel()
		defer context.AfterFunc(t.ctx, cancel)()
		t.copyPolicy(ctx, prefix, name)
		changed()
	})
}
