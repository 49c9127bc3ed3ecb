package tiered

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/leasehold/leasehold/internal/hooks"
)

// records runs pool and region operations atomically in the region's own
// store, which is where a region's pools live: every process of the
// region shares them.
type records interface {
	pool(ctx context.Context, key string, op poolOp) (poolReply, error)
	region(ctx context.Context, key string, op regionOp) (regionReply, error)
}

// regionTTL is how long a region record outlives its last write.
const regionTTL = 10 * time.Minute

// recordsOf returns the records of the region's store: Lua on the client
// of a store that runs on go-redis (a *remote.RedisStore), or the
// MemoryStore's own records.
func recordsOf(store Region) (records, error) {
	if c, ok := store.(interface{ Client() redis.UniversalClient }); ok {
		return redisRecords{store: store, c: c.Client()}, nil
	}
	if ok, _ := hooks.UpdateRecord(context.Background(), store, "", 0, nil); ok {
		return memoryRecords{store: store}, nil
	}
	return nil, fmt.Errorf("%w: a region's store must be a *remote.RedisStore or a *remote.MemoryStore, not %T",
		errConfig, store)
}

type redisRecords struct {
	store any
	c     redis.UniversalClient
}

func (r redisRecords) run(ctx context.Context, s *redis.Script, key, op string, ttl time.Duration, args []any) ([]int64, error) {
	argv := append([]any{op, ttl.Milliseconds()}, args...)
	v, err := s.Run(ctx, r.c, []string{key}, argv...).Int64Slice()
	if err != nil {
		return nil, hooks.StoreFailed(r.store, key, err)
	}
	return v, nil
}

func (r redisRecords) pool(ctx context.Context, key string, op poolOp) (poolReply, error) {
	v, err := r.run(ctx, poolScript, key, op.name(), poolTTL, op.encode())
	if err != nil {
		return poolReply{}, err
	}
	return parsePoolReply(key, v)
}

func (r redisRecords) region(ctx context.Context, key string, op regionOp) (regionReply, error) {
	v, err := r.run(ctx, regionScript, key, op.name(), regionTTL, op.encode())
	if err != nil {
		return regionReply{}, err
	}
	return parseRegionReply(key, v)
}

type memoryRecords struct{ store any }

func (m memoryRecords) pool(ctx context.Context, key string, op poolOp) (poolReply, error) {
	var rep poolReply
	_, err := hooks.UpdateRecord(ctx, m.store, key, poolTTL, func(old any, now int64) (any, bool) {
		st, _ := old.(poolState)
		st, rep = applyPool(st, op, micros(now))
		_, read := op.(poolRead)
		return st, !read
	})
	return rep, err
}

func (m memoryRecords) region(ctx context.Context, key string, op regionOp) (regionReply, error) {
	var rep regionReply
	_, err := hooks.UpdateRecord(ctx, m.store, key, regionTTL, func(old any, now int64) (any, bool) {
		st, _ := old.(regionState)
		st, rep = applyRegion(st, op, micros(now))
		return st, true
	})
	return rep, err
}
