package hybrid

import (
	"hash/maphash"
	"sync"
	"sync/atomic"
)

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
	slots []atomic.Pointer[entry]
	live  int // under entryMap.mu, like used
	used  int // live entries plus tombstones
}

// tombstone marks a deleted slot: probes go on past it.
var tombstone = &entry{}

const minTableSize = 64

func newEntryTable(size int) *entryTable {
	return &entryTable{seed: maphash.MakeSeed(), mask: uint64(size - 1), slots: make([]atomic.Pointer[entry], size)}
}

func (t *entryTable) find(key string) *entry {
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

// load returns key's entry, or nil.
func (m *entryMap) load(key string) *entry {
	t := m.cur.Load()
	if t == nil {
		return nil
	}
	return t.find(key)
}

// loadOrStore returns the entry for e.key, storing e if there was none.
func (m *entryMap) loadOrStore(e *entry) (actual *entry, loaded bool) {
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
func (m *entryMap) compareAndDelete(e *entry) bool {
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
func (m *entryMap) each(f func(*entry) bool) {
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
