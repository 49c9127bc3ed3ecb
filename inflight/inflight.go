// Package inflight limits how many requests of a key are in flight at once
// across a fleet of processes sharing one Redis ("at most 50 requests of
// this tenant in flight"), in the shape of golang.org/x/sync/semaphore:
// Acquire, TryAcquire, Release, per key.
//
// A process leases slots in batches from the store and
// acquires and releases locally while it holds them: an acquire on a held
// slot is a clock read and a compare-and-swap, with no store call, lock or
// allocation.
// Slots beyond what the key uses plus a small batch go back at once. The
// process holds its slots under a term the store counts by its own clock
// and that the process renews every quarter of it, so the slots of a
// crashed or cut-off process come back when its term ends, and never
// before: in healthy mode the fleet never holds more than the limit at any
// instant. A process stops acquiring on held slots a margin before their
// term, counted from when it asked.
//
// When the store cannot be reached, a process keeps using the slots it
// holds until their term, and once a term has passed since its first
// failed call (when every holding live at the outage has ended) admits up
// to its share of the limit (Slots/N, N the fleet size from WithFleetSize
// or the store's heartbeats) in flight, so a fleet that lost the store
// together stays within the limit. A process cut off alone uses its share
// while the others go on holding slots at the store: slots still in use
// when a term ends without a renewal may be granted to others meanwhile,
// which is the price of not waiting on a store that is away.
//
// A Policy (NewWithPolicy) names the limit, its version and its tiers
// (WithTier); SetPolicy changes it for the whole fleet.
package inflight

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"sync"
	"sync/atomic"
	"time"

	"github.com/leasehold/leasehold/internal/background"
	"github.com/leasehold/leasehold/internal/errs"
	"github.com/leasehold/leasehold/internal/keys"
	"github.com/leasehold/leasehold/remote"
)

// Errors, matched with errors.Is.
var (
	// ErrInvalidN: n ≤ 0, or more than the limit's slots.
	ErrInvalidN = errs.New("inflight", "invalid n")
	// ErrClosed: the limiter was closed.
	ErrClosed = errs.New("inflight", "limiter closed")
	// ErrInvalidOption: an option or limit New cannot work with.
	ErrInvalidOption = errs.New("inflight", "invalid option")
)

// Limiter is a fleet-wide concurrency limit of Slots per key. It is safe
// for concurrent use.
type Limiter struct {
	cfg    config
	store  backend
	fleet  remote.Fleet // nil when the store keeps no fleet or WithFleetSize is set
	name   string
	holder string
	epoch  time.Time

	policy    atomic.Pointer[Policy]
	synced    atomic.Bool // the store's policy record has been read and compared
	syncMu    sync.Mutex  // held by the first comparison
	rereading atomic.Bool // a reread is scheduled: a store reply named a newer policy version

	keys keyMap

	size atomic.Int64 // the fleet's size as last counted
	// failing: the last store call failed as unavailable, first at
	// failedAt (mono); recoverUntil (mono): the end of the hold after an
	// outage (see ceiling).
	failing      atomic.Bool
	failedAt     atomic.Int64
	recoverUntil atomic.Int64
	calls        atomic.Int64
	errors       atomic.Int64
	closed       atomic.Bool
	kick         chan *slotKey // keys with slots to give back
	kicking      atomic.Bool   // a drainKicks is scheduled
	bg           *background.Group
}

// New returns a limit of slots in flight per key, named name (keys of two
// limits with one name share their slots), kept in store: a
// *remote.RedisStore (standalone or Cluster) or a *remote.MemoryStore. It
// is NewWithPolicy with Policy{Name: name, Slots: slots, Version: 1}.
func New(store remote.Store, name string, slots int64, opts ...Option) (*Limiter, error) {
	return NewWithPolicy(store, Policy{Name: name, Slots: slots, Version: 1}, opts...)
}

