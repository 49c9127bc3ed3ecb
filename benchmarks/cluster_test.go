package benchmarks

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/leasehold/leasehold/hybrid"
	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"github.com/leasehold/leasehold/remote"
	"github.com/redis/go-redis/v9"
)

// BenchmarkClusterOverflow runs the Zipf workload on the real 3-master,
// 3-replica cluster, where go-redis keeps a pool per node and the store
// counts calls against their own node's pool (TestPipelineOverflowPerNode
// holds that). The client keeps go-redis's default pool, 10 connections
// per CPU per node, so at 256 goroutines the cold calls outnumber a
// node's pool and the modes part: hybrid pipelining only what overflows a
// node's pool (the default), every call on the pool, every call through
// the autopipeliner, and redis_rate on the same client options. Besides
// ns/op and allocations each reports its store calls per 1 000 decisions
// (counted by hybrid; redis_rate makes one a decision) and its decision
// latency percentiles. Its rows are named cluster-X, apart from the
// standalone rows of BenchmarkLimiters; make bench-cluster writes them to
// results/cluster.txt.
func BenchmarkClusterOverflow(b *testing.B) {
	cl := redistest.SharedCluster(b)
	w := workloads[len(workloads)-1]
	if !w.zipf {
		b.Fatal("the last workload is not the Zipf one")
	}
	keys := keySet(w.keys)
	seq := w.sequence()
	modes := []struct {
		name  string
		store []remote.RedisOption
	}{
		{"cluster-hybrid", nil},
		{"cluster-hybrid+pool", []remote.RedisOption{remote.WithAutoPipeline(false)}},
		{"cluster-hybrid+autopipeline", []remote.RedisOption{remote.WithAutoPipeline(true)}},
	}
	for _, par := range []int{16, 256} {
		for _, m := range modes {
			b.Run(benchName(m.name, w, par), func(b *testing.B) {
				benchClusterHybrid(b, cl, w, keys, seq, par, m.store)
			})
		}
		b.Run(benchName("cluster-redis_rate", w, par), func(b *testing.B) {
			benchClusterRedisRate(b, cl, w, keys, seq, par)
		})
	}
}

// clusterClient is a client of cl with go-redis's default pool per node.
func clusterClient(b *testing.B, cl *redistest.Cluster) *redis.ClusterClient {
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs(), ContextTimeoutEnabled: true})
	b.Cleanup(func() { _ = cc.Close() })
	return cc
}

func benchClusterHybrid(b *testing.B, cl *redistest.Cluster, w workload, keys []string, seq []int32, par int, store []remote.RedisOption) {
	ctx := context.Background()
	name := "bench-cluster-" + time.Now().Format("150405.000000")
	lim, err := hybrid.New(remote.NewRedis(clusterClient(b, cl), store...), hybrid.Policy{Name: name, Limit: limit(w)},
		hybrid.WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		b.Fatal(err)
	}
	defer lim.Close(ctx)
	decide := func(i int32) bool { return lim.Allow(ctx, keys[i]) }
	warm(w.keys, decide)
	before := lim.Stats()
	res := drive(b, par, seq, decide)
	after := lim.Stats()
	res.report(b)
	b.ReportMetric(float64(after.StoreCalls-before.StoreCalls)/float64(b.N)*1000, "storecalls/1000")
	if errs := after.StoreErrors - before.StoreErrors; errs > 0 {
		b.Fatalf("%d store calls failed", errs)
	}
}

func benchClusterRedisRate(b *testing.B, cl *redistest.Cluster, w workload, keys []string, seq []int32, par int) {
	decide := redisRateDecide(clusterClient(b, cl), w, keys, "bench-cluster-rr-")
	warm(w.keys, decide)
	res := drive(b, par, seq, decide)
	res.report(b)
	b.ReportMetric(1000, "storecalls/1000")
}

// clusterFile is where make bench-cluster writes BenchmarkClusterOverflow's
// rows.
const clusterFile = "results/cluster.txt"

// TestClusterTable checks that docs/benchmarks.md's cluster table is the
// one results/cluster.txt gives; run it with UPDATE_README=1 after make
// bench-cluster to rewrite it.
func TestClusterTable(t *testing.T) { checkTable(t, "cluster", clusterFile, clusterTable) }

// clusterTable renders the cluster rows: the figures the modes differ in.
func clusterTable(config []string, rows []row) string {
	var b strings.Builder
	fmt.Fprintf(&b, "Measured with `make bench-cluster` (%s).\n\n", strings.Join(config, "; "))
	b.WriteString("| goroutines | impl | µs a decision | allocs/op | store calls /1000 | p50 | p99 | p99.9 |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|\n")
	for _, r := range rows {
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s | %s | %s |\n", r.goroutines, strings.TrimPrefix(r.impl, "cluster-"),
			strconv.FormatFloat(r.metrics["ns/op"]/1e3, 'f', 2, 64), num(r, "allocs/op"), num(r, "storecalls/1000"),
			dur(r, "p50-ns"), dur(r, "p99-ns"), dur(r, "p99.9-ns"))
	}
	return b.String()
}
