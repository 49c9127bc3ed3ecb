package hybrid

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	mrand "math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leasehold/leasehold/breaker"
	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/reconcile"
	"github.com/leasehold/leasehold/remote"
	"github.com/sony/gobreaker/v2"
	"golang.org/x/sync/singleflight"
)

// Limiter enforces one Policy per key across every process that shares its
// store. Decisions on a key with leased tokens are a lock-free map lookup
// and a CAS; the store is called to refill leases (in the background for
// busy keys, synchronously and bounded by the store timeout for cold ones).
//
// A Limiter is safe for concurrent use. The zero value is not usable; call
// New, and Close when done to give leased tokens back and stop its
// goroutines. Most callers only need Allow.
type Limiter struct {
	store *breaker.Store
	cfg   config
	pol   atomic.Pointer[policyState]
	epoch time.Time // process clock origin of every mono ns value

	entries sync.Map // string -> *entry
	nkeys   atomic.Int64
	flights singleflight.Group
	evictMu sync.Mutex // serializes makeRoom

	stats   counters
	mode    atomic.Int32 // Mode last reported; see Mode()
	closing atomic.Bool

	life struct {
		sync.Mutex
		closed bool
		wg     sync.WaitGroup // every background goroutine and pending timer
	}
	stop     chan struct{}
	tickers  []*ticker // set in New, stopped by Close
	unwatch  func()    // stops policy pushes
	seenGen  atomic.Uint64
	modeMu   sync.Mutex              // serializes mode transitions
	settling func() []reconcile.Item // cancels a running settlement; guarded by modeMu

	returns struct {
		sync.Mutex
		items []reconcile.Item // debits and returns for the next sweep
	}

	ctx       context.Context // ends when Close begins; for background work
	cancel    context.CancelFunc
	offset    clock.Offset
	recov     atomic.Bool
	fleet     atomic.Int64  // live fleet size from heartbeats; 0 = unknown
	newest    atomic.Uint64 // newest policy version a store reply named
	lastOK    atomic.Int64  // mono ns of the last successful store reply
	polSynced atomic.Bool   // the store's policy record has been read
	settler   reconcile.Settler
	id        string // this limiter's member name in the fleet set
}

// policyState is a Policy with everything derived from it, swapped
// atomically as a whole.
type policyState struct {
	Policy
	maxLease int64
}

func newPolicyState(p Policy, frac float64) *policyState {
	if p.Version == 0 {
		p.Version = 1
	}
	return &policyState{Policy: p, maxLease: max(1, int64(frac*float64(p.Limit.Burst)))}
}

// New returns a Limiter enforcing p on store. A store that is not already
// a *breaker.Store is wrapped in one with default settings; pass a shared
// breaker.Store to give every limiter of a Redis deployment one breaker.
// Version 0 is taken as 1. Invalid policies or options are errors wrapping
// the sentinels of this package.
func New(store remote.Store, p Policy, opts ...Option) (*Limiter, error) {
	if store == nil {
		return nil, errors.New("hybrid: nil store")
	}
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
	l := &Limiter{
		store: bs,
		cfg:   cfg,
		epoch: cfg.clk.Now(),
		stop:  make(chan struct{}),
	}
	l.ctx, l.cancel = context.WithCancel(context.Background())
	seed := cfg.seed
	if !cfg.seeded {
		var b [8]byte
		_, _ = rand.Read(b[:])
		seed = binary.LittleEndian.Uint64(b[:])
	}
	rng := mrand.New(mrand.NewPCG(seed, 0x6c65617365686f6c))
	var rngMu sync.Mutex
	l.settler = reconcile.Settler{Store: bs, Clock: cfg.clk, After: l.after,
		Jitter: func(max time.Duration) time.Duration {
			rngMu.Lock()
			defer rngMu.Unlock()
			return time.Duration(rng.Int64N(int64(max) + 1))
		}}
	l.id = fmt.Sprintf("%016x", rng.Uint64())
	l.pol.Store(newPolicyState(p, cfg.maxFraction))
	l.seenGen.Store(bs.Generation())
	l.mode.Store(int32(l.modeFromBreaker()))
	if rs, ok := bs.Unwrap().(interface{ Check() error }); ok {
		if err := rs.Check(); err != nil {
			cfg.logger.Warn("leasehold: store misconfigured", slog.String("error", err.Error()))
		}
	}
	l.tick(cfg.sweepInterval, cfg.sweepInterval, l.sweep)
	if cfg.fleetSize == 0 && bs.CanCountFleet() {
		l.tick(0, cfg.hbInterval, l.heartbeat)
	}
	if bs.KeepsPolicies() {
		l.watchPolicy()
		l.tick(0, cfg.policyPoll, l.pollPolicy)
	} else {
		l.polSynced.Store(true)
	}
	return l, nil
}

