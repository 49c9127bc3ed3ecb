package remote

import (
	"context"
	"sync"

	"github.com/leasehold/leasehold/clock"
	"github.com/leasehold/leasehold/internal/exact"
)

// MemoryStore is a Store held in process memory, with the same integer
// arithmetic as the Redis script over a clock.Clock (microseconds of
// c.Now()). It serves the simulator, tests and single-process deployments.
// Buckets expire like Redis keys, after time-to-full plus a margin.
//
// A MemoryStore is safe for concurrent use. The zero value is not usable;
// call NewMemory.
type MemoryStore struct {
	ops
	clk      clock.Clock
	fleet    memFleet
	records  memRecords // a tier's pools and region records
	regions  memRegions
	policies memPolicies
	mu       struct {
		sync.Mutex
		buckets map[string]memBucket
		writes  int // since the last expiry sweep
		live    int // buckets left by the last expiry sweep
	}
}

type memBucket struct {
	st       state
	sh       *shapeState // set instead of st for a shaped bucket
	deadline micros      // the bucket is gone at or after it
}

var _ Store = (*MemoryStore)(nil)

// NewMemory returns an empty MemoryStore reading time from c.
func NewMemory(c clock.Clock) *MemoryStore {
	if c == nil {
		c = clock.Real()
	}
	s := &MemoryStore{clk: c}
	s.ops = ops{do: s.do, grant: s.grantCall}
	s.mu.buckets = make(map[string]memBucket)
	return s
}

// Batch implements Store.
func (s *MemoryStore) Batch(ctx context.Context, op Op, rs []Request) []Reply {
	out := make([]Reply, len(rs))
	for i, r := range rs {
		out[i].Result, out[i].Err = s.do(ctx, op, r)
	}
	return out
}

// live returns how many buckets are live, for tests.
func (s *MemoryStore) live() int {
	now := micros(s.clk.Now().UnixMicro())
	s.mu.Lock()
	defer s.mu.Unlock()
	s.expireLocked(now)
	return len(s.mu.buckets)
}

func (s *MemoryStore) do(ctx context.Context, op Op, r Request) (Result, error) {
	m, err := validate(op, &r)
	if err != nil {
		return Result{}, err
	}
	if err := ctx.Err(); err != nil {
		return Result{}, err
	}
	var ls []shapeLimit
	if r.shaped() {
		if ls, err = validateShape(op, &r); err != nil {
			return Result{}, err
		}
	}
	return s.run(op, &r, m, ls), nil
}

// run applies a validated request (ls: a shaped request's limits).
func (s *MemoryStore) run(op Op, r *Request, m exact.Micros, ls []shapeLimit) Result {
	key := bucketKey(r)
	now := micros(s.clk.Now().UnixMicro())
	s.mu.Lock()
	defer s.mu.Unlock()
	b, ok := s.mu.buckets[key]
	if ok && now >= b.deadline {
		ok = false
	}
	var res Result
	if ls != nil {
		st := fromPlain(b.st)
		if b.sh != nil {
			st = *b.sh
		}
		st, res = applyShape(st.clone(), ok, op, r, ls, now)
		b = memBucket{sh: &st}
	} else {
		st := b.st
		if b.sh != nil {
			st = b.sh.toPlain(now)
		}
		st, res = apply(st, ok, op, r, m, now)
		b = memBucket{st: st}
	}
	b.deadline = now.plus(ttl(res.ResetAfter).Microseconds())
	s.mu.buckets[key] = b
	if s.mu.writes++; s.mu.writes >= max(4096, s.mu.live) {
		s.expireLocked(now)
	}
	return res
}

// expireLocked drops expired buckets. It runs after as many writes as the
// last sweep left buckets, so its cost is amortized O(1) per write and the
// map holds at most about twice the live set.
func (s *MemoryStore) expireLocked(now micros) {
	s.mu.writes = 0
	for k, b := range s.mu.buckets {
		if now >= b.deadline {
			delete(s.mu.buckets, k)
		}
	}
	s.mu.live = len(s.mu.buckets)
}
