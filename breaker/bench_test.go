package breaker

import (
	"context"
	"testing"

	"github.com/leasehold/leasehold/remote"
)

// nopStore grants every lease at once: what a store call costs the
// breaker, without the store.
type nopStore struct{ remote.Store }

func (nopStore) Lease(_ context.Context, r remote.Request) (remote.Result, error) {
	return remote.Result{Granted: r.N}, nil
}

// BenchmarkStoreCall is the breaker's share of a cold decision: the health
// check a limiter makes before a store call (State), then the call
// through the breaker, on a store that answers at once; serially and from
// 16 goroutines on the machine's cores.
func BenchmarkStoreCall(b *testing.B) {
	s := NewStore(nopStore{}, Settings{})
	ctx := context.Background()
	call := func() {
		if s.State() != 0 { // gobreaker.StateClosed
			b.Fatal("breaker not closed")
		}
		if _, err := s.Lease(ctx, req); err != nil {
			b.Fatal(err)
		}
	}
	b.Run("serial", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			call()
		}
	})
	b.Run("parallel", func(b *testing.B) {
		b.ReportAllocs()
		b.SetParallelism(8)
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				call()
			}
		})
	})
}