// now is the process clock in nanoseconds since the limiter was created:
// monotonic with the real clock, and read once per decision.
func (l *Limiter) now() int64 { return int64(l.cfg.clk.Now().Sub(l.epoch)) }

// Policy returns the policy in force.
func (l *Limiter) Policy() Policy { return l.pol.Load().Policy }

// Allow reports whether one request on key may proceed now. It is
// shorthand for AllowN(ctx, key, 1).Allowed, without building a Decision:
// on a key with leased tokens it reads no clock and allocates nothing.
// Invalid keys are rejected (AllowN says why).
func (l *Limiter) Allow(ctx context.Context, key string) bool {
	if v, ok := l.entries.Load(key); ok {
		e := v.(*entry)
		if ok, left := e.lease.Take(1); ok {
			e.admits.Add(1)
			if left < e.lowWater.Load() {
				l.refillAsync(e)
			}
			return true
		}
	}
	d, _ := l.allowSlow(ctx, key, 1)
	return d.Allowed
}

// AllowN reports whether n requests (or n units of cost) on key may
// proceed now, and why. A rejection is a Decision with Allowed false, not an
// error: errors are reserved for misuse (ErrInvalidKey, ErrInvalidN,
// ErrExceedsBurst), ErrClosed, and ctx ending during a store call.
func (l *Limiter) AllowN(ctx context.Context, key string, n int64) (Decision, error) {
	if v, ok := l.entries.Load(key); ok && n > 0 {
		e := v.(*entry)
		if ok, left := e.lease.Take(n); ok {
			e.admits.Add(1)
			if left < e.lowWater.Load() {
				l.refillAsync(e)
			}
			p := l.pol.Load()
			return Decision{Allowed: true, Limit: p.Limit, Remaining: left, ResetAfter: e.resetAfter(l.now()), Source: SourceLease}, nil
		}
	}
	return l.allowSlow(ctx, key, n)
}

// Wait blocks until one request on key is admitted or ctx ends. It is
// shorthand for WaitN(ctx, key, 1).
func (l *Limiter) Wait(ctx context.Context, key string) error { return l.WaitN(ctx, key, 1) }

// WaitN blocks until n requests on key are admitted or ctx ends, sleeping
// (on the limiter's clock) exactly as long as each rejection's RetryAfter
// says. It returns ctx.Err() unchanged if ctx ends first.
func (l *Limiter) WaitN(ctx context.Context, key string, n int64) error {
	for {
		d, err := l.AllowN(ctx, key, n)
		if err != nil {
			return err
		}
		if d.Allowed {
			return nil
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		t := l.cfg.clk.NewTimer(max(d.RetryAfter, time.Microsecond))
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-l.stop:
			t.Stop()
			return ErrClosed
		case <-t.C():
		}
	}
}

// allowSlow decides when the lease cannot: it validates, finds or creates
// the key's entry, and consults cached emptiness, a pending reservation,
// the store (one flight per key) or the outage mode, in that order.
func (l *Limiter) allowSlow(ctx context.Context, key string, n int64) (Decision, error) {
	p := l.pol.Load()
	if err := l.checkRequest(p, key, n); err != nil {
		return Decision{Limit: p.Limit}, err
	}
	e := l.entryFor(key)
	if e == nil {
		return Decision{Limit: p.Limit}, ErrClosed
	}
	for attempt := 0; ; attempt++ {
		p = l.pol.Load() // a store reply may have brought a newer policy
		if ok, left := e.lease.Take(n); ok {
			e.admits.Add(1)
			if left < e.lowWater.Load() {
				l.refillAsync(e)
			}
			src := SourceLease
			if attempt > 0 {
				src = SourceRemote
				l.stats.admitted[SourceRemote].Add(1)
			}
			return Decision{Allowed: true, Limit: p.Limit, Remaining: left, ResetAfter: e.resetAfter(l.now()), Source: src}, nil
		}
		now := l.now()
		l.checkBreaker()
		switch l.store.State() {
		case gobreaker.StateOpen:
			return l.outage(e, p, n, now), nil
		case gobreaker.StateHalfOpen:
			// Probe in the background; nobody waits on a store that was
			// down a moment ago.
			l.refillAsync(e)
			return l.outage(e, p, n, now), nil
		}
		if until := max(e.emptyUntil.Load(), e.pendingUntil.Load()); now < until {
			// Demand all the same: it sizes the next lease, and it keeps
			// the key (and this cached answer) from being evicted as idle.
			e.misses.Add(n)
			return l.reject(e, p, SourceLease, time.Duration(until-now), now), nil
		}
		if attempt >= 3 {
			// Tokens arrived but concurrent callers took them first.
			return l.reject(e, p, SourceRemote, p.Limit.DurationFor(n), now), nil
		}
		e.misses.Add(n)
		e.waiting.Add(n)
		out, err := l.fetch(ctx, e, n)
		e.waiting.Add(-n)
		if err != nil {
			if errors.Is(err, ErrClosed) {
				return Decision{Limit: p.Limit}, ErrClosed
			}
			if ctx.Err() != nil {
				return Decision{Limit: p.Limit}, ctx.Err()
			}
			if errors.Is(err, errSlowFlight) && l.store.State() == gobreaker.StateClosed {
				// The store is slow but not known to be down: healthy mode
				// never admits what the store did not grant, so refuse
				// this one. If the store has answered nothing for a whole
				// refill timeout, it is more likely dead than slow: tell
				// the breaker, which opens after a few such reports
				// instead of waiting for in-flight calls to time out.
				now := l.now()
				if now-l.lastOK.Load() > int64(l.cfg.refillTimeout) {
					l.store.ReportTimeout()
				}
				return l.reject(e, p, SourceRemote, l.cfg.storeTimeout, now), nil
			}
			if remote.IsUnavailable(err) {
				return l.outage(e, p, n, l.now()), nil
			}
			// Corrupt bucket state: the store answered, but nothing it
			// says can be trusted for this key. Refuse, and say why.
			l.stats.rejected[SourceRemote].Add(1)
			return Decision{Limit: p.Limit, RetryAfter: l.cfg.leaseTTL, Source: SourceRemote}, err
		}
		if !out.deposited {
			now := l.now()
			wait := max(out.retry, time.Microsecond)
			return l.reject(e, p, SourceRemote, wait, now), nil
		}
	}
}

