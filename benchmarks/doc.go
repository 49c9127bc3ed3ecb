// Package benchmarks compares leasehold's hybrid limiter, side by side in
// one run on one real Redis, with github.com/go-redis/redis_rate (one Redis
// round trip per decision) and golang.org/x/time/rate (local only, shared
// by nothing: the floor). It is its own module so that the competitors stay
// out of leasehold's go.mod.
//
// BenchmarkLimiters runs each implementation on a hot key, 1 024 uniform
// keys and 100 000 Zipf (s = 1.1) keys at 10/s each, with 1, 16 and 256
// goroutines; BenchmarkAtLimit runs one key at its limit (2 000/s, burst
// 200) from 4 OS processes of 16 goroutines; BenchmarkColdDecisions runs
// hybrid and redis_rate on keys the process has not seen, so that every
// decision needs the store, beside BenchmarkEvalShaFloor, what go-redis
// alone allocates per EVALSHA. Each reports, besides ns/op
// and allocs: store calls per 1 000 decisions (commands on the wire,
// counted by a go-redis hook: leases, returns, heartbeats, policy reads),
// Redis CPU µs per 1 000 decisions (INFO cpu) and, where scripts ran, µs
// Redis spent inside each script call (INFO commandstats), p50/p99/p99.9 decision
// latency (one decision in 16 timed), the share admitted, and heap bytes
// per tracked key.
//
// Run it with `make bench` from the repository root, which writes
// results/latest.txt in benchstat format with the machine it ran on; the
// Redis benchmarks start their own redis-server (or skip without one).
package benchmarks
