package hybrid

import (
	"context"
	"strconv"
	"testing"
	"time"
)

// BenchmarkSweep is one sweep pass over 100 000 keys each decided once
// and then left alone, as a spread of users leaves them: leases expired
// and empty, not yet idle long enough to be forgotten (each pass here
// starts their idle count again). The pass is the sweep's cost per
// tracked key, paid every sweep interval until the key is forgotten (8
// passes); ns/key reports it per key.
func BenchmarkSweep(b *testing.B) {
	w := newFakeWorld()
	l, err := New(w.store, Policy{Name: "sweep", Limit: PerSecond(10)}, WithClock(w.clk), quiet)
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close(context.Background())
	const keys = 100_000
	ctx := context.Background()
	for i := range keys {
		l.Allow(ctx, "user-"+strconv.Itoa(100000+i))
	}
	// Every lease expired (a lease lasts a second), and fewer idle sweeps
	// than forget a key.
	w.clk.Advance(1100 * time.Millisecond)
	if n := l.Stats().KeysTracked; n != keys {
		b.Fatalf("%d keys tracked, want %d", n, keys)
	}
	for b.Loop() {
		b.StopTimer()
		l.keys.each(func(e *entry) { e.sweepMark = 0 })
		b.StartTimer()
		l.sweep()
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/keys, "ns/key")
}