// NewWithPolicy returns a concurrency limit under p, which the fleet can
// change with SetPolicy; a newer version in the store wins over p, and so
// does a different record of the same version (logged).
func NewWithPolicy(store remote.Store, p Policy, opts ...Option) (*Limiter, error) {
	cfg, err := newConfig(opts)
	if err != nil {
		return nil, err
	}
	p.Version = max(p.Version, 1)
	if err := p.Validate(); err != nil {
		return nil, err
	}
	if err := keys.ValidateNames(cfg.prefix, p.Name); err != nil {
		return nil, errs.Errorf("inflight", "%w: %w", ErrInvalidOption, err)
	}
	st, err := backendOf(store)
	if err != nil {
		return nil, err
	}
	var id [8]byte
	_, _ = rand.Read(id[:])
	name := p.Name
	p.Tiers = maps.Clone(p.Tiers)
	l := &Limiter{cfg: cfg, store: st, name: name, holder: hex.EncodeToString(id[:]),
		epoch: cfg.clk.Now(), kick: make(chan *slotKey, 256), bg: background.New(cfg.clk)}
	l.policy.Store(&p)
	if f, ok := store.(remote.Fleet); ok && cfg.fleetSize == 0 {
		l.fleet = f
	}
	l.size.Store(int64(max(cfg.fleetSize, 1)))
	if l.fleet != nil {
		// Until the first heartbeat counts the fleet, batches and shares
		// are sized for a large one: the first acquires of a fleet that
		// starts together would otherwise each ask for a quarter of the
		// limit, and slots would move back and forth while renewals trim
		// them.
		l.size.Store(uncountedFleet)
	}
	l.start()
	return l, nil
}

// uncountedFleet is the fleet size assumed before the first heartbeat.
const uncountedFleet = 16

// mono is a reading of the limiter's clock, in nanoseconds since New.
type mono int64

func (l *Limiter) now() mono { return mono(l.cfg.clk.Now().Sub(l.epoch)) }

// slotKey is one key's slots in this process. word packs what the store
// granted (held, high 32 bits) and what is in use (low 32 bits), so that
// an acquire and a give-back never pass each other: in use ≤ held after
// every successful change, except while the store is away (see share).
type slotKey struct {
	key     string
	tier    atomic.Pointer[string] // the tier its slots are under
	word    atomic.Uint64
	until   atomic.Int64  // mono: held slots are usable before then
	usedAt  atomic.Int64  // mono: last acquire
	mu      sync.Mutex    // one store call at a time
	waiters chan struct{} // closed by a release, to wake blocked Acquires
	waitMu  sync.Mutex
	nwait   atomic.Int32 // Acquires blocked on waiters: a release takes waitMu only if some are
	queued  atomic.Bool  // in the give-back queue
	// refusedAt: 1 + when a store call last found no room for an
	// acquire; within the retry interval after it, acquires that do not
	// fit the held slots are refused without asking again.
	refusedAt atomic.Int64
	// full: the store's last answer said other processes wait for slots;
	// the key then keeps no spare slots, so that they move to them.
	full atomic.Bool
	// tight: the store's last answer found less than a quarter of the
	// limit free, or others waiting. Only a tight key holding spare
	// slots checks every spareCheck whether others wait for them: with
	// more free, another process's ask is met from the free slots, and
	// this key's next call (every swing of its load past its band makes
	// one, and renewals come every quarter term) sees any change.
	tight atomic.Bool
	// over: the store's last answer said the fleet holds more than the
	// key's limit (it was lowered): slots released go back to the store
	// and every acquire asks it, until the holdings are under the limit.
	over atomic.Bool
	// renew: the next give-back call is made even if nothing changed
	// (a lowered limit: the answer says whether the fleet is over it).
	renew atomic.Bool
}

func (k *slotKey) tierName() string { return *k.tier.Load() }

