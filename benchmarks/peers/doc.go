// Package peers measures leasehold beside gubernator, the Go peer that
// people pick for a distributed limit, on the same workloads in one run:
// 4 gubernator daemons in this process on loopback (each decision a gRPC
// GetRateLimits to one of them), with gubernator's default behaviour
// (forwarded to the key's owner) and with GLOBAL (answered from the local
// cache, hits synced every 100 ms), beside 4 leasehold limiters on one
// real Redis and go-redis/redis_rate.
//
// It is a module of its own: gubernator v2.13.0 brings etcd's and
// Kubernetes' clients, 1 m 40 s of compiling on 2 cores, which `make test`
// does not pay. `make bench-peers` runs it and writes
// benchmarks/results/peers.txt.
package peers
