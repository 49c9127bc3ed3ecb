package remote

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/local"
)

// TestMemoryStoreExpiresBuckets: a stream of new keys under a moving clock
// keeps the store near its live set (regression: the expiry sweep used to
// be skipped forever once every write added a key).
func TestMemoryStoreExpiresBuckets(t *testing.T) {
	t.Parallel()
	clk := clock.NewManual(time.Unix(1_700_000_000, 0))
	s := NewMemory(clk)
	ctx := context.Background()
	peak := 0
	for i := 0; i < 200_000; i++ {
		if _, err := s.Lease(ctx, Request{Policy: "p", Key: strconv.Itoa(i), Limit: local.PerSecond(10), N: 1}); err != nil {
			t.Fatal(err)
		}
		if i%100 == 0 {
			clk.Advance(time.Millisecond) // TTL 1.1 s ≈ 110 000 keys
		}
		s.mu.Lock()
		peak = max(peak, len(s.mu.buckets))
		s.mu.Unlock()
	}
	if peak > 2*110_000+4096 {
		t.Fatalf("store held %d buckets at peak, live set about 110 000", peak)
	}
	clk.Advance(2 * time.Second)
	if n := s.live(); n != 0 {
		t.Fatalf("Len() = %d after every TTL passed, want 0", n)
	}
}
