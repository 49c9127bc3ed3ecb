// Package spawn counts the goroutines a process starts, for tests and
// benchmarks that hold code to starting none per operation.
package spawn

import "runtime/metrics"

// Count is how many goroutines this process has started (the runtime's
// count may lag by a few).
func Count() uint64 {
	s := []metrics.Sample{{Name: "/sched/goroutines-created:goroutines"}}
	metrics.Read(s)
	return s[0].Value.Uint64()
}
