// Package allocs counts what a function allocates, for tests that bound
// it.
package allocs

import (
	"math"
	"testing"
)

// Fewest returns the fewest allocations a call of f makes on average over
// batches of runs calls, each batch counted by testing.AllocsPerRun (which
// makes one more call first, to warm up). f gets each call's index, from
// 0 to batches·(runs+1)−1, so that every call may take input of its own.
//
// AllocsPerRun counts every allocation the process makes while a batch
// runs: another goroutine's (an earlier test's limiter still settling at
// its Close, on a loaded machine) lands in the batch it runs beside and
// can add one to the average. The fewest of several batches is f's own.
func Fewest(batches, runs int, f func(i int)) float64 {
	fewest := math.Inf(1)
	i := 0
	for range batches {
		fewest = min(fewest, testing.AllocsPerRun(runs, func() {
			f(i)
			i++
		}))
	}
	return fewest
}
