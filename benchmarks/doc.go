// Package benchmarks compares leasehold's hybrid limiter, side by side in
// one run, with golang.org/x/time/rate (local only, not shared) and
// github.com/go-redis/redis_rate (one Redis round trip per decision). It is
// its own module so that the competitors stay out of leasehold's go.mod.
// Run it with `make bench`, or `go test -bench . -benchmem` here; the Redis
// benchmarks start a real redis-server (or skip without one).
package benchmarks
