package reconcile

import (
	"sync"

	"github.com/leasehold/leasehold/remote"
)

// Queue holds settlements (returns and debits) waiting for the store: what
// a limiter could not send at once, or chose to batch. It is safe for
// concurrent use; the zero value is an empty queue with the default bounds.
type Queue struct {
	// Flush is the length at which Add reports that the queue should be
	// sent early. The default is 4096.
	Flush int
	mu    struct {
		sync.Mutex
		items []Item
	}
}

// maxReturnsFactor bounds the queue while the store is down: past
// Flush·maxReturnsFactor items, returns are forgotten (which only
// under-uses the limit) but debits are kept, since forgetting them would
// over-admit.
const maxReturnsFactor = 16

func (q *Queue) flushAt() int {
	if q.Flush <= 0 {
		return 4096
	}
	return q.Flush
}

// Add keeps items and reports whether the queue has reached its flush
// length.
func (q *Queue) Add(items ...Item) (full bool) {
	if len(items) == 0 {
		return false
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	q.mu.items = append(q.mu.items, items...)
	return len(q.mu.items) >= q.flushAt()
}

// Requeue keeps items the store could not take, within the queue's bound
// for returns.
func (q *Queue) Requeue(items []Item) {
	if len(items) == 0 {
		return
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	for _, it := range items {
		if it.Op == remote.OpReturn && len(q.mu.items) >= maxReturnsFactor*q.flushAt() {
			continue
		}
		q.mu.items = append(q.mu.items, it)
	}
}

// Take empties the queue and returns what it held.
func (q *Queue) Take() []Item {
	q.mu.Lock()
	defer q.mu.Unlock()
	items := q.mu.items
	q.mu.items = nil
	return items
}

// Len returns how many items are waiting.
func (q *Queue) Len() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.mu.items)
}
