package hybrid

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"github.com/leasehold/leasehold/internal/background"
	"github.com/leasehold/leasehold/internal/errs"
	"log/slog"
	mrand "math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leasehold/leasehold/breaker"
	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/reconcile"
	"github.com/leasehold/leasehold/remote"
)

// Limiter enforces one Policy per key across every process that shares its
// store. Decisions on a key with leased tokens are a lock-free map lookup
// and a CAS; the store is called to refill leases (in the background for
// busy keys, synchronously and bounded by the store timeout for cold ones).
//
// A Limiter is safe for concurrent use. The zero value is not usable; call
// New, and Close when done to give leased tokens back and stop its
// background work. Most callers only need Allow.
//
// Limiter is a thin front over one type per concern, each with its own
// fields and file: keyTable (keys.go), leaser (leaser.go) with its pacer
// (pacing.go), outage (outage.go), settlement (settlement.go),
// modeTracker (mode.go), policyTracker (policies.go) and background
// (internal/background). The front decides (decide.go) and orchestrates what
// spans concerns: sweeps, policy changes, Close.
type Limiter struct {
	cfg    config
	store  *breaker.Store
	policy *policyTracker
	keys   keyTable
	leaser leaser
	outage *outage
	settle settlement
	modes  *modeTracker
	bg     *background.Group
	stats  counters
	grants capacity
	// coarse is, on the real clock, a process time no earlier than now
	// (see coarseTick): leased decisions check a lease's term against
	// it, as a clock read costs more than the rest of the decision.
	coarse atomic.Int64
}

// New returns a Limiter enforcing p on store. A store that is not already
// a *breaker.Store is wrapped in one with default settings; pass a shared
// breaker.Store to give every limiter of a Redis deployment one breaker.
// Version 0 is taken as 1. Invalid policies are errors wrapping
// ErrInvalidPolicy or ErrInvalidLimit; invalid options wrap
// ErrInvalidOption.
func New(store remote.Store, p Policy, opts ...Option) (*Limiter, error) {
	if store == nil {
		return nil, errs.Errorf("hybrid", "nil store: %w", ErrInvalidOption)
	}
	p = p.normalized()
	if err := validatePolicy(p); err != nil {
		return nil, err
	}
	cfg, err := buildConfig(opts)
	if err != nil {
		return nil, err
	}
	bs, ok := store.(*breaker.Store)
	if !ok {
		bs = breaker.NewStore(store, breaker.Settings{Clock: cfg.clk})
	}
	cfg.stock = !regional(store)
	cfg.realtime = clock.Realtime(cfg.clk)
	l := &Limiter{cfg: cfg, store: bs, bg: background.New(cfg.clk), keys: keyTable{max: int64(cfg.maxKeys)}, stats: newCounters()}
	l.cfg.epoch = cfg.clk.Now()
	rng := newRand(cfg)
	l.policy = newPolicyTracker(&l.cfg, bs, p, l)
	l.outage = newOutage(&l.cfg, &l.stats, bs, fmt.Sprintf("%016x", rng.uint64()))
	l.modes = newModeTracker(&l.cfg, &l.stats, l.policy, bs)
	l.settle = settlement{cfg: &l.cfg, store: bs, bg: l.bg, keys: &l.keys, outage: l.outage, policy: l.policy, modes: l.modes, stats: &l.stats,
		settler: reconcile.Settler{Store: bs, Clock: cfg.clk, After: l.bg.After, Jitter: rng.duration}}
	l.leaser = leaser{cfg: &l.cfg, store: bs, policy: l.policy, bg: l.bg, stats: &l.stats, settle: &l.settle, outage: l.outage,
		workers: workers{bg: l.bg, work: make(chan *flight)},
		// A call may run 10 ms past the refill timeout: calls starting
		// within 10 ms share one context, not a timer each.
		calls: background.NewDeadlines(l.bg.Ctx, cfg.refillTimeout, 10*time.Millisecond),
		// Inline calls end at the store timeout in real time, which a
		// clock of the caller's (virtual time) does not count: the same
		// run would decide by the store or by the degraded share as the
		// machine is fast or loaded.
		inline: newInline(honorsDeadlines(bs.Unwrap()) && cfg.realtime, l.bg.Ctx, &l.cfg)}
	l.leaser.pace = pacer{cfg: &l.cfg, bg: l.bg, stats: &l.stats, into: &l.leaser}
	l.grants = capacity{cfg: &l.cfg, store: bs, policy: l.policy, bg: l.bg, stats: &l.stats, holder: l.outage.id, fleet: l.outage}
	l.leaser.grants = &l.grants
	l.start()
	return l, nil
}

