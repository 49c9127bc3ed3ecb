package hybrid

import (
	"hash/maphash"
	"strings"
	"sync"
	"sync/atomic"
)

// idleSweepsBeforeEvict is how many sweeps in a row a key must see no
// activity before it is forgotten (about two lease TTLs).
const idleSweepsBeforeEvict = 8

// keyTable owns the keys a limiter tracks: lookup, creation within
// MaxKeys, eviction and the idle sweep. Evicted entries are returned to
// the caller, which settles what they held.
type keyTable struct {
	max     int64
	entries entryMap
	n       atomic.Int64
	closed  atomic.Bool // no more entries (Close)
	// invalidLogged is set once an invalid key has been logged.
	invalidLogged atomic.Bool
	evictMu       sync.Mutex // serializes makeRoom

	evictions     atomic.Int64
	evictedAdmits atomic.Int64 // lease admissions of evicted entries, for Stats
	evictedGrants atomic.Int64 // the part of them that grants decided
}

// load returns key's account, or nil: the hot path's lookup.
func (t *keyTable) load(key string) *account {
	return t.entries.load(key)
}

// getOrCreate returns key's account under tier, creating it if needed: an
// entry under another tier is evicted first (the key moved). Making room
// evicts entries too; all are returned in evicted, for the caller to
// settle. It returns a nil entry once the table is closed.
func (t *keyTable) getOrCreate(key string, tier uint16) (e *account, evicted []*account) {
	if e := t.load(key); e != nil {
		if e.tier == tier {
			return e, nil
		}
		if t.evict(e) {
			evicted = append(evicted, e)
		}
	}
	if t.n.Add(1) > t.max {
		evicted = t.makeRoom(evicted)
	}
	e = newAccount(strings.Clone(key))
	e.tier = tier
	v, loaded := t.entries.loadOrStore(e)
	if loaded {
		t.n.Add(-1)
		return v, evicted
	}
	if t.closed.Load() {
		// Close may have finished its sweep before this insert.
		if t.entries.compareAndDelete(e) {
			t.n.Add(-1)
		}
		return nil, evicted
	}
	return e, evicted
}

// each calls f on every entry.
func (t *keyTable) each(f func(*account)) {
	t.entries.each(func(e *account) bool {
		f(e)
		return true
	})
}

// any reports whether f holds for some entry.
func (t *keyTable) any(f func(*account) bool) bool {
	found := false
	t.entries.each(func(e *account) bool {
		found = f(e)
		return !found
	})
	return found
}

// len returns the number of entries.
func (t *keyTable) len() int64 { return max(t.n.Load(), 0) }

// evict forgets e and reports whether this call did (false if it was gone).
func (t *keyTable) evict(e *account) bool {
	if !t.entries.compareAndDelete(e) {
		return false
	}
	t.n.Add(-1)
	t.evictions.Add(1)
	t.evictedAdmits.Add(e.admits.Load())
	t.evictedGrants.Add(e.grantAdmits())
	return true
}

// idle counts one more idle sweep for e if it saw no activity since the
// last one, and evicts it once idle for idleSweepsBeforeEvict sweeps in a
// row, reporting whether it did. One sweep runs at a time.
func (t *keyTable) idle(e *account, now mono) bool {
	return e.idleSweep(e.admits.Load()+e.misses.Load(), e.busy(now)) >= idleSweepsBeforeEvict && t.evict(e)
}

// makeRoom evicts keys until the tracked count is back under max. It
// evicts a batch at a time, in the map's (hash) order, skipping keys with
// a refill or reservation in flight, so a spray of new keys costs an
// amortized constant per insert.
func (t *keyTable) makeRoom(evicted []*account) []*account {
	t.evictMu.Lock()
	defer t.evictMu.Unlock()
	if t.n.Load() <= t.max {
		return evicted
	}
	target := max(t.max-t.max/64-1, 0)
	t.entries.each(func(e *account) bool {
		if e.refilling.Load() || e.pendingUntil() != 0 {
			return true
		}
		if t.evict(e) {
			evicted = append(evicted, e)
		}
		return t.n.Load() > target
	})
	return evicted
}

// clear forgets every entry (Close) and returns them. Their admissions
// stay counted, as an eviction's do: Stats after Close still counts every
// decision.
func (t *keyTable) clear() (all []*account) {
	t.entries.each(func(e *account) bool {
		all = append(all, e)
		if t.entries.compareAndDelete(e) {
			t.evictedAdmits.Add(e.admits.Load())
			t.evictedGrants.Add(e.grantAdmits())
		}
		return true
	})
	t.n.Store(0)
	return all
}

