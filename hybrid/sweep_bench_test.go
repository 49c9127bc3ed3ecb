package hybrid

import (
	"context"
	"strconv"
	"testing"
	"time"
)

// BenchmarkSweep is one sweep pass over keys each decided once and then
// left alone, as a spread of users leaves them: leases expired and
// empty, not yet idle long enough to be forgotten (each pass here starts
// their idle count again). The pass is the sweep's cost per tracked key,
// paid every sweep interval until the key is forgotten (8 passes);
// ns/key reports it per key. In a service the sweep finds its entries
// out of cache (a quarter second of other work went by since the last
// pass): the cold runs evict the caches before each pass, the warm ones
// do not.
func BenchmarkSweep(b *testing.B) {
	for _, c := range []struct {
		name string
		keys int
		cold bool
	}{
		{"keys=100000/warm", 100_000, false},
		{"keys=1000000/cold", 1_000_000, true},
	} {
		b.Run(c.name, func(b *testing.B) { benchSweep(b, c.keys, c.cold) })
	}
}

func benchSweep(b *testing.B, keys int, cold bool) {
	w := newFakeWorld()
	l, err := New(w.store, Policy{Name: "sweep", Limit: PerSecond(10)}, WithClock(w.clk), WithMaxKeys(keys), quiet)
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close(context.Background())
	ctx := context.Background()
	for i := range keys {
		l.Allow(ctx, "user-"+strconv.Itoa(100000+i))
	}
	// Every lease expired (a lease lasts a second), and fewer idle sweeps
	// than forget a key.
	w.clk.Advance(1100 * time.Millisecond)
	if n := l.Stats().KeysTracked; n != int64(keys) {
		b.Fatalf("%d keys tracked, want %d", n, keys)
	}
	var flush []byte
	if cold {
		flush = make([]byte, 256<<20) // past any cache this runs on
	}
	for b.Loop() {
		b.StopTimer()
		l.keys.each(func(e *account) { e.sweepMark = 0 })
		for i := 0; i < len(flush); i += 64 {
			flush[i]++
		}
		b.StartTimer()
		l.sweep()
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(keys), "ns/key")
}
