// Package redisopts reads the options of go-redis's client types that
// leasehold's promises depend on.
package redisopts

import "github.com/redis/go-redis/v9"

// Of reads c's options: whether deadlines reach in-flight reads
// (ContextTimeoutEnabled; without it go-redis bounds a read by
// ReadTimeout, not by the call's context) and the pool size (per node on
// Cluster, per shard on Ring). known is false for a client type go-redis
// does not provide.
func Of(c redis.UniversalClient) (contextTimeout bool, pool int, known bool) {
	switch c := c.(type) {
	case *redis.Client:
		return c.Options().ContextTimeoutEnabled, c.Options().PoolSize, true
	case *redis.ClusterClient:
		return c.Options().ContextTimeoutEnabled, c.Options().PoolSize, true
	case *redis.Ring:
		return c.Options().ContextTimeoutEnabled, c.Options().PoolSize, true
	}
	return false, 0, false
}
