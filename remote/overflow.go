package remote

import (
	"context"
	"runtime"
	"sync"
	"sync/atomic"

	"github.com/leasehold/leasehold/internal/redisopts"
	"github.com/redis/go-redis/v9"
)

// pipeMode says which calls a RedisStore sends through the client's
// autopipeliner (see WithAutoPipeline).
type pipeMode uint8

const (
	// pipeOverflow pipelines the calls a node's pool cannot carry at once.
	pipeOverflow pipeMode = iota
	// pipeAlways pipelines every call.
	pipeAlways
	// pipeNever sends every call on a pooled connection.
	pipeNever
)

// overflow routes to the client's autopipeliner the calls beyond what a
// node's connection pool carries at once: those would wait for a
// connection, while a pipeline of them shares one round trip. It counts
// the calls in flight per node, since go-redis keeps a pool per node on
// Cluster and per shard on Ring.
type overflow struct {
	c redis.UniversalClient
	// limit is a node's pool size.
	limit int64
	// nodeFor names the node a key's call goes to; nil for a client with
	// one pool, whose calls all count in one.
	nodeFor func(ctx context.Context, key string) (*redis.Client, error)
	one     atomic.Int64
	// nodes maps a node's *redis.Client to its *atomic.Int64. A node
	// replaced after a failover leaves its counter behind, at zero.
	nodes sync.Map
	ap    atomic.Pointer[redis.AutoPipeliner]
}

func newOverflow(c redis.UniversalClient) *overflow {
	o := &overflow{c: c, limit: int64(poolSize(c))}
	switch c := c.(type) {
	case *redis.ClusterClient:
		o.nodeFor = c.MasterForKey
	case *redis.Ring:
		o.nodeFor = func(_ context.Context, key string) (*redis.Client, error) { return c.GetShardClientForKey(key) }
	}
	return o
}

// enter counts a call on key's node and returns its node's counter, to
// give to leave, and the pipeliner to send it through when the node's pool
// is already full (nil: send it on the pool).
func (o *overflow) enter(ctx context.Context, key string) (*atomic.Int64, *redis.AutoPipeliner) {
	n := o.counter(ctx, key)
	if n.Add(1) <= o.limit {
		return n, nil
	}
	return n, o.pipeliner()
}

// leave ends a call counted by enter.
func (o *overflow) leave(n *atomic.Int64) { n.Add(-1) }

// counter is the count of calls in flight on key's node. A node the client
// cannot name (its slot map not loaded) counts with every such call.
func (o *overflow) counter(ctx context.Context, key string) *atomic.Int64 {
	if o.nodeFor == nil {
		return &o.one
	}
	node, err := o.nodeFor(ctx, key)
	if err != nil {
		return &o.one
	}
	if n, ok := o.nodes.Load(node); ok {
		return n.(*atomic.Int64)
	}
	n, _ := o.nodes.LoadOrStore(node, new(atomic.Int64))
	return n.(*atomic.Int64)
}

// pipeliner is the client's autopipeliner, built at the first call that
// overflows a pool; nil when the client cannot build one (a closed client,
// a bad AutoPipelineOptions), whose calls then take the pool.
func (o *overflow) pipeliner() *redis.AutoPipeliner {
	if ap := o.ap.Load(); ap != nil {
		return ap
	}
	ap, err := o.c.AsyncAutoPipeline() // go-redis builds it once per client
	if err != nil {
		return nil
	}
	o.ap.Store(ap)
	return ap
}

// poolSize is the connections c's pool (a node's, on Cluster) holds at
// most: go-redis's default of 10 per CPU when unset.
func poolSize(c redis.UniversalClient) int {
	if _, n, _ := redisopts.Of(c); n > 0 {
		return n
	}
	return 10 * runtime.GOMAXPROCS(0)
}