// start checks the store's configuration and launches the background
// loops.
func (l *Limiter) start() {
	if rs, ok := l.store.Unwrap().(interface{ Check(context.Context) error }); ok {
		// A round trip: in the background, so New never waits on the store.
		l.bg.After(0, func() {
			ctx, cancel := context.WithTimeout(l.bg.Ctx, l.cfg.refillTimeout)
			defer cancel()
			if err := rs.Check(ctx); err != nil {
				l.cfg.logger.Warn("leasehold: store misconfigured", slog.String("error", err.Error()))
			}
		})
	}
	l.bg.Tick(l.cfg.sweepInterval, l.cfg.sweepInterval, l.sweep)
	if l.cfg.stock && l.cfg.realtime && l.bg.Enter() {
		// One goroutine for the limiter's life: a callback per tick
		// would start a goroutine each.
		ahead := func() { l.coarse.Store(int64(l.cfg.now().add(coarseTick))) }
		ahead()
		go func() {
			defer l.bg.Exit()
			t := time.NewTicker(coarseTick)
			defer t.Stop()
			for {
				select {
				case <-t.C:
					ahead()
				case <-l.bg.Done:
					return
				}
			}
		}()
	}
	if l.outage.fleet != nil {
		l.bg.Tick(0, l.cfg.hbInterval, l.heartbeat)
	}
	if l.policy.records != nil {
		l.policy.watch(l.bg.Ctx, func() { l.bg.After(0, l.pollPolicy) })
		l.bg.Tick(0, l.cfg.policyPoll, l.pollPolicy)
	}
}

// seededRand is the limiter's randomness: its fleet member name and the
// settlement jitter. WithSeed makes it repeatable.
type seededRand struct {
	mu sync.Mutex
	r  *mrand.Rand
}

func newRand(cfg config) *seededRand {
	seed := cfg.seed
	if !cfg.seeded {
		var b [8]byte
		_, _ = rand.Read(b[:])
		seed = binary.LittleEndian.Uint64(b[:])
	}
	return &seededRand{r: mrand.New(mrand.NewPCG(seed, 0x6c65617365686f6c))}
}

func (s *seededRand) uint64() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.r.Uint64()
}

func (s *seededRand) duration(max time.Duration) time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	return time.Duration(s.r.Int64N(int64(max) + 1))
}

// Policy returns the policy in force.
func (l *Limiter) Policy() Policy { return l.policy.load().Policy }

// SetPolicy changes the limit of the whole fleet: it stores p in the
// store's policy record if p.Version is above the stored one (atomically),
// switches this limiter at once, and every other limiter of the policy
// follows (pushed by pub/sub, polled, or told by the bucket itself when it
// refuses their older version). A version not above the one in force
// returns a *StalePolicyError (errors.Is ErrStalePolicy) naming it; calling
// again with exactly the policy in force is a no-op. p.Name must be the
// limiter's policy name; Version 0 is ErrInvalidPolicy.
func (l *Limiter) SetPolicy(ctx context.Context, p Policy) error {
	cur := l.policy.load()
	if p.Version == 0 {
		return errs.Errorf("hybrid", "SetPolicy %q: %w: version 0", p.Name, ErrInvalidPolicy)
	}
	if p.Name != cur.Name {
		return errs.Errorf("hybrid", "SetPolicy %q on a limiter of %q: %w", p.Name, cur.Name, ErrInvalidPolicy)
	}
	p = p.normalized()
	if err := validatePolicy(p); err != nil {
		return err
	}
	if l.keys.closed.Load() {
		return ErrClosed
	}
	return l.policy.set(ctx, p)
}

// adopted follows a policy change: leases are cut to the new maximum
// lease (the excess goes back to the store now, not at the next sweep),
// cached "empty until" answers are dropped (the bucket is rescaled),
// grants under the old limit are spent no more and asked for again, and
// degraded-mode shares follow the new limit on their next use.
func (l *Limiter) adopted(prev, next *policyState) {
	l.stats.policyChanges.Add(1)
	retier := !prev.sameTiers(next)
	l.keys.each(func(e *account) {
		if retier {
			// Tier indices moved: every key finds its tier again.
			if l.keys.evict(e) {
				l.release(prev, e)
			}
			return
		}
		e.answer.forget()
		l.grants.adopted(e, next)
		l.settle.later(l.leaser.cut(next, e, next.tier(e).maxLease)...)
	})
	l.bg.After(0, l.settle.flush)
}

// pollPolicy reads the policy record (every policy poll interval, and on
// every push) and adopts it if newer.
func (l *Limiter) pollPolicy() { l.policy.poll(l.bg.Ctx) }

// Mode reports the limiter's relation to the store: ModeDegraded while the
// breaker is open; ModeRecovering while outage accounts are settled, and
// while decisions stay on the degraded share because processes counted
// before the outage have not come back (see WithRecoveryHold); ModeHealthy
// otherwise.
func (l *Limiter) Mode() Mode {
	m := l.modes.mode()
	if m == ModeHealthy && l.outage.held(l.cfg.now()) {
		return ModeRecovering
	}
	return m
}

// FleetSize returns N, the number of processes this limiter assumes share
// its policy: WithFleetSize if set, else the last heartbeat count, else 1.
func (l *Limiter) FleetSize() int { return l.outage.size() }

// ClockOffset returns the estimated store clock minus this process's clock
// (0 before the first store reply). Decisions never depend on it: every
// duration the store returns is applied from the moment its reply arrived,
// which is conservative whatever the offset.
func (l *Limiter) ClockOffset() time.Duration {
	d, _ := l.leaser.offset.Get()
	return d
}

