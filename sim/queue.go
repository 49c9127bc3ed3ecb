package main

import (
	"container/heap"
	"time"
)

// dueQueue orders work in flight (charges to settle, slots to release)
// by when it ends.
type dueQueue[T interface{ due() time.Duration }] []T

func (q dueQueue[T]) Len() int           { return len(q) }
func (q dueQueue[T]) Less(i, j int) bool { return q[i].due() < q[j].due() }
func (q dueQueue[T]) Swap(i, j int)      { q[i], q[j] = q[j], q[i] }
func (q *dueQueue[T]) Push(x any)        { *q = append(*q, x.(T)) }
func (q *dueQueue[T]) Pop() any {
	old := *q
	x := old[len(old)-1]
	*q = old[:len(old)-1]
	return x
}

// push adds x.
func (q *dueQueue[T]) push(x T) { heap.Push(q, x) }

// pop removes and returns the earliest item due by now, if any.
func (q *dueQueue[T]) pop(now time.Duration) (T, bool) {
	if len(*q) == 0 || (*q)[0].due() > now {
		var zero T
		return zero, false
	}
	return heap.Pop(q).(T), true
}