// entryMap is the key table's map from key to entry: lookups are a hash
// and a few atomic loads (no lock, no allocation), inserts and deletes
// take a mutex. It is an open-addressing table of entry pointers with
// linear probing, replaced whole (copy-on-grow) when it fills, so a
// tracked key costs about two pointers of table instead of sync.Map's
// ~110 bytes of nodes and boxed keys (BenchmarkEntryMap, TestBytesPerTrackedKey).
//
// A reader holding a table that a writer has since replaced may miss a
// key inserted after the copy: the caller's slow path then takes the
// mutex (LoadOrStore) and finds it. It never sees a deleted entry as live
// for longer than a sync.Map reader would: entries are closed when
// evicted, which is what decisions check.
type entryMap struct {
	mu  sync.Mutex // serializes writers
	cur atomic.Pointer[entryTable]
}

type entryTable struct {
	seed  maphash.Seed
	mask  uint64
	slots []atomic.Pointer[account]
	live  int // under entryMap.mu, like used
	used  int // live entries plus tombstones
}

// tombstone marks a deleted slot: probes go on past it.
var tombstone = &account{}

const minTableSize = 64

func newEntryTable(size int) *entryTable {
	return &entryTable{seed: maphash.MakeSeed(), mask: uint64(size - 1), slots: make([]atomic.Pointer[account], size)}
}

// find returns key's account in t, or nil; t may be nil (no table yet).
func (t *entryTable) find(key string) *account {
	if t == nil {
		return nil
	}
	for i := maphash.String(t.seed, key) & t.mask; ; i = (i + 1) & t.mask {
		e := t.slots[i].Load()
		if e == nil {
			return nil
		}
		if e != tombstone && e.key == key {
			return e
		}
	}
}

// load returns key's account, or nil. Small enough to inline into the hot
// path's lookup.
func (m *entryMap) load(key string) *account { return m.cur.Load().find(key) }

// loadOrStore returns the entry for e.key, storing e if there was none.
func (m *entryMap) loadOrStore(e *account) (actual *account, loaded bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	t := m.cur.Load()
	if t == nil {
		t = newEntryTable(minTableSize)
		m.cur.Store(t)
	}
	if x := t.find(e.key); x != nil {
		return x, true
	}
	// Grow (or clean out tombstones) past 70% use: probes stay short.
	if (t.used+1)*10 > len(t.slots)*7 {
		t = m.rebuildLocked(t, t.live+1)
	}
	i := maphash.String(t.seed, e.key) & t.mask
	for {
		x := t.slots[i].Load()
		if x == nil {
			t.used++
			break
		}
		if x == tombstone {
			break // reuse: find proved the key is not further on
		}
		i = (i + 1) & t.mask
	}
	t.slots[i].Store(e)
	t.live++
	return e, false
}

// compareAndDelete deletes e if it is still the entry for its key.
func (m *entryMap) compareAndDelete(e *account) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	t := m.cur.Load()
	if t == nil {
		return false
	}
	for i := maphash.String(t.seed, e.key) & t.mask; ; i = (i + 1) & t.mask {
		x := t.slots[i].Load()
		switch {
		case x == nil:
			return false
		case x == e:
			t.slots[i].Store(tombstone)
			t.live--
			if len(t.slots) > minTableSize && t.live*8 < len(t.slots) {
				m.rebuildLocked(t, t.live) // shrink once mostly empty
			}
			return true
		}
	}
}

// rebuildLocked replaces t by a table sized for live entries at half
// use or less, copying the live ones; readers of t keep a consistent view.
func (m *entryMap) rebuildLocked(t *entryTable, live int) *entryTable {
	size := minTableSize
	for size < 2*live {
		size *= 2
	}
	n := newEntryTable(size)
	for i := range t.slots {
		e := t.slots[i].Load()
		if e == nil || e == tombstone {
			continue
		}
		j := maphash.String(n.seed, e.key) & n.mask
		for n.slots[j].Load() != nil {
			j = (j + 1) & n.mask
		}
		n.slots[j].Store(e)
		n.live++
		n.used++
	}
	m.cur.Store(n)
	return n
}

// each calls f on every entry until f returns false. Entries inserted or
// deleted meanwhile may or may not be seen.
func (m *entryMap) each(f func(*account) bool) {
	t := m.cur.Load()
	if t == nil {
		return
	}
	for i := range t.slots {
		if e := t.slots[i].Load(); e != nil && e != tombstone && !f(e) {
			return
		}
	}
}