func (l *Limiter) reject(e *entry, p *policyState, src Source, wait time.Duration, now int64) Decision {
	l.stats.rejected[src].Add(1)
	return Decision{Limit: p.Limit, RetryAfter: wait, ResetAfter: e.resetAfter(now), Source: src}
}

func (l *Limiter) checkRequest(p *policyState, key string, n int64) error {
	if err := remote.ValidateKey(l.cfg.prefix, p.Name, key); err != nil {
		return fmt.Errorf("hybrid: %w", err)
	}
	if n <= 0 {
		return fmt.Errorf("hybrid: allow %d on %.64q: %w", n, key, ErrInvalidN)
	}
	if n > p.Limit.Burst {
		return fmt.Errorf("hybrid: allow %d on %.64q, burst %d: %w", n, key, p.Limit.Burst, ErrExceedsBurst)
	}
	if l.closing.Load() {
		return ErrClosed
	}
	return nil
}

// entryFor returns key's entry, creating it (and making room) if needed.
// It returns nil once the limiter is closing.
func (l *Limiter) entryFor(key string) *entry {
	if v, ok := l.entries.Load(key); ok {
		return v.(*entry)
	}
	if l.nkeys.Add(1) > int64(l.cfg.maxKeys) {
		l.makeRoom()
	}
	e := newEntry(strings.Clone(key))
	v, loaded := l.entries.LoadOrStore(e.key, e)
	if loaded {
		l.nkeys.Add(-1)
		return v.(*entry)
	}
	if l.closing.Load() {
		// Close may have finished its sweep before this insert.
		if l.entries.CompareAndDelete(e.key, e) {
			l.nkeys.Add(-1)
		}
		return nil
	}
	return e
}

// Mode reports the limiter's relation to the store: ModeDegraded while the
// breaker is open, ModeRecovering while outage accounts are settled,
// ModeHealthy otherwise.
func (l *Limiter) Mode() Mode {
	m := l.modeFromBreaker()
	if m == ModeHealthy && l.recov.Load() {
		return ModeRecovering
	}
	return m
}

func (l *Limiter) modeFromBreaker() Mode {
	if l.store.State() == gobreaker.StateClosed {
		return ModeHealthy
	}
	return ModeDegraded
}

func (l *Limiter) enterBackground() bool {
	l.life.Lock()
	defer l.life.Unlock()
	if l.life.closed {
		return false
	}
	l.life.wg.Add(1)
	return true
}