func split(w uint64) (held, inUse int64) { return int64(w >> 32), int64(uint32(w)) }
func pack(held, inUse int64) uint64      { return uint64(held)<<32 | uint64(uint32(inUse)) }

// TryAcquire takes n slots of key without blocking and reports whether it
// did; it asks the store only when the slots this process holds do not
// cover n.
func (l *Limiter) TryAcquire(key string, n int64) bool {
	ok, _ := l.tryAcquire(context.Background(), key, n)
	return ok
}

func (l *Limiter) tryAcquire(ctx context.Context, key string, n int64) (bool, error) {
	if l.closed.Load() {
		return false, ErrClosed
	}
	for {
		k, err := l.key(key)
		if err != nil {
			return false, err
		}
		tier := k.tierName()
		if l.cfg.tierOf != nil {
			if t := l.cfg.tierOf(key); t != tier {
				tier = l.retier(ctx, k, t)
			}
		}
		slots := l.policy.Load().slotsOf(tier)
		if n < 1 || n > slots {
			return false, errs.Errorf("inflight", "acquire %d of %.64q, limit %d: %w", n, key, slots, ErrInvalidN)
		}
		now := l.now()
		if !k.over.Load() && k.take(now, n, 0, l.ceiling(now, slots)) {
			return true, nil
		}
		if ok, err, forgotten := l.slow(ctx, k, n); !forgotten {
			return ok, err
		}
	}
}

// take acquires n on k's held slots while their term lasts, never past
// ceiling (see Limiter.ceiling). When the store is away (cap > 0) it uses
// the held slots until their term and only then up to cap, the share: the
// holdings of a fleet that lost the store together still sum to at most
// the limit until their terms end, and the shares after.
func (k *slotKey) take(now mono, n, cap, ceiling int64) bool {
	live := int64(now) < k.until.Load()
	for {
		w := k.word.Load()
		held, inUse := split(w)
		limit := held
		switch {
		case !live && cap > 0:
			limit = cap
		case !live:
			limit = 0
		}
		limit = min(limit, ceiling)
		if inUse+n > limit {
			return false
		}
		if k.word.CompareAndSwap(w, pack(held, inUse+n)) {
			// Idle is counted in quarters of a term: a write per
			// millisecond is plenty, and spares a contended cache line.
			if int64(now)-k.usedAt.Load() > int64(time.Millisecond) {
				k.usedAt.Store(int64(now))
			}
			return true
		}
	}
}

// slow asks the store to raise k's holding to cover n plus a batch, then
// takes n; while the store is away it takes n within the share.
// forgotten reports k dropped from the limiter meanwhile (see forgetIdle)
// or moved to another tier: the caller looks the key up again.
func (l *Limiter) slow(ctx context.Context, k *slotKey, n int64) (ok bool, err error, forgotten bool) {
	if !l.synced.Load() {
		_ = l.refresh(ctx) // the first store call of a limiter learns the store's policy first
	}
	tier := k.tierName()
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.word.Load() == tombstone || k.tierName() != tier {
		return false, nil, true
	}
	slots := l.policy.Load().slotsOf(tier)
	now := l.now()
	over := k.over.Load()
	if !over && k.take(now, n, 0, l.ceiling(now, slots)) { // another caller's call brought them
		return true, nil, false
	}
	if r := k.refusedAt.Load(); r != 0 && now-mono(r-1) < mono(l.cfg.retry) {
		return false, nil, false // the store had no room a moment ago
	}
	if over {
		// Held slots beyond those in use do not count while the fleet is
		// over a lowered limit: give them back, and ask only once the
		// store's answer says the fleet is under it.
		if _, err := l.call(ctx, k, l.lower(k, 0)); err != nil {
			ok, err := l.away(ctx, k, n, slots, err)
			return ok, err, false
		}
		if k.over.Load() {
			k.refusedAt.Store(int64(now) + 1)
			return false, nil, false
		}
	}
	_, inUse := split(k.word.Load())
	ask := inUse + n
	if !k.full.Load() && !k.over.Load() {
		ask += l.batch(slots)
	}
	if _, err := l.call(ctx, k, ask); err != nil {
		ok, err := l.away(ctx, k, n, slots, err)
		return ok, err, false
	}
	if now := l.now(); !k.over.Load() && k.take(now, n, 0, l.ceiling(now, slots)) {
		return true, nil, false
	}
	k.refusedAt.Store(int64(now) + 1)
	return false, nil, false
}

