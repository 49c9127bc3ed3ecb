package reconcile

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/local"
	"github.com/leasehold/leasehold/remote"
)

// recorder is a Store that records each batch; it fails while down.
type recorder struct {
	remote.Store
	mu      sync.Mutex
	batches []remote.Op
	sizes   []int
	down    bool
}

func (r *recorder) Batch(ctx context.Context, op remote.Op, rs []remote.Request) []remote.Reply {
	r.mu.Lock()
	r.batches = append(r.batches, op)
	r.sizes = append(r.sizes, len(rs))
	down := r.down
	r.mu.Unlock()
	if down {
		out := make([]remote.Reply, len(rs))
		for i := range out {
			out[i].Err = remote.ErrUnavailable
		}
		return out
	}
	return r.Store.Batch(ctx, op, rs)
}

func items(op remote.Op, n int) []Item {
	out := make([]Item, n)
	for i := range out {
		out[i] = Item{Op: op, Req: remote.Request{Policy: "p", Key: string(rune('a' + i%26)), Limit: local.PerSecond(100), N: 2}}
	}
	return out
}

func TestRunDebitsFirstInBatchesAfterJitter(t *testing.T) {
	t.Parallel()
	clk := clock.NewManual(time.Unix(1_700_000_000, 0))
	rec := &recorder{Store: remote.NewMemory(clk)}
	s := Settler{Store: rec, Clock: clk, BatchSize: 4, MaxJitter: 100 * time.Millisecond, Pace: 10 * time.Millisecond}
	in := append(items(remote.OpReturn, 5), items(remote.OpDebit, 6)...)
	done := make(chan Report, 1)
	go func() { rep, _ := s.Run(context.Background(), in); done <- rep }()
	// Nothing is sent before the jitter, and batches are paced on the clock.
	deadline := time.Now().Add(10 * time.Second)
	var rep Report
	for rep.Batches == 0 {
		select {
		case rep = <-done:
		default:
			if time.Now().After(deadline) {
				t.Fatal("Run did not finish")
			}
			clk.Advance(time.Millisecond)
			time.Sleep(100 * time.Microsecond) // let Run's goroutine reach its next timer
		}
	}
	if rep.Debited != 12 || rep.Returned != 10 || len(rep.Failed) != 0 {
		t.Fatalf("Report = %+v, want 12 debited, 10 returned", rep)
	}
	want := []remote.Op{remote.OpDebit, remote.OpDebit, remote.OpReturn, remote.OpReturn}
	wantSizes := []int{4, 2, 4, 1}
	if len(rec.batches) != len(want) {
		t.Fatalf("batches %v, want %v", rec.batches, want)
	}
	for i := range want {
		if rec.batches[i] != want[i] || rec.sizes[i] != wantSizes[i] {
			t.Fatalf("batch %d = %v×%d, want %v×%d", i, rec.batches[i], rec.sizes[i], want[i], wantSizes[i])
		}
	}
}

func TestRunReportsWhatTheStoreCouldNotTake(t *testing.T) {
	t.Parallel()
	clk := clock.NewManual(time.Unix(0, 0))
	rec := &recorder{Store: remote.NewMemory(clk), down: true}
	rep := Send(context.Background(), rec, items(remote.OpDebit, 3), 0)
	if len(rep.Failed) != 3 || rep.Debited != 0 {
		t.Fatalf("Send to a down store = %+v, want 3 failed", rep)
	}
	// Bad input cannot succeed on retry: dropped, not failed.
	bad := items(remote.OpReturn, 1)
	bad[0].Req.N = -1
	rec.down = false
	rep = Send(context.Background(), rec, bad, 0)
	if rep.Dropped != 1 || len(rep.Failed) != 0 {
		t.Fatalf("Send(bad input) = %+v, want 1 dropped", rep)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	r2, err := (Settler{Store: rec, Clock: clk}).Run(ctx, items(remote.OpDebit, 2))
	if !errors.Is(err, context.Canceled) || len(r2.Failed) != 2 {
		t.Fatalf("Run with a cancelled ctx = %+v, %v", r2, err)
	}
}
