package inflight

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/leasehold/leasehold/internal/errs"
	"github.com/leasehold/leasehold/internal/hooks"
	"github.com/leasehold/leasehold/internal/keys"
	"github.com/leasehold/leasehold/remote"
)

// The store's side of a concurrency limit. A key has a limit of slots;
// each holder holds some of them under a term counted by the store's
// clock, renewed by its next call. A call names the holding the holder
// wants after it (an absolute count, so that a call repeated after a lost
// reply does no harm): less than it holds gives the rest back; more gets
// what the other live holders leave free. At every instant the live
// holdings sum to at most the limit, and the slots of a holder that stops
// calling (crashed, cut off) come back when its term ends, never before.
//
// The key also keeps the newest policy version that set its limit: a call
// under an older version is decided by the newer limit and told of the
// version, so that a process that has not yet read a new policy cannot
// hold more than it allows.

// slotRequest sets how many of a key's slots a holder holds.
type slotRequest struct {
	key, holder string
	// hold is the holding wanted after the call, 0 to give every slot
	// back. Above what the holder holds it gets what the others leave
	// free under the limit, at most hold; below, it holds hold.
	hold int64
	// limit is the most slots the live holders hold together under
	// version; a holding above a lowered limit is kept, never raised.
	limit   int64
	version uint64
	term    time.Duration
}

// slotReply is the holder's holding after a call.
type slotReply struct {
	// held is the holder's slots now; inUse what every live holder
	// holds, this one included.
	held, inUse int64
	// waiting is what the other live holders asked for beyond what they
	// got: slots this holder holds and does not use are better given
	// back.
	waiting int64
	// version and limit are the policy version and limit the key is
	// under: the request's, or a newer one another process set.
	version uint64
	limit   int64
}

// backend keeps slots and policy records in a store: Lua on the client of
// a *remote.RedisStore, or records of a *remote.MemoryStore.
type backend interface {
	slots(ctx context.Context, r slotRequest) (slotReply, error)
	// policy returns the key's policy record, after storing rec in it if
	// rec's version is newer (rec "" only reads); "" when there is none.
	policy(ctx context.Context, key, rec string, version uint64) (string, error)
}

// backendOf returns the backend of store.
func backendOf(store remote.Store) (backend, error) {
	if b, ok := store.(backend); ok { // tests' stores
		return b, nil
	}
	if c, ok := store.(interface{ Client() redis.UniversalClient }); ok {
		return redisBackend{store: store, c: c.Client()}, nil
	}
	if ok, _ := hooks.UpdateRecord(context.Background(), store, "", 0, nil); ok {
		return memoryBackend{store: store}, nil
	}
	return nil, errs.Errorf("inflight", "%w: store %T keeps no slots (use remote.NewRedis or remote.NewMemory)", ErrInvalidOption, store)
}

// policyTTL is how long a policy record lives after it was last set.
const policyTTL = 30 * 24 * time.Hour

type redisBackend struct {
	store any
	c     redis.UniversalClient
}

func (b redisBackend) slots(ctx context.Context, r slotRequest) (slotReply, error) {
	v, err := slotsScript.Run(ctx, b.c, []string{r.key}, r.holder, r.hold, r.limit, r.term.Microseconds(), r.version).Int64Slice()
	if err != nil {
		return slotReply{}, hooks.StoreFailed(b.store, r.key, err)
	}
	if len(v) != 5 || v[3] < 0 || v[4] < 1 {
		return slotReply{}, errs.Errorf("inflight", "slots %q: %w: reply %v", r.key, remote.ErrCorruptState, v)
	}
	return slotReply{held: v[0], inUse: v[1], waiting: v[2], version: uint64(v[3]), limit: v[4]}, nil
}

func (b redisBackend) policy(ctx context.Context, key, rec string, version uint64) (string, error) {
	v, err := policyScript.Run(ctx, b.c, []string{key}, rec, version, policyTTL.Milliseconds()).Text()
	if err != nil {
		return "", hooks.StoreFailed(b.store, key, err)
	}
	return v, nil
}

type memoryBackend struct{ store any }

// memSlots is a key's slots in a MemoryStore: holder → holding, and the
// newest policy version and its limit.
type memSlots struct {
	holders map[string]memHolding
	version uint64
	limit   int64
}

type memHolding struct{ count, want, exp int64 }

func (m memoryBackend) slots(ctx context.Context, r slotRequest) (slotReply, error) {
	var rep slotReply
	_, err := hooks.UpdateRecord(ctx, m.store, r.key, r.term+time.Second, func(old any, now int64) (any, bool) {
		s, _ := old.(*memSlots)
		if s == nil {
			s = &memSlots{holders: map[string]memHolding{}}
		}
		rep = slotsFor(s, now, r)
		return s, true
	})
	return rep, err
}

