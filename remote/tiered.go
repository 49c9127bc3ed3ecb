package remote

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/local"
)

// RegionStore is the store a region's processes share: a RedisStore or a
// MemoryStore (the only stores that can hold a region's pools).
type RegionStore interface {
	Store
	Policies
	Fleet
	pooler
}

// Parent is the store a Tiered store leases from: the one that keeps the
// world's buckets, policies and region weights. A RedisStore, a
// MemoryStore, or another Tiered store (tiers nest).
type Parent interface {
	Store
	Policies
	Regions
}

var (
	_ Store    = (*Tiered)(nil)
	_ Policies = (*Tiered)(nil)
	_ Fleet    = (*Tiered)(nil)
	_ Parent   = (*Tiered)(nil)
)

// Tiered is a Store for the processes of one region. It answers from the
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
// When the parent does not answer, takes go on from the pool; once it is
// dry, calls fail with ErrUnavailable (and ErrUnreachable) and the
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
// A Result from Tiered is the pool's: Remaining is what the pool holds
// plus what the parent's bucket held at the last refill, ResetAfter the
// parent's time to full as of that refill, and Created is never set.
//
// Close the store after the limiters that use it.
type Tiered struct {
	region string
	local  RegionStore
	parent Parent
	cfg    tieredConfig

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	mu     sync.Mutex
	closed bool
	drains map[string]clock.Timer // pool key -> its give-back timer
	rng    *rand.Rand             // guarded by mu

	parentCalls, refills, failures, givenBack, leased atomic.Int64
	rtt                                               atomic.Int64 // µs of the last refill's round trip
}

