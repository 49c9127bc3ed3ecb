package reconcile

import (
	"testing"

	"github.com/leasehold/leasehold/remote"
)

func TestQueueFlushAndBound(t *testing.T) {
	t.Parallel()
	q := Queue{Flush: 4}
	ret := Item{Op: remote.OpReturn, Req: remote.Request{N: 1}}
	debit := Item{Op: remote.OpDebit, Req: remote.Request{N: 1}}
	if full := q.Add(ret, ret, ret); full {
		t.Fatal("Add of 3 into a queue flushing at 4 reported full")
	}
	if full := q.Add(ret); !full {
		t.Fatal("Add reaching 4 did not report full")
	}
	if got := len(q.Take()); got != 4 || q.Len() != 0 {
		t.Fatalf("Take = %d items, Len after = %d; want 4 and 0", got, q.Len())
	}
	// While the store is down the queue is bounded: returns past the
	// bound are forgotten, debits never are.
	many := make([]Item, 0, 100)
	for i := 0; i < 100; i++ {
		many = append(many, ret)
	}
	q.Requeue(many)
	q.Requeue([]Item{debit, debit})
	items := q.Take()
	var rets, debits int
	for _, it := range items {
		if it.Op == remote.OpDebit {
			debits++
		} else {
			rets++
		}
	}
	if rets != maxReturnsFactor*4 || debits != 2 {
		t.Fatalf("after requeueing 100 returns and 2 debits: %d returns, %d debits; want %d and 2", rets, debits, maxReturnsFactor*4)
	}
}