// Close stops the limiter: background work ends, pending reservations are
// cancelled, and every unspent leased token is given back to the store
// (bounded by ctx). Close is idempotent; later calls return nil. After
// Close, AllowN returns ErrClosed and Allow returns false.
func (l *Limiter) Close(ctx context.Context) error {
	if !l.closing.CompareAndSwap(false, true) {
		return nil
	}
	l.life.Lock()
	l.life.closed = true
	l.life.Unlock()
	close(l.stop)
	l.cancel()
	for _, tk := range l.tickers {
		tk.stop()
	}
	if l.unwatch != nil {
		l.unwatch()
	}
	l.modeMu.Lock()
	if l.settling != nil {
		for _, it := range l.settling() {
			l.queue(it)
		}
	}
	l.modeMu.Unlock()
	var items []reconcile.Item
	l.entries.Range(func(_, v any) bool {
		items = append(items, l.closeEntry(v.(*entry))...)
		return true
	})
	l.life.wg.Wait()
	// Refills that finished after the first pass may have deposited.
	l.entries.Range(func(k, v any) bool {
		items = append(items, l.closeEntry(v.(*entry))...)
		l.entries.Delete(k)
		return true
	})
	l.nkeys.Store(0)
	items = append(items, l.takeQueued()...)
	err := l.giveBack(ctx, items)
	if l.cfg.fleetSize == 0 && l.store.CanCountFleet() && l.modeFromBreaker() == ModeHealthy {
		// Leave the fleet at once rather than after the heartbeat expiry.
		_ = l.store.Leave(ctx, l.cfg.prefix, l.pol.Load().Name, l.id)
	}
	return err
}

// closeEntry closes e's lease, cancels its reservation and takes its
// outage debt, returning what to settle with the store.
func (l *Limiter) closeEntry(e *entry) []reconcile.Item {
	var out []reconcile.Item
	if n := e.lease.Close(); n > 0 {
		e.drained.Add(n)
		out = append(out, l.returnItem(e.key, n))
	}
	if n := l.cancelReservation(e); n > 0 {
		out = append(out, l.returnItem(e.key, n))
	}
	if d := e.debt.Swap(0); d > 0 {
		out = append(out, reconcile.Item{Op: remote.OpDebit, Req: l.debitReq(l.pol.Load(), e.key, d)})
	}
	return out
}

func (l *Limiter) returnItem(key string, n int64) reconcile.Item {
	return reconcile.Item{Op: remote.OpReturn, Req: l.returnReq(key, n)}
}

func (l *Limiter) returnReq(key string, n int64) remote.Request {
	p := l.pol.Load()
	return remote.Request{Prefix: l.cfg.prefix, Policy: p.Name, Key: key, Limit: p.Limit, Version: p.Version, N: n}
}

// giveBack settles items with the store at once (Close).
func (l *Limiter) giveBack(ctx context.Context, items []reconcile.Item) error {
	if len(items) == 0 {
		return nil
	}
	rep := l.send(ctx, items)
	if len(rep.Failed) > 0 {
		return fmt.Errorf("hybrid: close: %d of %d settlements failed: %w", len(rep.Failed), len(items), remote.ErrUnavailable)
	}
	return nil
}

// send settles items now and accounts for it in Stats.
func (l *Limiter) send(ctx context.Context, items []reconcile.Item) reconcile.Report {
	rep := reconcile.Send(ctx, l.store, items, 0)
	l.account(len(items), rep)
	return rep
}

func (l *Limiter) account(n int, rep reconcile.Report) {
	l.stats.storeCalls.Add(int64(n))
	l.stats.storeErrors.Add(int64(len(rep.Failed)))
	l.stats.tokensReturned.Add(rep.Returned)
	l.stats.tokensDebited.Add(rep.Debited)
}

func (l *Limiter) logMode(from, to Mode) {
	l.stats.modeChanges.Add(1)
	l.cfg.logger.LogAttrs(context.Background(), slog.LevelWarn, "leasehold: mode change",
		slog.String("policy", l.pol.Load().Name), slog.String("from", from.String()), slog.String("to", to.String()))
}

// checkBreaker notices breaker state changes (by generation, one atomic
// load) on the slow path and at every sweep, and handles them.
func (l *Limiter) checkBreaker() {
	if g := l.store.Generation(); g != l.seenGen.Load() {
		l.onBreakerChange(g)
	}
}

// onBreakerChange logs mode changes and, when the store comes back after
// an outage that left accounts open, settles them (ModeRecovering) before
// reporting Healthy.
func (l *Limiter) onBreakerChange(gen uint64) {
	l.modeMu.Lock()
	defer l.modeMu.Unlock()
	l.seenGen.Store(gen)
	prev, now := Mode(l.mode.Load()), l.modeFromBreaker()
	if prev == ModeRecovering && now == ModeHealthy {
		return // the settlement in progress reports the end of recovery
	}
	if now == ModeHealthy && prev == ModeDegraded && l.hasOutageDebt() && l.settling == nil {
		l.setModeLocked(ModeRecovering)
		l.startSettleLocked()
		return
	}
	l.setModeLocked(now)
}

func (l *Limiter) setModeLocked(m Mode) {
	prev := Mode(l.mode.Swap(int32(m)))
	if prev != m {
		l.logMode(prev, m)
	}
}