// heartbeat announces this limiter in the fleet set while the store is
// reachable (every heartbeat interval).
func (l *Limiter) heartbeat() {
	if l.modes.mode() == ModeDegraded {
		return // the breaker is open: do not add to the store's load
	}
	// A heartbeat slower than heartbeatSlow probes the buckets meanwhile.
	probe := l.bg.After(heartbeatSlow, l.probeFlow)
	ok := l.outage.heartbeat(l.bg.Ctx, l.policy.load().Name)
	if probe != nil {
		probe.Stop()
	}
	if ok {
		l.leaser.lastOK.Store(l.cfg.now())
		return
	}
	l.probeFlow()
}

// heartbeatSlow is how long a heartbeat may take before the buckets are
// probed (see probeFlow): a heartbeat takes a few milliseconds.
const heartbeatSlow = 100 * time.Millisecond

// probeFlow renews one grant now, while a heartbeat fails or hangs:
// heartbeats do not count toward the breaker (their key may live on
// another node), and keys that all hold flow make no other call until
// their renewals, so a store that died kept the breaker closed (3 of 3
// runs: every Mode degraded 3.5–4.5 s after Redis was killed, or never
// within a 1 s outage). A renewal is a bucket call that the breaker
// watches (see capacity.probe); on a live store it is an early renewal,
// no more.
func (l *Limiter) probeFlow() {
	now := l.cfg.now()
	l.keys.any(func(e *account) bool {
		if !e.flowing(now) {
			return false
		}
		l.grants.probe(e)
		return true
	})
}

// holdBeat heartbeats every tenth of the heartbeat interval while the
// recovery hold is on: the hold ends as soon as every peer counted before
// the outage has announced itself again, not a heartbeat interval later.
func (l *Limiter) holdBeat() {
	l.heartbeat()
	if l.outage.held(l.cfg.now()) {
		l.bg.After(max(l.cfg.hbInterval/10, time.Millisecond), l.holdBeat)
	}
}

// Close stops the limiter: background work ends, pending reservations are
// cancelled, and every unspent leased token is given back to the store
// (bounded by ctx). With the store down it returns an error wrapping
// remote.ErrUnavailable: what it could not give back stays counted at the
// store until its term ends. Close is idempotent; later calls return nil.
// After Close, AllowN returns ErrClosed and Allow returns false.
func (l *Limiter) Close(ctx context.Context) error {
	if !l.keys.closed.CompareAndSwap(false, true) {
		return nil
	}
	l.bg.Close()
	l.policy.stopWatch()
	l.settle.queue.Requeue(l.modes.cancelSettlement())
	p := l.policy.load()
	l.keys.each(func(e *account) { l.release(p, e); l.grants.stopTimers(e) })
	l.leaser.pace.stop() // its reservations are cancelled
	l.bg.Wait()
	// Grants go back at once, with Close's deadline; a renewal that ended
	// after the first pass may have installed one.
	l.keys.each(func(e *account) { l.grants.release(ctx, e, p) })
	// Refills that finished after the first pass may have deposited.
	l.releaseAll(l.keys.clear())
	err := l.settle.sendNow(ctx)
	if l.modes.fromBreaker() == ModeHealthy {
		l.outage.leave(ctx, l.policy.load().Name)
	}
	return err
}

// release settles what e holds under p: its lease, its reservations and
// its outage debt (eviction, policy change, Close).
func (l *Limiter) release(p *policyState, e *account) {
	if e.grantMode() {
		l.bg.After(0, func() { l.grants.release(l.bg.Ctx, e, p) })
	}
	items := l.leaser.release(p, e)
	if d := e.takeDebt(); d > 0 {
		items = append(items, debitItem(l.cfg.prefix, p, e, d))
	}
	l.settle.later(items...)
}

// releaseAll releases evicted entries under the policy in force.
func (l *Limiter) releaseAll(evicted []*account) {
	if len(evicted) == 0 {
		return
	}
	p := l.policy.load()
	for _, e := range evicted {
		l.release(p, e)
	}
}

// sweep gives back expired leases, forgets idle keys, notices breaker
// changes and flushes the queue; it runs every sweep interval on the
// limiter's clock.
func (l *Limiter) sweep() {
	l.checkMode()
	now := l.cfg.now()
	// Decisions the store was too slow for, made while the breaker stayed
	// closed, are charged as a recovery would charge them, once the store
	// answers again (charged earlier, in an outage not yet detected, their
	// unpaid part would be counted twice).
	settleDebt := l.modes.mode() == ModeHealthy && now.sub(l.leaser.lastOK.Load()) < l.cfg.sweepInterval
	p := l.policy.load()
	var evicted []*account
	l.keys.each(func(e *account) { // one pass: 100 000 keys took 15–18 ms, two 21
		l.settle.later(l.leaser.drainExpired(p, e, now)...)
		if settleDebt && e.debt() != 0 {
			l.settle.later(l.outage.charges(e, p, now)...)
		}
		if l.keys.idle(e, now) {
			evicted = append(evicted, e)
		}
	})
	l.releaseAll(evicted)
	l.settle.flush()
	l.leaser.workers.trim()
}