// away decides an acquire whose store call failed with err: while the
// store is unavailable, on the slots held until their term, and within
// the share once a term has passed since the first failed call, by when
// every other holder's slots have expired too if the whole fleet lost the
// store (with a process's own term alone, a process on its share and one
// still on its held slots could pass the limit together); err when the
// caller gave up or the store answered with an error.
func (l *Limiter) away(ctx context.Context, k *slotKey, n, slots int64, err error) (bool, error) {
	if errors.Is(err, remote.ErrUnavailable) && ctx.Err() == nil {
		now, share, cap := l.now(), l.share(slots), l.share(slots)
		if int64(now) < l.failedAt.Load()+int64(l.cfg.term) {
			cap = 0
		}
		return k.take(now, n, cap, share), nil
	}
	return false, err
}

// retier moves k to tier once nothing of it is in use in this process,
// giving back what it holds under its old tier; it returns the tier k is
// under after it: the old one while requests under it are in flight.
func (l *Limiter) retier(ctx context.Context, k *slotKey, tier string) string {
	k.mu.Lock()
	defer k.mu.Unlock()
	old := k.tierName()
	if held, inUse := split(k.word.Load()); inUse > 0 || k.word.Load() == tombstone {
		return old
	} else if held > 0 {
		if _, err := l.call(ctx, k, 0); err != nil {
			return old // the old tier still counts them: try again later
		}
	}
	k.tier.Store(&tier)
	k.word.Store(0)
	k.until.Store(0)
	k.refusedAt.Store(0)
	k.full.Store(false)
	return tier
}

// call sets k's holding at the store to want (at least what is in use) and
// records the answer: held and the term's end.
func (l *Limiter) call(ctx context.Context, k *slotKey, want int64) (slotReply, error) {
	sent := l.now()
	cctx, cancel := context.WithTimeout(ctx, l.cfg.timeout)
	defer cancel()
	l.calls.Add(1)
	p, tier := l.policy.Load(), k.tierName()
	res, err := l.store.slots(cctx, slotRequest{key: keys.Slots(l.cfg.prefix, l.name, tier, k.key),
		holder: l.holder, hold: want, limit: p.slotsOf(tier), version: p.Version, term: l.cfg.term})
	if err != nil {
		l.errors.Add(1)
		if errors.Is(err, remote.ErrUnavailable) && ctx.Err() == nil {
			if !l.failing.Swap(true) { // not a caller that gave up
				l.failedAt.Store(int64(sent))
			}
		}
		return res, err
	}
	if res.version > p.Version && l.rereading.CompareAndSwap(false, true) {
		l.soon(func() { // read the newer policy
			l.rereading.Store(false)
			l.reread()
		})
	}
	if l.failing.Swap(false) {
		// Back from an outage: the others may still be on their shares,
		// which the store does not count; keep to the share for a term,
		// by when each has called the store again or is cut off.
		l.recoverUntil.Store(int64(l.now()) + int64(l.cfg.term))
	}
	k.full.Store(res.waiting > 0)
	k.over.Store(res.inUse > res.limit)
	k.tight.Store(res.waiting > 0 || res.limit-res.inUse < max(1, res.limit/4))
	for {
		w := k.word.Load()
		_, inUse := split(w)
		if k.word.CompareAndSwap(w, pack(res.held, inUse)) {
			break
		}
	}
	// The store's term starts at its TIME, read after the request left:
	// stop a margin before the term counted from the send.
	k.until.Store(int64(sent) + int64(l.cfg.term-l.cfg.term/100-time.Millisecond))
	return res, nil
}