// TieredStats counts a Tiered store's work since it was created.
type TieredStats struct {
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

// TieredOption configures a Tiered store.
type TieredOption interface{ apply(*tieredConfig) }

type tieredConfig struct {
	gap, horizon, lead, poolTTL, beat, timeout, expiry time.Duration
	clk                                                clock.Clock
	spawn                                              func(run func())
	seed                                               uint64
	seeded                                             bool
}

type tieredOptionFunc func(*tieredConfig)

func (f tieredOptionFunc) apply(c *tieredConfig) { f(c) }

// WithRefillGap sets the least time between two refills of one pool (by
// any process of the region; each gap is drawn from [d, 1.25·d]), which
// bounds the calls a region makes to the parent per bucket. The default is
// 300 ms.
func WithRefillGap(d time.Duration) TieredOption {
	return tieredOptionFunc(func(c *tieredConfig) { c.gap = d })
}

// WithRefillHorizon sets how far ahead a refill provides: its batch is the
// region's recent demand over this time. A refill starts when the pool
// holds less than half of that. The default is 500 ms.
func WithRefillHorizon(d time.Duration) TieredOption {
	return tieredOptionFunc(func(c *tieredConfig) { c.horizon = d })
}

// WithPoolTTL sets how long a bucket pool keeps tokens after its last
// refill before giving them back to the parent. The default is 2 s.
func WithPoolTTL(d time.Duration) TieredOption {
	return tieredOptionFunc(func(c *tieredConfig) { c.poolTTL = d })
}

// WithRegionBeat sets how often the region reports its weight to the
// parent and reads the policy records from it. The default is 2 s.
func WithRegionBeat(d time.Duration) TieredOption {
	return tieredOptionFunc(func(c *tieredConfig) { c.beat = d })
}

// WithRegionExpiry sets how long the parent counts a region's weight
// after its last beat. It errs long: a region cut off from the parent
// cannot beat, and if its weight expired meanwhile the world would look
// smaller than it is when the link comes back, and every region's share
// in the next outage too big. A region that is gone for good keeps the
// others' shares small until then. The default is 5 minutes.
func WithRegionExpiry(d time.Duration) TieredOption {
	return tieredOptionFunc(func(c *tieredConfig) { c.expiry = d })
}

// WithParentTimeout bounds every background call to the parent. The
// default is 2 s.
func WithParentTimeout(d time.Duration) TieredOption {
	return tieredOptionFunc(func(c *tieredConfig) { c.timeout = d })
}

// WithTieredClock sets the clock of the store's timers (give-backs); the
// stores' own clocks still decide. The default is the system clock.
func WithTieredClock(c clock.Clock) TieredOption {
	return tieredOptionFunc(func(t *tieredConfig) { t.clk = c })
}

// WithSpawn sets how the store starts its background calls to the parent
// (refills, give-backs, beats); spawn must run run, at once or later. The
// default starts a goroutine. A simulation on a manual clock passes one
// that returns once run has blocked on its virtual clock or ended, so that
// its runs replay exactly.
func WithSpawn(spawn func(run func())) TieredOption {
	return tieredOptionFunc(func(c *tieredConfig) { c.spawn = spawn })
}

// WithTieredSeed makes the store's jitter repeatable, for simulations and
// tests. By default it is seeded at random.
func WithTieredSeed(seed uint64) TieredOption {
	return tieredOptionFunc(func(c *tieredConfig) { c.seed, c.seeded = seed, true })
}

// NewTiered returns the Store of region, which answers from local and
// leases from parent. Region names the region among the parent's (its
// weight's entry): 1 to MaxKeyLen bytes.
func NewTiered(region string, local RegionStore, parent Parent, opts ...TieredOption) (*Tiered, error) {
	cfg := tieredConfig{
		gap: 300 * time.Millisecond, horizon: 500 * time.Millisecond, poolTTL: 2 * time.Second,
		beat: 2 * time.Second, timeout: 2 * time.Second, expiry: 5 * time.Minute, clk: clock.Real(),
		spawn: func(run func()) { go run() },
	}
	for _, o := range opts {
		o.apply(&cfg)
	}
	switch {
	case region == "" || len(region) > MaxKeyLen:
		return nil, fmt.Errorf("%w: region %.40q", ErrInvalidKey, region)
	case local == nil || parent == nil:
		return nil, errors.New("remote: tiered store needs a region store and a parent")
	case cfg.gap <= 0 || cfg.horizon <= 0 || cfg.poolTTL <= 0 || cfg.beat <= 0 || cfg.timeout <= 0 || cfg.expiry < cfg.beat:
		return nil, fmt.Errorf("remote: tiered store: durations must be positive: %+v", cfg)
	case cfg.clk == nil || cfg.spawn == nil:
		return nil, errors.New("remote: tiered store: nil clock or spawn")
	}
	cfg.lead = cfg.horizon / 2
	if !cfg.seeded {
		cfg.seed = rand.Uint64()
	}
	t := &Tiered{region: region, local: local, parent: parent, cfg: cfg, drains: map[string]clock.Timer{},
		rng: rand.New(rand.NewPCG(cfg.seed, 0x7133ed))}
	t.rtt.Store(cfg.gap.Microseconds() / 3) // until a refill measures it
	t.ctx, t.cancel = context.WithCancel(context.Background())
	return t, nil
}

// Region returns the region's name.
func (t *Tiered) Region() string { return t.region }

// Stats returns the store's counters.
func (t *Tiered) Stats() TieredStats {
	return TieredStats{ParentCalls: t.parentCalls.Load(), Refills: t.refills.Load(),
		Failures: t.failures.Load(), Leased: t.leased.Load(), GivenBack: t.givenBack.Load()}
}

// Close stops the store's timers and waits for its calls to the parent in
// flight, which it cancels. Tokens of a refill cancelled on its way are
// lost to everyone, never spent twice.
func (t *Tiered) Close() error {
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

// spawn runs f in a goroutine that Close waits for; false once closed.
func (t *Tiered) spawn(f func()) bool {
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
func windowHold(r *Request) (time.Duration, bool) {
	if !r.Window {
		return 0, false
	}
	shortest := r.Limit.Period
	for _, l := range r.Also {
		shortest = min(shortest, l.Period)
	}
	return shortest / 10, true
}

func checkRequest(op Op, r *Request) error {
	if _, err := validate(op, r); err != nil {
		return err
	}
	if r.shaped() {
		if _, err := validateShape(op, r); err != nil {
			return err
		}
	}
	return nil
}

// Lease implements Store: it takes from the region's pool, and starts a
// refill from the parent when the pool runs low.
func (t *Tiered) Lease(ctx context.Context, r Request) (Result, error) {
	if err := checkRequest(OpLease, &r); err != nil {
		return Result{}, err
	}
	key := PoolKey(r.Prefix, r.Policy, r.Tier, r.Key)
	// The gap is jittered up to +25%: regions that found the parent empty
	// would otherwise keep the same order, and the one right after a
	// refill of the parent would keep getting the most. Never shorter, so
	// that the gap bounds the calls a region makes.
	gap := t.cfg.gap.Microseconds()
	t.mu.Lock()
	gap += t.rng.Int64N(gap/4 + 1)
	t.mu.Unlock()
	// Refill early enough that the batch lands before the pool is dry:
	// half the horizon of demand ahead, or a round trip's worth if the
	// parent is farther than that.
	lead := max(t.cfg.lead.Microseconds(), t.rtt.Load())
	args := [7]int64{r.N, max(r.Need, 1), -1, 1, gap, lead, int64(r.Version)}
	if _, ok := windowHold(&r); ok {
		// Window tokens lapse; a lease is refilled when dry, not before.
		args[2], args[5] = r.Hold.Microseconds(), 0
	}
	rep, err := t.local.pool(ctx, key, poolTake, args)
	if err != nil {
		return Result{}, err
	}
	if rep.claimed {
		t.spawn(func() { t.refill(r, key, rep) })
	}
	res := poolResult(&r, rep)
	res.Granted, res.Stale = rep.granted, rep.st.ver > r.Version
	if rep.granted > 0 || res.Stale {
		return res, nil
	}
	if rep.st.down != 0 {
		return Result{}, t.parentDown(key, rep)
	}
	// Retry when the refill in flight should have landed: at most a
	// round trip to the parent (as this store last measured it), and
	// never after the claim runs out. A key new to the region is refused
	// this way until its first refill lands: leasing from the parent on
	// the caller's path instead would make a limiter whose store timeout
	// is shorter than the round trip decide by its share, over the bound.
	wait := min(rep.st.claim-rep.now, t.rtt.Load(), t.cfg.gap.Microseconds())
	res.RetryAfter = time.Duration(max(wait, 1000)) * time.Microsecond
	return res, nil
}

// parentDown is the error of a call the region cannot serve while its
// refills find the parent down.
func (t *Tiered) parentDown(key string, rep poolReply) error {
	return fmt.Errorf("remote: region %q: pool %q: parent %w: %w since %v", t.region, key,
		ErrUnavailable, ErrUnreachable, time.UnixMicro(rep.st.down).Format(time.RFC3339Nano))
}

// want is the batch a refill asks the parent for: the region's demand
// since the last refill over the horizon (or two round trips, if longer),
// at least n and the rate over two gaps, at most cap.
func (t *Tiered) want(r *Request, rep poolReply) int64 {
	lim := r.Limit
	for _, l := range r.Also {
		if l.Burst*int64(lim.Period) < lim.Burst*int64(l.Period) { // the tightest by Burst/Period
			lim = l
		}
	}
	// A batch lasts the horizon, or two round trips to a parent farther
	// than that, so that the next one is back before it runs out.
	rtt := time.Duration(t.rtt.Load()) * time.Microsecond
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
		n = max(n, rep.st.used*horizon.Microseconds()/elapsed)
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
func (t *Tiered) refill(r Request, key string, rep poolReply) {
	ctx, cancel := context.WithTimeout(t.ctx, t.cfg.timeout)
	defer cancel()
	pr := r
	pr.N, pr.Min, pr.Need, pr.MaxDelay, pr.Since = t.want(&r, rep), 1, 1, 0, time.Time{}
	hold, window := windowHold(&r)
	if window {
		pr.Hold = hold
	}
	t.parentCalls.Add(1)
	start := t.cfg.clk.Now()
	res, err := t.parent.Lease(ctx, pr)
	if err != nil {
		t.failures.Add(1)
		_, _ = t.local.pool(ctx, key, poolFail, [7]int64{})
		return
	}
	t.rtt.Store(max(t.cfg.clk.Now().Sub(start).Microseconds(), 1))
	if res.Version > rep.st.ver {
		// Processes learn of the version from the pool: the region's
		// copy of the record must have it first.
		t.copyPolicy(ctx, r.Prefix, r.Policy)
	}
	exp := rep.now + t.cfg.poolTTL.Microseconds()
	reset, since := res.ResetAfter.Microseconds(), int64(0)
	if window {
		// The parent counts the batch at its own now + hold; rep.now was
		// read before the call, so the pool's tokens are spent in time.
		exp, reset, since = rep.now+(hold-r.Hold).Microseconds(), -1, res.Now.UnixMicro()
	}
	put, err := t.local.pool(ctx, key, poolPut, [7]int64{res.Granted, exp, int64(res.Version), res.Remaining, reset, since})
	if err != nil {
		return // the batch is lost to everyone: never spent twice
	}
	if put.granted > 0 {
		// A bucket pool's tokens of an older policy version go back, as
		// a limiter gives back its leases; so does what is left of a
		// window pool's previous batch, from the sub-window of its grant.
		t.returnToParent(ctx, r, key, put.granted, put.since)
	}
	if res.Granted > 0 {
		t.refills.Add(1)
		t.leased.Add(res.Granted)
		// A bucket pool goes back once no refill extended it for the pool
		// TTL; a window pool once its tokens lapse, so that the parent's
		// window counts no token that was never spent.
		after := t.cfg.poolTTL
		if window {
			after = time.Duration(put.st.exp-put.now) * time.Microsecond
		}
		t.giveBackAfter(r, key, after)
	}
}

// giveBackAfter gives the pool at key back to the parent after d, unless a
// later refill has extended it by then.
func (t *Tiered) giveBackAfter(r Request, key string, d time.Duration) {
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

func (t *Tiered) giveBack(r Request, key string) {
	ctx, cancel := context.WithTimeout(t.ctx, t.cfg.timeout)
	defer cancel()
	rep, err := t.local.pool(ctx, key, poolDrain, [7]int64{})
	if err != nil || rep.granted <= 0 {
		return
	}
	t.returnToParent(ctx, r, key, rep.granted, rep.since)
}

// returnToParent gives n tokens taken out of the pool at key back to the
// parent (a window's from the grant at since, the parent's µs), or to a
// bucket pool if the parent does not take them.
func (t *Tiered) returnToParent(ctx context.Context, r Request, key string, n, since int64) {
	pr := r
	pr.N, pr.Min, pr.Need, pr.MaxDelay, pr.Since = n, 0, 0, 0, time.Time{}
	if hold, window := windowHold(&r); window {
		if since <= 0 {
			return // no grant to take them back from: they lapse
		}
		pr.Hold, pr.Since = hold, time.UnixMicro(since)
	}
	t.parentCalls.Add(1)
	if _, err := t.parent.Return(ctx, pr); err != nil {
		t.failures.Add(1)
		if !r.Window {
			// Back into the pool, for the region or the next give-back.
			_, _ = t.local.pool(ctx, key, poolGive, [7]int64{n})
		}
		return
	}
	t.givenBack.Add(n)
}

// Return implements Store: tokens go back to the region's pool. A window's
// go back only into the batch they came from (Request.Since no earlier than
// its deposit), while it has not lapsed; otherwise they lapse.
func (t *Tiered) Return(ctx context.Context, r Request) (Result, error) {
	if err := checkRequest(OpReturn, &r); err != nil {
		return Result{}, err
	}
	args := [7]int64{r.N}
	if r.Window {
		if r.Since.IsZero() {
			return Result{Now: t.cfg.clk.Now(), Version: r.Version}, nil // nothing comes back
		}
		// Back into the pool if they came from the batch it holds, to
		// be handed out again before it lapses (or given back with it).
		args[1] = max(r.Since.UnixMicro(), 1)
	}
	key := PoolKey(r.Prefix, r.Policy, r.Tier, r.Key)
	rep, err := t.local.pool(ctx, key, poolGive, args)
	if err != nil {
		return Result{}, err
	}
	return poolResult(&r, rep), nil
}

// poolResult is what a pool's reply tells a caller of r: the pool's tokens
// and the parent's as of the last refill, and for a bucket the parent's
// time to full as of then.
func poolResult(r *Request, rep poolReply) Result {
	res := Result{Remaining: max(rep.st.level+rep.st.rem, 0), Now: time.UnixMicro(rep.now), Version: max(rep.st.ver, r.Version)}
	if !r.Window { // a window pool keeps its grant's time where a bucket pool keeps this
		res.ResetAfter = time.Duration(max(rep.st.full-rep.now, 0)) * time.Microsecond
	}
	return res
}

// Debit implements Store: tokens admitted without a lease (in an outage)
// are charged to the parent's bucket, which granted none of them.
func (t *Tiered) Debit(ctx context.Context, r Request) (Result, error) {
	if err := checkRequest(OpDebit, &r); err != nil {
		return Result{}, err
	}
	// While the region's refills find the parent down, a debit would only
	// fail too: it waits for the next refill that gets through.
	key := PoolKey(r.Prefix, r.Policy, r.Tier, r.Key)
	rep, err := t.local.pool(ctx, key, poolGive, [7]int64{})
	if err != nil {
		return Result{}, err
	}
	if rep.st.down != 0 {
		return Result{}, t.parentDown(key, rep)
	}
	t.parentCalls.Add(1)
	res, err := t.parent.Debit(ctx, r)
	if err != nil {
		t.failures.Add(1)
		return Result{}, fmt.Errorf("remote: region %q: debit at the parent: %w", t.region, err)
	}
	return res, nil
}

// Batch implements Store, one call at a time.
func (t *Tiered) Batch(ctx context.Context, op Op, rs []Request) []Reply {
	out := make([]Reply, len(rs))
	for i, r := range rs {
		switch op {
		case OpLease:
			out[i].Result, out[i].Err = t.Lease(ctx, r)
		case OpReturn:
			out[i].Result, out[i].Err = t.Return(ctx, r)
		case OpDebit:
			out[i].Result, out[i].Err = t.Debit(ctx, r)
		default:
			out[i].Err = fmt.Errorf("remote: unknown op %v", op)
		}
	}
	return out
}

// Heartbeat implements Fleet: it counts the region's limiters in the
// region's store and returns the world's count (the sum of every region's
// weight, as the last beat read it), or the region's while that is not
// known yet. One process per region and beat reports the region's weight
// to the parent.
func (t *Tiered) Heartbeat(ctx context.Context, prefix, policy, member string, expiry time.Duration) (int, error) {
	n, err := t.local.Heartbeat(ctx, prefix, policy, member, expiry)
	if err != nil {
		return 0, err
	}
	rep, err := t.local.pool(ctx, RegionKey(prefix, policy), poolBeat, [7]int64{t.cfg.beat.Microseconds()})
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
			weight = max(weight, rep.st.rem)
		}
		t.spawn(func() { t.beatOnce(prefix, policy, weight) })
	}
	return max(n, int(rep.st.level)), nil
}

// beatOnce reports the region's weight to the parent, keeps the world's,
// and refreshes the region's copy of the policy.
func (t *Tiered) beatOnce(prefix, policy string, weight int64) {
	ctx, cancel := context.WithTimeout(t.ctx, t.cfg.timeout)
	defer cancel()
	t.parentCalls.Add(1)
	world, err := t.parent.Weigh(ctx, prefix, policy, t.region, weight, t.cfg.expiry)
	if err != nil {
		t.failures.Add(1)
		// The region keeps the last weights it knew.
		_, _ = t.local.pool(ctx, RegionKey(prefix, policy), poolFail, [7]int64{})
		return
	}
	if _, err := t.local.pool(ctx, RegionKey(prefix, policy), poolWeigh, [7]int64{world, weight}); err != nil {
		return
	}
	t.copyPolicy(ctx, prefix, policy)
}

// Leave implements Fleet.
func (t *Tiered) Leave(ctx context.Context, prefix, policy, member string) error {
	return t.local.Leave(ctx, prefix, policy, member)
}

// Weigh implements Regions for a tier below this one: it reports to the
// parent.
func (t *Tiered) Weigh(ctx context.Context, prefix, policy, region string, weight int64, expiry time.Duration) (int64, error) {
	t.parentCalls.Add(1)
	return t.parent.Weigh(ctx, prefix, policy, region, weight, expiry)
}

// copyPolicy copies the parent's policy record to the region's store.
func (t *Tiered) copyPolicy(ctx context.Context, prefix, name string) {
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
func (t *Tiered) SetPolicy(ctx context.Context, prefix, name string, rec PolicyRecord) (PolicyRecord, bool, error) {
	t.parentCalls.Add(1)
	cur, stored, err := t.parent.SetPolicy(ctx, prefix, name, rec)
	if err != nil {
		return PolicyRecord{}, false, err
	}
	if _, _, err := t.local.SetPolicy(ctx, prefix, name, cur); err != nil {
		return PolicyRecord{}, false, err
	}
	return cur, stored, nil
}

// GetPolicy implements Policies from the region's copy.
func (t *Tiered) GetPolicy(ctx context.Context, prefix, name string) (PolicyRecord, bool, error) {
	return t.local.GetPolicy(ctx, prefix, name)
}

// WatchPolicy implements Policies: a change the parent publishes is copied
// to the region's store before changed is called.
func (t *Tiered) WatchPolicy(ctx context.Context, prefix, name string, changed func()) (func(), error) {
	return t.parent.WatchPolicy(ctx, prefix, name, func() {
		ctx, cancel := context.WithTimeout(t.ctx, t.cfg.timeout)
		defer cancel()
		t.copyPolicy(ctx, prefix, name)
		changed()
	})
}
