package hybrid

import (
	"context"
	"runtime"
	"strconv"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"

	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/remote"
)

// TestKeySpray sends distinct keys through one limiter with MaxKeys 10 000:
// tracked keys never exceed the cap and the heap stays flat.
func TestKeySpray(t *testing.T) {
	total := 1_000_000
	if raceEnabled || testing.Short() {
		total = 100_000 // the race detector makes each cold key ~10× slower; still 10× the cap
	}
	const maxKeys = 10_000
	// A store that keeps nothing, so the heap measured is the limiter's.
	clk := clock.NewManual(t0)
	l, err := New(grantAll{clk}, Policy{Name: "spray", Limit: PerSecond(10)}, WithMaxKeys(maxKeys), WithClock(clk))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.Close(context.Background()) })
	ctx := context.Background()
	heap := func() uint64 {
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return m.HeapAlloc
	}
	var warm uint64
	maxTracked := int64(0)
	for i := 0; i < total; i++ {
		if !l.Allow(ctx, "user-"+strconv.Itoa(i)) {
			t.Fatalf("fresh key %d rejected", i)
		}
		if i%100 == 99 {
			clk.Advance(time.Millisecond) // let sweeps run
		}
		if n := l.keys.n.Load(); n > maxTracked {
			maxTracked = n
		}
		if i == 2*maxKeys {
			warm = heap()
		}
	}
	end := heap()
	s := l.Stats()
	growth := int64(end) - int64(warm)
	t.Logf("%d keys: max tracked %d, evictions %d, heap %d KiB after %d keys, %d KiB at the end (growth %+d KiB)",
		total, maxTracked, s.Evictions, warm>>10, 2*maxKeys, end>>10, growth>>10)
	if maxTracked > maxKeys {
		t.Fatalf("tracked %d keys, cap %d", maxTracked, maxKeys)
	}
	if s.KeysTracked > maxKeys {
		t.Fatalf("Stats.KeysTracked = %d > %d", s.KeysTracked, maxKeys)
	}
	// Bounded: 10 000 keys at a few hundred bytes each are already in the
	// warm measure; what is left is noise.
	if growth > 8<<20 {
		t.Fatalf("heap grew %d MiB over the spray", growth>>20)
	}
}

// TestBytesPerTrackedKey measures the heap held per tracked key over
// 100 000 keys (25 000 under the race detector, which makes each cold key
// ~10× slower; the table is about as full at both sizes): at most 200
// bytes, table included.
func TestBytesPerTrackedKey(t *testing.T) {
	w := newFakeWorld()
	// The store is in this heap too: without records of its own in it,
	// the growth is what the limiter holds (a record's bytes in Redis are
	// measured on real Redis, TestStockRecordBytes in remote).
	store := recordless{w.store}
	l, err := New(store, Policy{Name: "size", Limit: PerSecond(10)}, WithClock(w.clk), quiet)
	require.NoError(t, err)
	defer l.Close(context.Background())
	ctx := context.Background()
	n := 100_000
	if raceEnabled {
		n = 25_000
	}
	keys := make([]string, n)
	for i := range keys {
		keys[i] = "user-" + strconv.Itoa(100000+i) // 11 bytes each
	}
	// The store's buckets would be counted too: make them first, then
	// measure only what tracking adds.
	l2, err := New(store, Policy{Name: "size", Limit: PerSecond(10)}, WithClock(w.clk), quiet)
	require.NoError(t, err)
	defer l2.Close(context.Background())
	for _, k := range keys {
		l2.Allow(ctx, k)
	}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for _, k := range keys {
		l.Allow(ctx, k)
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	require.EqualValues(t, len(keys), l.Stats().KeysTracked)
	per := float64(after.HeapAlloc-before.HeapAlloc) / float64(len(keys))
	t.Logf("%.0f bytes of heap per tracked key (11-byte keys, table included; entry %d bytes)", per, unsafe.Sizeof(account{}))
	if per > 200 {
		t.Fatalf("%.0f bytes per tracked key, want ≤ 200", per)
	}
	runtime.KeepAlive(keys)
}

// TestAccountSize: an account fits the 160-byte size class; what does not
// belong on every key goes to rareState.
func TestAccountSize(t *testing.T) {
	if size := unsafe.Sizeof(account{}); size > 160 {
		t.Fatalf("account is %d bytes, want ≤ 160", size)
	}
}

// recordless is a store that keeps no stock records: requests lose their
// Stock on the way.
type recordless struct{ remote.Store }

func (s recordless) Lease(ctx context.Context, r remote.Request) (remote.Result, error) {
	r.Stock = remote.Stock{}
	return s.Store.Lease(ctx, r)
}

func (s recordless) Batch(ctx context.Context, op remote.Op, rs []remote.Request) []remote.Reply {
	plain := make([]remote.Request, len(rs))
	for i, r := range rs {
		r.Stock = remote.Stock{}
		plain[i] = r
	}
	return s.Store.Batch(ctx, op, plain)
}