// slotsFor is slotsLua (scripts.go) on s at now (µs).
func slotsFor(s *memSlots, now int64, r slotRequest) slotReply {
	if r.version > s.version || s.limit == 0 {
		s.version, s.limit = r.version, r.limit
	}
	var others, waiting, mine int64
	for id, h := range s.holders {
		switch {
		case h.exp <= now:
			delete(s.holders, id)
		case id == r.holder:
			mine = h.count
		default:
			others += h.count
			waiting += max(h.want-h.count, 0)
		}
	}
	held := r.hold
	if r.hold > mine {
		held = max(mine, min(r.hold, s.limit-others))
	}
	if held > 0 || r.hold > 0 {
		s.holders[r.holder] = memHolding{count: held, want: r.hold, exp: now + r.term.Microseconds()}
	} else {
		delete(s.holders, r.holder)
	}
	return slotReply{held: held, inUse: others + held, waiting: waiting, version: s.version, limit: s.limit}
}

func (m memoryBackend) policy(ctx context.Context, key, rec string, version uint64) (string, error) {
	var cur string
	_, err := hooks.UpdateRecord(ctx, m.store, key, policyTTL, func(old any, _ int64) (any, bool) {
		cur, _ = old.(string)
		if rec == "" {
			return old, false
		}
		if v, err := recordVersion(cur); cur != "" && err == nil && v >= version {
			return old, false
		}
		cur = rec
		return rec, true
	})
	return cur, err
}

// recordVersion reads the version that starts a policy record.
func recordVersion(rec string) (uint64, error) {
	head, _, _ := strings.Cut(rec, " ")
	v, err := strconv.ParseUint(head, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("%w: policy record %.64q", remote.ErrCorruptState, rec)
	}
	return v, nil
}

// Holders is a key's slots as the store keeps them, for operators' tools.
type Holders struct {
	// Version and Limit are the newest policy version that set the key's
	// limit, and that limit; 0 when no call has set one.
	Version uint64
	Limit   int64
	// Held lists the live holders, by name.
	Held []Holding
}

// Holding is what one process holds of a key.
type Holding struct {
	Holder string
	// Slots is what it holds; Wants what it last asked for.
	Slots, Wants int64
	// TermLeft is how long its slots stay counted if it makes no call.
	TermLeft time.Duration
}

// ReadSlots returns the slots of key under tier ("" for none) of the
// in-flight limit policy, as kept in a *remote.RedisStore under prefix (""
// for remote.DefaultPrefix).
func ReadSlots(ctx context.Context, store remote.Store, prefix, policy, tier, key string) (Holders, error) {
	if prefix == "" {
		prefix = remote.DefaultPrefix
	}
	if err := keys.Validate(prefix, policy, key); err != nil {
		return Holders{}, errs.Errorf("inflight", "%w: %w", ErrInvalidOption, err)
	}
	c, ok := store.(interface{ Client() redis.UniversalClient })
	if !ok {
		return Holders{}, errs.Errorf("inflight", "%w: ReadSlots reads a *remote.RedisStore, not %T", ErrInvalidOption, store)
	}
	k := keys.Slots(prefix, policy, tier, key)
	var all *redis.MapStringStringCmd
	var now *redis.TimeCmd
	// One node: TIME from the node that holds the key.
	if _, err := c.Client().Pipelined(ctx, func(p redis.Pipeliner) error {
		all, now = p.HGetAll(ctx, k), p.Time(ctx)
		return nil
	}); err != nil {
		return Holders{}, hooks.StoreFailed(store, k, err)
	}
	bad := func(what string) (Holders, error) {
		return Holders{}, errs.Errorf("inflight", "slots %q: %w: %s", k, remote.ErrCorruptState, what)
	}
	var h Holders
	nowMicros := now.Val().UnixMicro()
	for field, v := range all.Val() {
		if field == "#v" {
			if _, err := fmt.Sscanf(v, "%d %d", &h.Version, &h.Limit); err != nil {
				return bad("version " + v)
			}
			continue
		}
		var count, exp, want int64
		if _, err := fmt.Sscanf(v, "%d %d %d", &count, &exp, &want); err != nil {
			return bad("record " + v)
		}
		if exp > nowMicros {
			h.Held = append(h.Held, Holding{Holder: field, Slots: count, Wants: want, TermLeft: time.Duration(exp-nowMicros) * time.Microsecond})
		}
	}
	slices.SortFunc(h.Held, func(a, b Holding) int { return strings.Compare(a.Holder, b.Holder) })
	return h, nil
}
