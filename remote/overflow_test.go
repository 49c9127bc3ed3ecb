package remote

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leasehold/leasehold/internal/keys"
	"github.com/leasehold/leasehold/internal/testkit/poll"
	"github.com/leasehold/leasehold/internal/testkit/redistest"
	"github.com/leasehold/leasehold/local"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// sendCounter counts the script calls a client sends alone and in
// pipelines (not the commands that set up a connection).
type sendCounter struct{ alone, piped atomic.Int64 }

func (h *sendCounter) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *sendCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if isScript(cmd) {
			h.alone.Add(1)
		}
		return next(ctx, cmd)
	}
}

func (h *sendCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, cmd := range cmds {
			if isScript(cmd) {
				h.piped.Add(1)
			}
		}
		return next(ctx, cmds)
	}
}

func isScript(cmd redis.Cmder) bool { return cmd.Name() == "evalsha" || cmd.Name() == "eval" }

// TestPipelineOverflow: on real Redis, with the server stopped so that
// calls pile up, the calls beyond the client's pool size go out through
// the autopipeliner and the others on pooled connections; every call gets
// its right answer, and the store admits no more than the bucket holds.
// With WithAutoPipeline(false) every call takes the pool, and a lone call
// never goes through the pipeliner.
func TestPipelineOverflow(t *testing.T) {
	const pool, calls = 2, 8
	lim := local.Limit{Rate: 1, Period: time.Hour, Burst: 5}
	for _, tc := range []struct {
		name     string
		opts     []RedisOption
		overflow bool
	}{
		{"default", nil, true},
		{"pool only", []RedisOption{WithAutoPipeline(false)}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := redistest.NewServer(t)
			c := srv.Client(t, func(o *redis.Options) { o.PoolSize = pool })
			s := NewRedis(c, tc.opts...)
			ctx := context.Background()
			req := Request{Policy: "overflow", Key: "k", Limit: lim, N: 1}
			_, err := s.Lease(ctx, req) // scripts loaded, a connection open
			require.NoError(t, err)
			var h sendCounter
			c.AddHook(&h)
			_, err = s.Lease(ctx, req) // a lone call
			require.NoError(t, err)
			require.Zero(t, h.piped.Load(), "a lone call went through the pipeliner")

			require.NoError(t, srv.Pause())
			var wg sync.WaitGroup
			res := make([]Result, calls)
			errs := make([]error, calls)
			for i := range calls {
				wg.Go(func() {
					cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
					defer cancel()
					res[i], errs[i] = s.Lease(cctx, req)
				})
			}
			if tc.overflow {
				poll.Until(t, "calls in flight", 5*time.Second, func() bool { return s.over.inFlight() == calls })
			} else {
				// Nothing counts them without the option: wait until
				// the pool's connections are taken and the rest queue.
				poll.Until(t, "calls on the pool", 5*time.Second, func() bool { return c.PoolStats().TotalConns == pool && h.alone.Load() == 1+calls })
			}
			require.NoError(t, srv.Resume())
			wg.Wait()
			granted := int64(0)
			for i := range calls {
				require.NoError(t, errs[i])
				granted += res[i].Granted
			}
			require.Equal(t, int64(5-2), granted, "what was left of the burst, to 3 of 8 callers")
			// The pipeliner may send a batch of one as a lone command.
			piped, alone := h.piped.Load(), h.alone.Load()
			t.Logf("%d calls sent in pipelines, %d alone", piped, alone)
			require.Equal(t, int64(1+calls), piped+alone, "every call sent once")
			if tc.overflow {
				require.GreaterOrEqual(t, piped, int64(2), "calls sent in pipelines")
			} else {
				require.Zero(t, piped, "calls sent in pipelines")
			}
		})
	}
}

// TestPipelineOverflowPerNode: on the real cluster, go-redis keeps a pool
// per node, so calls count against their own node's pool: with a pool of 2
// and every master stopped, 2 calls on each of the 3 masters (6 in flight)
// all take pooled connections, and a third on one master overflows to the
// pipeliner. Counted over all nodes, the third call would have.
func TestPipelineOverflowPerNode(t *testing.T) {
	const pool = 2
	cl := redistest.SharedCluster(t)
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs(), ContextTimeoutEnabled: true, PoolSize: pool})
	t.Cleanup(func() { _ = cc.Close() })
	s := NewRedis(cc)
	ctx := context.Background()
	lim := local.Limit{Rate: 1, Period: time.Hour, Burst: 100}

	// A key on each master, each master's server, and a call on each key
	// (its scripts loaded, its connection open).
	var reqs []Request
	var masters []*redistest.Server
	seen := map[string]bool{}
	for i := 0; len(reqs) < 3; i++ {
		key := fmt.Sprintf("node-%d", i)
		req := Request{Policy: "overflow-nodes", Key: key, Limit: lim, N: 1}
		node, err := cc.MasterForKey(ctx, keys.Bucket(DefaultPrefix, req.Policy, "", key))
		require.NoError(t, err)
		if seen[node.Options().Addr] {
			continue
		}
		seen[node.Options().Addr] = true
		srv, err := cl.MasterOf(ctx, keys.Bucket(DefaultPrefix, req.Policy, "", key))
		require.NoError(t, err)
		require.Equal(t, node.Options().Addr, srv.Addr)
		_, err = s.Lease(ctx, req)
		require.NoError(t, err)
		reqs = append(reqs, req)
		masters = append(masters, srv)
	}

	// Stopped well within the cluster's node timeout: no failover.
	for _, m := range masters {
		require.NoError(t, m.Pause())
	}
	resumed := false
	resume := func() {
		if !resumed {
			resumed = true
			for _, m := range masters {
				require.NoError(t, m.Resume())
			}
		}
	}
	defer resume()
	var wg sync.WaitGroup
	var failed atomic.Int64
	call := func(req Request) {
		wg.Go(func() {
			cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			if _, err := s.Lease(cctx, req); err != nil {
				failed.Add(1)
			}
		})
	}
	for _, req := range reqs {
		call(req)
		call(req)
	}
	// A call overflows when its node's count passes the pool, and only
	// then builds the pipeliner: the counts say what each call chose, the
	// pipeliner appears a moment later.
	poll.Until(t, "2 calls in flight on each master", 5*time.Second, func() bool { return s.over.inFlight() == 6 })
	require.Equal(t, []int64{pool, pool, pool}, s.over.perNode(), "calls counted per node")
	call(reqs[0])
	poll.Until(t, "a third call on one master", 5*time.Second, func() bool { return s.over.inFlight() == 7 })
	require.ElementsMatch(t, []int64{pool + 1, pool, pool}, s.over.perNode(), "calls counted per node")
	poll.Until(t, "the third call on a node with a pool of 2 overflows", 5*time.Second, func() bool { return s.over.ap.Load() != nil })
	resume()
	wg.Wait()
	require.Zero(t, failed.Load(), "calls failed")
}

// inFlight is how many calls are counted on all nodes.
func (o *overflow) inFlight() int64 {
	total := o.one.Load()
	for _, n := range o.perNode() {
		total += n
	}
	return total
}

// perNode is the calls counted on each node the client has named, in no
// order.
func (o *overflow) perNode() []int64 {
	var out []int64
	o.nodes.Range(func(_, n any) bool {
		out = append(out, n.(*atomic.Int64).Load())
		return true
	})
	return out
}
