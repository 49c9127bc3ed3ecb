package remote

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/leasehold/leasehold/internal/errs"
	"github.com/leasehold/leasehold/internal/exact"
	"github.com/leasehold/leasehold/internal/keys"
)

// Concurrency limits. A key has Limit slots; each holder holds some of
// them under a term counted by the store's clock, renewed by its next
// call. A call names the holding the holder wants after it (an absolute
// count, so that a call repeated after a lost reply does no harm): less
// than it holds gives the rest back; more gets what the other live holders
// leave free. At every instant the live holdings sum to at most Limit, and
// the slots of a holder that stops calling (crashed, cut off) come back
// when its term ends, never before.

// Slotter is a store that keeps concurrency limits' slots. RedisStore and
// MemoryStore are Slotters.
type Slotter interface {
	// Slots sets the holder's holding of a key's slots and renews its
	// term.
	Slots(ctx context.Context, r SlotRequest) (SlotResult, error)
}

var (
	_ Slotter = (*RedisStore)(nil)
	_ Slotter = (*MemoryStore)(nil)
)

// SlotRequest sets how many of a key's slots a holder holds.
type SlotRequest struct {
	// Prefix, Policy, Tier and Key name the slots as they name a bucket.
	Prefix, Policy, Tier, Key string
	// Holder names the holding: 1 to 64 bytes of letters, digits and
	// "._:-", unique among the processes sharing the store.
	Holder string
	// Hold is the holding wanted after the call, 0 to give every slot
	// back. Above what the holder holds it gets what the others leave
	// free under Limit, at most Hold; below, it holds Hold.
	Hold int64
	// Limit is the most slots the live holders hold together, 1 to
	// 2^50. A holding above a lowered limit is kept, never raised.
	Limit int64
	// Term is how long the holding lasts from the call, 1 ms to 24 h.
	Term time.Duration
}

// SlotResult is the holder's holding after a Slots call.
type SlotResult struct {
	// Held is the holder's slots now.
	Held int64
	// InUse is what every live holder holds, this one included.
	InUse int64
	// Waiting is what the other live holders asked for beyond what they
	// got: slots this holder holds and does not use are better given back.
	Waiting int64
	// Now is the store's time at the call.
	Now time.Time
}

// ErrInvalidSlots reports a slot request out of range: a negative Hold, a
// Limit outside 1..2^50, a term outside 1 ms to 24 h, or a bad holder
// name.
var ErrInvalidSlots = errs.New("remote", "invalid slot request")

func validateSlots(r *SlotRequest) error {
	if err := validateKey(r.Prefix, r.Policy, r.Key); err != nil {
		return err
	}
	if r.Tier != "" {
		if err := keys.ValidateTier(r.Tier); err != nil {
			return err
		}
	}
	if err := validateHolder(r.Holder); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidSlots, err)
	}
	if r.Hold < 0 || r.Limit < 1 || r.Limit > exact.MaxBurst || r.Term < time.Millisecond || r.Term > 24*time.Hour {
		return errs.Errorf("remote", "slots %q: hold %d, limit %d, term %v: %w", r.Key, r.Hold, r.Limit, r.Term, ErrInvalidSlots)
	}
	return nil
}

// Slots implements Slotter.
func (s *RedisStore) Slots(ctx context.Context, r SlotRequest) (SlotResult, error) {
	if err := validateSlots(&r); err != nil {
		return SlotResult{}, err
	}
	key := keys.Slots(r.Prefix, r.Policy, r.Tier, r.Key)
	v, err := s.eval(ctx, slotsScript, []string{key}, []any{r.Holder, r.Hold, r.Limit, r.Term.Microseconds()})
	if err != nil {
		return SlotResult{}, s.failed(key, err)
	}
	xs, ok := v.([]any)
	if !ok || len(xs) != 5 {
		return SlotResult{}, errs.Errorf("remote", "slots %q: %w: reply %v", key, ErrCorruptState, v)
	}
	var n [5]int64
	for i, x := range xs {
		if n[i], err = toInt(x); err != nil {
			return SlotResult{}, errs.Errorf("remote", "slots %q: %w: reply %v", key, ErrCorruptState, v)
		}
	}
	return SlotResult{Held: n[0], InUse: n[1], Waiting: n[2], Now: time.Unix(n[3], n[4]*1000)}, nil
}

// memSlots is a MemoryStore's slots: key → holder → holding.
type memSlots struct {
	mu    sync.Mutex
	byKey map[string]map[string]memHolding
}

type memHolding struct {
	count, want int64
	exp         micros
}

// Slots implements Slotter.
func (s *MemoryStore) Slots(ctx context.Context, r SlotRequest) (SlotResult, error) {
	if err := validateSlots(&r); err != nil {
		return SlotResult{}, err
	}
	if err := ctx.Err(); err != nil {
		return SlotResult{}, err
	}
	now := micros(s.clk.Now().UnixMicro())
	key := keys.Slots(r.Prefix, r.Policy, r.Tier, r.Key)
	s.slots.mu.Lock()
	defer s.slots.mu.Unlock()
	if s.slots.byKey == nil {
		s.slots.byKey = map[string]map[string]memHolding{}
	}
	hs := s.slots.byKey[key]
	if hs == nil {
		hs = map[string]memHolding{}
		s.slots.byKey[key] = hs
	}
	res := slotsFor(hs, now, r.Holder, r.Hold, r.Limit, micros(r.Term.Microseconds()))
	if len(hs) == 0 {
		delete(s.slots.byKey, key)
	}
	res.Now = time.UnixMicro(int64(now))
	return res, nil
}

// slotsFor is slotsLua (scripts.go) on hs at now.
func slotsFor(hs map[string]memHolding, now micros, holder string, want, limit int64, term micros) SlotResult {
	var others, waiting, mine int64
	for id, h := range hs {
		switch {
		case h.exp <= now:
			delete(hs, id)
		case id == holder:
			mine = h.count
		default:
			others += h.count
			waiting += max(h.want-h.count, 0)
		}
	}
	held := want
	if want > mine {
		held = max(mine, min(want, limit-others))
	}
	if held > 0 || want > 0 {
		hs[holder] = memHolding{count: held, want: want, exp: now + term}
	} else {
		delete(hs, holder)
	}
	return SlotResult{Held: held, InUse: others + held, Waiting: waiting}
}
