package hybrid

import (
	"context"
	"math/rand/v2"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestEntryMapOps walks the map through inserts, duplicate inserts,
// deletes (of the entry, of a stale entry), regrowth and shrinking, and
// checks every key against a plain map after each step.
func TestEntryMapOps(t *testing.T) {
	var m entryMap
	want := map[string]*account{}
	check := func(step string) {
		t.Helper()
		for k, e := range want {
			if got := m.load(k); got != e {
				t.Fatalf("%s: load(%q) = %p, want %p", step, k, got, e)
			}
		}
		n := 0
		m.each(func(e *account) bool {
			if want[e.key] != e {
				t.Fatalf("%s: each visited %q, not in the map", step, e.key)
			}
			n++
			return true
		})
		if n != len(want) {
			t.Fatalf("%s: each visited %d entries, want %d", step, n, len(want))
		}
	}
	if m.load("absent") != nil || m.compareAndDelete(newAccount("absent")) {
		t.Fatal("empty map found a key")
	}
	for i := range 5000 {
		e := newAccount("k" + strconv.Itoa(i))
		if got, loaded := m.loadOrStore(e); loaded || got != e {
			t.Fatalf("insert %q: loaded %v", e.key, loaded)
		}
		want[e.key] = e
	}
	check("after 5000 inserts")
	if got, loaded := m.loadOrStore(newAccount("k7")); !loaded || got != want["k7"] {
		t.Fatal("a second insert of k7 replaced the first")
	}
	if m.compareAndDelete(newAccount("k8")) {
		t.Fatal("deleted k8 through an entry that is not the one stored")
	}
	for i := 0; i < 5000; i += 2 {
		k := "k" + strconv.Itoa(i)
		if !m.compareAndDelete(want[k]) {
			t.Fatalf("delete %q failed", k)
		}
		delete(want, k)
	}
	check("after deleting half")
	for i := 5000; i < 7000; i++ { // reuses tombstones
		e := newAccount("k" + strconv.Itoa(i))
		m.loadOrStore(e)
		want[e.key] = e
	}
	check("after reinserting")
	for k, e := range want {
		m.compareAndDelete(e)
		delete(want, k)
	}
	check("after deleting all")
	if size := len(m.cur.Load().slots); size > minTableSize*2 {
		t.Fatalf("empty map kept %d slots", size)
	}
}

// TestEntryMapConcurrent races lock-free readers against writers that
// insert and delete, with -race: a key that is present throughout is
// always found, and every lookup returns nil or the entry for its key.
func TestEntryMapConcurrent(t *testing.T) {
	var m entryMap
	stable := make([]*account, 64)
	for i := range stable {
		stable[i] = newAccount("stable-" + strconv.Itoa(i))
		m.loadOrStore(stable[i])
	}
	var stop atomic.Bool
	var writers, readers sync.WaitGroup
	for w := range 2 {
		writers.Add(1)
		go func() {
			defer writers.Done()
			for i := 0; !stop.Load(); i++ {
				e := newAccount("churn-" + strconv.Itoa(w) + "-" + strconv.Itoa(i%3000))
				if got, loaded := m.loadOrStore(e); loaded {
					m.compareAndDelete(got)
				}
			}
		}()
	}
	var misses atomic.Int64
	for range 4 {
		readers.Add(1)
		go func() {
			defer readers.Done()
			for i := range 200_000 {
				s := stable[i%len(stable)]
				if m.load(s.key) != s {
					misses.Add(1)
				}
				k := "churn-0-" + strconv.Itoa(i%3000)
				if e := m.load(k); e != nil && e.key != k {
					t.Errorf("load(%q) returned the entry of %q", k, e.key)
				}
			}
		}()
	}
	readers.Wait()
	stop.Store(true)
	writers.Wait()
	if n := misses.Load(); n != 0 {
		t.Fatalf("a key present throughout was missed %d times", n)
	}
}

// BenchmarkEntryMap compares a hit on the entry map with sync.Map's, the
// structure it replaced, over 100 000 keys; order=random looks the keys
// up in a shuffled order, as a spread of users does, so that each hit
// finds its slot, its entry and its key's bytes out of cache.
func BenchmarkEntryMap(b *testing.B) {
	keys := make([]string, 100_000)
	var m entryMap
	var sm sync.Map
	for i := range keys {
		keys[i] = "user-" + strconv.Itoa(100000+i)
		e := newAccount(keys[i])
		m.loadOrStore(e)
		sm.Store(e.key, e)
	}
	b.Run("impl=entryMap", func(b *testing.B) {
		b.ReportAllocs()
		for i := 0; b.Loop(); i++ {
			if m.load(keys[i%len(keys)]) == nil {
				b.Fatal("miss")
			}
		}
	})
	shuffled := slices.Clone(keys)
	rand.New(rand.NewPCG(1, 2)).Shuffle(len(shuffled), func(i, j int) { shuffled[i], shuffled[j] = shuffled[j], shuffled[i] })
	b.Run("impl=entryMap/order=random", func(b *testing.B) {
		b.ReportAllocs()
		for i := 0; b.Loop(); i++ {
			// The entry's lease is what a decision reads next.
			if e := m.load(shuffled[i%len(shuffled)]); e == nil || e.lease.Tokens() != 0 {
				b.Fatal("miss")
			}
		}
	})
	b.Run("impl=sync.Map", func(b *testing.B) {
		b.ReportAllocs()
		for i := 0; b.Loop(); i++ {
			if _, ok := sm.Load(keys[i%len(keys)]); !ok {
				b.Fatal("miss")
			}
		}
	})
}

// TestStatsAfterClose: Close forgets every key, and Stats still counts the
// decisions made on them (it counted only keys the sweep had evicted, and
// reported a negative count of lease admissions for the rest).
func TestStatsAfterClose(t *testing.T) {
	w := newFakeWorld()
	l, err := New(w.store, Policy{Name: "close-stats", Limit: PerSecond(10)}, WithClock(w.clk), quiet)
	require.NoError(t, err)
	ctx := context.Background()
	const keys = 50
	admitted := 0
	for i := range 3 * keys {
		if l.Allow(ctx, "k"+strconv.Itoa(i%keys)) {
			admitted++
		}
	}
	before := l.Stats()
	require.NoError(t, l.Close(ctx))
	after := l.Stats()
	require.EqualValues(t, 3*keys, before.Decisions)
	require.EqualValues(t, 0, after.KeysTracked)
	require.Equal(t, before.Decisions, after.Decisions, "decisions before and after Close")
	require.EqualValues(t, admitted, after.Admitted)
	for src := Source(0); src < numSources; src++ {
		require.GreaterOrEqual(t, after.Source(src).Admitted, int64(0), "source %v", src)
	}
}
