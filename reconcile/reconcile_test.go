package reconcile

import (
	"context"
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

func TestStartDebitsFirstInBatches(t *testing.T) {
	t.Parallel()
	clk := clock.NewManual(time.Unix(1_700_000_000, 0))
	rec := &recorder{Store: remote.NewMemory(clk)}
	s := Settler{Store: rec, Clock: clk, BatchSize: 4, MaxJitter: 100 * time.Millisecond, Pace: 10 * time.Millisecond}
	var rep *Report
	s.Start(append(items(remote.OpReturn, 5), items(remote.OpDebit, 6)...), func(r Report) { rep = &r })
	// Jitter ≤ 100 ms, then four batches 10 ms apart: all done by 130 ms.
	clk.Advance(130 * time.Millisecond)
	if rep == nil || rep.Debited != 12 || rep.Returned != 10 || len(rep.Failed) != 0 {
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

func TestSendReportsWhatTheStoreCouldNotTake(t *testing.T) {
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
}

// TestStartIsDrivenByTheClock: Start sends nothing until the clock passes
// the jitter, then one batch per pace, all inside Advance.
func TestStartIsDrivenByTheClock(t *testing.T) {
	t.Parallel()
	clk := clock.NewManual(time.Unix(1_700_000_000, 0))
	rec := &recorder{Store: remote.NewMemory(clk)}
	// The jitter is random in [0, MaxJitter]: make it 1 ns to step exactly.
	s := Settler{Store: rec, Clock: clk, BatchSize: 2, MaxJitter: time.Nanosecond, Pace: 10 * time.Millisecond}
	var got *Report
	s.Start(append(items(remote.OpReturn, 3), items(remote.OpDebit, 2)...), func(r Report) { got = &r })
	if len(rec.batches) != 0 {
		t.Fatal("a batch went out before the jitter")
	}
	clk.Advance(time.Nanosecond)
	if len(rec.batches) != 1 || rec.batches[0] != remote.OpDebit {
		t.Fatalf("after the jitter: batches %v, want one debit batch", rec.batches)
	}
	clk.Advance(10 * time.Millisecond)
	if len(rec.batches) != 2 || got != nil {
		t.Fatalf("after one pace: batches %v, done %v", rec.batches, got)
	}
	clk.Advance(10 * time.Millisecond)
	if got == nil || got.Debited != 4 || got.Returned != 6 || got.Batches != 3 {
		t.Fatalf("report %+v, want 4 debited and 6 returned in 3 batches", got)
	}
	// Cancel returns what was not sent.
	cancel := s.Start(items(remote.OpReturn, 5), func(Report) { t.Error("cancelled run finished") })
	clk.Advance(time.Nanosecond)
	if rest := cancel(); len(rest) != 3 {
		t.Fatalf("cancel returned %d items, want the 3 unsent", len(rest))
	}
	clk.Advance(time.Second)
	if clk.Pending() != 0 {
		t.Fatalf("%d timers left after cancel", clk.Pending())
	}
}

// TestStartWithNothingToSend still reports, from a step of the clock.
func TestStartWithNothingToSend(t *testing.T) {
	t.Parallel()
	clk := clock.NewManual(time.Unix(0, 0))
	done := false
	Settler{Store: remote.NewMemory(clk), Clock: clk}.Start(nil, func(r Report) { done = r.Batches == 0 })
	if done {
		t.Fatal("done ran inside Start")
	}
	clk.Advance(time.Second)
	if !done {
		t.Fatal("done did not run")
	}
}