// Acquire takes n slots of key, waiting until they are free or ctx ends;
// it returns ctx.Err() unchanged if ctx ends first. While it waits it asks
// the store again every retry interval (WithRetry), and at once when this
// process releases slots of key.
func (l *Limiter) Acquire(ctx context.Context, key string, n int64) error {
	for {
		ok, err := l.tryAcquire(ctx, key, n)
		if err != nil && ctx.Err() != nil {
			return ctx.Err()
		}
		if err != nil || ok {
			return err
		}
		k, err := l.key(key)
		if err != nil {
			return err
		}
		k.waitMu.Lock()
		if k.waiters == nil {
			k.waiters = make(chan struct{})
		}
		ch := k.waiters
		k.nwait.Add(1)
		k.waitMu.Unlock()
		err = l.wait(ctx, ch)
		k.nwait.Add(-1)
		if err != nil {
			return err
		}
	}
}

// wait waits for a release (ch), the retry interval, ctx or Close.
func (l *Limiter) wait(ctx context.Context, ch chan struct{}) error {
	t := l.cfg.clk.NewTimer(l.cfg.retry)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-l.bg.Done:
		return ErrClosed
	case <-ch:
	case <-t.C():
	}
	return nil
}

// Release gives back n slots of key that this process acquired. Slots
// held beyond what is in use plus a batch go back to the store at once, in
// the background.
func (l *Limiter) Release(key string, n int64) {
	if n < 1 {
		return
	}
	k := l.keys.load(key)
	if k == nil {
		return
	}
	for {
		w := k.word.Load()
		held, inUse := split(w)
		if k.word.CompareAndSwap(w, pack(held, max(inUse-n, 0))) {
			if k.over.Load() {
				// The fleet is over a lowered limit: the slot is not
				// reused, and the next acquire asks the store again.
				l.lower(k, 0)
				k.refusedAt.Store(0)
			}
			if held-(inUse-n) > l.giveBackAbove(k) {
				l.queue(k)
			}
			break
		}
	}
	if k.nwait.Load() == 0 {
		return // a blocked Acquire counts itself before it waits
	}
	k.waitMu.Lock()
	if k.waiters != nil {
		close(k.waiters)
		k.waiters = nil
	}
	k.waitMu.Unlock()
}

// queue asks the background to bring k's holding down to its use.
func (l *Limiter) queue(k *slotKey) {
	if k.queued.CompareAndSwap(false, true) {
		select {
		case l.kick <- k:
			if l.kicking.CompareAndSwap(false, true) {
				l.soon(l.drainKicks)
			}
		default:
			k.queued.Store(false) // the next renewal gives them back
		}
	}
}

// key returns key's slots, made on first use under the tier WithTier
// names.
func (l *Limiter) key(key string) (*slotKey, error) {
	if k := l.keys.load(key); k != nil {
		return k, nil
	}
	if err := keys.Validate(l.cfg.prefix, l.name, key); err != nil {
		return nil, errs.Errorf("inflight", "acquire %.64q: %w", key, err)
	}
	k := &slotKey{key: key}
	tier := ""
	if l.cfg.tierOf != nil {
		tier = l.cfg.tierOf(key)
	}
	k.tier.Store(&tier)
	return l.keys.loadOrStore(key, k), nil
}

// keyMap is the limiter's keys: lock-free reads, since every acquire and
// release looks its key up.
type keyMap struct{ m sync.Map }

func (m *keyMap) load(key string) *slotKey {
	if v, ok := m.m.Load(key); ok {
		return v.(*slotKey)
	}
	return nil
}

func (m *keyMap) loadOrStore(key string, k *slotKey) *slotKey {
	v, _ := m.m.LoadOrStore(key, k)
	return v.(*slotKey)
}

