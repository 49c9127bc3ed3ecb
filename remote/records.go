package remote

import (
	"context"
	"sync"
	"time"

	"github.com/leasehold/leasehold/internal/hooks"
)

// Records that packages above keep in a store (a tier's pools and region
// record) reach it through hooks: the store runs their code with its own
// error handling (Redis) or under its own lock and clock (memory), and
// knows nothing of what they hold.
func init() {
	hooks.StoreFailed = func(store any, key string, err error) error {
		if s, ok := store.(*RedisStore); ok {
			return s.failed(key, err)
		}
		return classify(key, err)
	}
	hooks.UpdateRecord = func(ctx context.Context, store any, key string, ttl time.Duration, update func(old any, now int64) (any, bool)) (bool, error) {
		s, ok := store.(*MemoryStore)
		if !ok || update == nil {
			return ok, nil
		}
		if err := ctx.Err(); err != nil {
			return true, err
		}
		s.records.update(key, s.clk.Now().UnixMicro(), ttl, update)
		return true, nil
	}
}

// memRecords holds the records of packages above, each with a deadline.
type memRecords struct {
	mu sync.Mutex
	m  map[string]memRecord
}

type memRecord struct {
	v        any
	deadline int64 // µs
}

func (r *memRecords) update(key string, now int64, ttl time.Duration, update func(old any, now int64) (any, bool)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.m == nil {
		r.m = map[string]memRecord{}
	}
	cur, ok := r.m[key]
	if ok && now >= cur.deadline {
		cur = memRecord{}
		delete(r.m, key)
	}
	if v, write := update(cur.v, now); write {
		r.m[key] = memRecord{v: v, deadline: now + ttl.Microseconds()}
	}
}
