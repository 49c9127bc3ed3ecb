package hybrid

import (
	"strings"
	"sync"
	"sync/atomic"
)

// idleSweepsBeforeEvict is how many sweeps in a row a key must see no
// activity before it is forgotten (about two lease TTLs).
const idleSweepsBeforeEvict = 8

// keyTable owns the keys a limiter tracks: lookup, creation within
// MaxKeys, eviction and the idle sweep. Evicted entries are closed (their
// lease takes no more tokens) and handed to the caller, which settles what
// they held.
type keyTable struct {
	max     int64
	entries entryMap
	n       atomic.Int64
	evictMu sync.Mutex // serializes makeRoom

	evictions     atomic.Int64
	evictedAdmits atomic.Int64 // lease admissions of evicted entries, for Stats
}

// load returns key's entry, or nil: the hot path's lookup.
func (t *keyTable) load(key string) *entry {
	return t.entries.load(key)
}

// getOrCreate returns key's entry under tier, creating it if needed: an
// entry under another tier is evicted first (the key moved). Making room
// evicts entries too; all are passed to release. It returns nil once
// closing reports true.
func (t *keyTable) getOrCreate(key string, tier uint16, closing func() bool, release func(*entry)) *entry {
	if e := t.load(key); e != nil {
		if e.tier == tier {
			return e
		}
		if t.evict(e) {
			release(e)
		}
	}
	if t.n.Add(1) > t.max {
		t.makeRoom(release)
	}
	e := newEntry(strings.Clone(key))
	e.tier = tier
	v, loaded := t.entries.loadOrStore(e)
	if loaded {
		t.n.Add(-1)
		return v
	}
	if closing() {
		// Close may have finished its sweep before this insert.
		if t.entries.compareAndDelete(e) {
			t.n.Add(-1)
		}
		return nil
	}
	return e
}

// each calls f on every entry.
func (t *keyTable) each(f func(*entry)) {
	t.entries.each(func(e *entry) bool {
		f(e)
		return true
	})
}

// any reports whether f holds for some entry.
func (t *keyTable) any(f func(*entry) bool) bool {
	found := false
	t.entries.each(func(e *entry) bool {
		found = f(e)
		return !found
	})
	return found
}

// len returns the number of entries.
func (t *keyTable) len() int64 { return max(t.n.Load(), 0) }

// evict forgets e and reports whether this call did (false if it was gone).
func (t *keyTable) evict(e *entry) bool {
	if !t.entries.compareAndDelete(e) {
		return false
	}
	t.n.Add(-1)
	t.evictions.Add(1)
	t.evictedAdmits.Add(e.admits.Load())
	return true
}

// sweepIdle counts one more idle sweep for each entry with no activity
// since the last one, and evicts (passing to release) those idle for
// idleSweepsBeforeEvict sweeps. It runs one pass at a time.
func (t *keyTable) sweepIdle(now mono, release func(*entry)) {
	t.each(func(e *entry) {
		if e.idleSweep(e.admits.Load()+e.misses.Load(), e.busy(now)) >= idleSweepsBeforeEvict && t.evict(e) {
			release(e)
		}
	})
}

// makeRoom evicts keys until the tracked count is back under max. It
// evicts a batch at a time, in the map's (hash) order, skipping keys with
// a refill or reservation in flight, so a spray of new keys costs an
// amortized constant per insert.
func (t *keyTable) makeRoom(release func(*entry)) {
	t.evictMu.Lock()
	defer t.evictMu.Unlock()
	if t.n.Load() <= t.max {
		return
	}
	target := max(t.max-t.max/64-1, 0)
	t.entries.each(func(e *entry) bool {
		if e.refilling.Load() || e.pendingUntil() != 0 {
			return true
		}
		if t.evict(e) {
			release(e)
		}
		return t.n.Load() > target
	})
}

// clear forgets every entry (Close), passing each to release.
func (t *keyTable) clear(release func(*entry)) {
	t.entries.each(func(e *entry) bool {
		release(e)
		t.entries.compareAndDelete(e)
		return true
	})
	t.n.Store(0)
}