// all returns every key.
func (m *keyMap) all() []*slotKey {
	var ks []*slotKey
	m.m.Range(func(_, v any) bool {
		ks = append(ks, v.(*slotKey))
		return true
	})
	return ks
}

func (m *keyMap) delete(k *slotKey) { m.m.CompareAndDelete(k.key, k) }

// batch is how many slots a key asks for beyond what it needs: a quarter
// of the limit's part among the fleet, at least 1. A key keeps up to two
// batches spare (see spare): the band keeps a steady load from calling
// the store at each swing of what is in flight.
func (l *Limiter) batch(slots int64) int64 { return max(1, slots/(4*l.size.Load())) }

// spare is how many slots k keeps beyond what it uses: two batches, none
// while other processes wait for slots or the fleet is over the limit.
func (l *Limiter) spare(k *slotKey) int64 {
	if k.full.Load() || k.over.Load() {
		return 0
	}
	return 2 * l.batch(l.policy.Load().slotsOf(k.tierName()))
}

// giveBackAbove is how many unused slots k holds before a release gives
// the spare beyond them back at once: its spare when tight, twice that
// otherwise, so that a load swinging within the band costs no store call
// (the renewal every quarter term trims the rest).
func (l *Limiter) giveBackAbove(k *slotKey) int64 {
	if k.tight.Load() {
		return l.spare(k)
	}
	return 2 * l.spare(k)
}

// ceiling is the most a key under a limit of slots may have in use at now
// whatever it holds: the limit (a holding from before a lowering may be
// above it), or its share while a term has not passed since the store
// came back from an outage, for until then the others may be deciding by
// their shares, which the store does not count.
func (l *Limiter) ceiling(now mono, slots int64) int64 {
	if int64(now) < l.recoverUntil.Load() {
		return l.share(slots)
	}
	return slots
}

// share is how many slots a key may have in use while the store is away:
// the limit divided among the fleet, at least 1.
func (l *Limiter) share(slots int64) int64 { return max(1, slots/l.size.Load()) }

// Stats counts a limiter's store calls.
type Stats struct {
	// StoreCalls counts slot calls; StoreErrors those that failed.
	StoreCalls, StoreErrors int64
	// Held and InUse sum every key's slots held from the store and in use.
	Held, InUse int64
	// FleetSize is N, the processes the share divides the limit among.
	FleetSize int
}

// Stats returns the limiter's counters.
func (l *Limiter) Stats() Stats {
	s := Stats{StoreCalls: l.calls.Load(), StoreErrors: l.errors.Load(), FleetSize: int(l.size.Load())}
	for _, k := range l.keys.all() {
		held, inUse := split(k.word.Load())
		s.Held += held
		s.InUse += inUse
	}
	return s
}

// Close stops the limiter and gives every held slot back (bounded by
// ctx). Slots acquired and not yet released go back too: the requests
// holding them are no longer counted. Close is idempotent.
func (l *Limiter) Close(ctx context.Context) error {
	if !l.closed.CompareAndSwap(false, true) {
		return nil
	}
	l.bg.Close()
	l.bg.Wait()
	keys := l.keys.all()
	var failed int
	for _, k := range keys {
		if held, _ := split(k.word.Load()); held == 0 {
			continue
		}
		if _, err := l.call(ctx, k, 0); err != nil {
			failed++
		}
	}
	if l.fleet != nil {
		_ = l.fleet.Leave(ctx, l.cfg.prefix, l.name, l.holder)
	}
	if failed > 0 {
		return errs.Errorf("inflight", "close: %d keys' slots not given back (they come back when their term ends): %w", failed, remote.ErrUnavailable)
	}
	return nil
}

// String names the limit.
func (l *Limiter) String() string {
	return fmt.Sprintf("%s: %d in flight per key", l.name, l.policy.Load().Slots)
}
